"""Human-readable rendering of the commands' data (``--json`` prints the data itself)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorstore_py.commands.output import dump_json, format_table, human_size, human_time, style
from tensorstore_py.commands.problems import VerifyReport

__all__ = ["array", "copy", "diff", "dump", "gc", "history", "info", "ls", "verify"]


def dump(data: Any) -> str:
    return dump_json(data)


def _shape(s: Any) -> str:
    return "-" if s is None else "(" + ", ".join(str(n) for n in s) + ("," if len(s) == 1 else "") + ")"


def _short(write_id: str) -> str:
    return write_id[:12] if write_id else "-"


def _metrics(m: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(m.items()))


def _header(data: dict[str, Any]) -> str:
    bits = [style(data["url"], "bold"), data["kind"]]
    if data.get("version") is not None:
        bits.append(f"version {data['version']}")
    if data.get("step") is not None:
        bits.append(f"step {data['step']}")
    return "  ".join(bits)


def _sharding(s: Any) -> str | None:
    """``{"mesh": {"x": 2}, "spec": ["x", null]}`` -> ``P('x', None) on x=2``."""
    if not s:
        return None
    if not isinstance(s, dict):
        return str(s)
    spec = ", ".join("None" if p is None else repr(p) if isinstance(p, str) else str(tuple(p))
                     for p in s.get("spec") or [])
    mesh = ",".join(f"{k}={v}" for k, v in (s.get("mesh") or {}).items())
    return f"P({spec}) on {mesh}" if mesh else f"P({spec})"


def _arrays_table(arrays: list[dict[str, Any]], *, detail: bool) -> str:
    if not arrays:
        return "(no arrays)"
    if not detail:
        rows = [[a["path"] or ".", _shape(a["shape"]), a["dtype"], _shape(a["chunk_shape"]),
                 human_size(a.get("stored_bytes"))] for a in arrays]
        return format_table(["PATH", "SHAPE", "DTYPE", "CHUNKS", "STORED"], rows, right=[4])
    rows = []
    for a in arrays:
        ratio = a.get("compression_ratio")
        sharding = _sharding(a.get("sharding"))
        rows.append([
            a["path"] or ".", _shape(a["shape"]), a["dtype"], _shape(a["chunk_shape"]),
            _shape(a.get("shard_shape")), ",".join(a.get("codecs") or []) or "-",
            human_size(a["nbytes"]), human_size(a.get("stored_bytes")),
            f"{ratio:.2f}x" if ratio else "-", str(sharding) if sharding else "-",
        ])
    return format_table(
        ["PATH", "SHAPE", "DTYPE", "CHUNK", "SHARD", "CODECS", "SIZE", "STORED", "RATIO", "SAVED SHARDING"],
        rows, right=[6, 7, 8],
    )


def ls(data: dict[str, Any]) -> str:
    out = [_header(data)]
    if data["kind"] == "checkpoint" and "local" in data:  # ls --local: each step's tiers
        rows = [[s["step"], human_time(s["time"]), human_size(s["nbytes"]), ", ".join(s["tiers"]),
                 _metrics(s["metrics"])] for s in data["steps"]]
        out.append(format_table(["STEP", "TIME", "SIZE", "TIERS", "METRICS"], rows, right=[0, 2])
                   if rows else "(no steps)")
        out.append(f"local tier: {data['local']} ({len(data['local_roots'])} part root(s))")
        out.extend(f"note: {n}" for n in data.get("local_notes", []))
    elif data["kind"] == "checkpoint":
        rows = [[s["step"], human_time(s["time"]), human_size(s["nbytes"]),
                 human_size(s.get("bytes_added")), s.get("readable_version") or s["version"] or "-",
                 _short(s["write_id"]) + ("*" if s.get("retired") else ""), _metrics(s["metrics"])]
                for s in data["steps"]]
        out.append(format_table(["STEP", "TIME", "SIZE", "ADDED", "VERSION", "WRITE-ID", "METRICS"], rows,
                                right=[0, 2, 3, 4]) if rows else "(no steps)")
        retired = [s for s in data["steps"] if s.get("retired")]
        if retired:
            by = ", ".join(f"step {s['step']}: version {s['version'] or '?'}" for s in retired[:6])
            out.append(
                f"* published by a version that retention has since retired ({by}"
                f"{', ...' if len(retired) > 6 else ''}; see `history`);\n"
                f"  VERSION is the oldest kept version holding the step, unchanged since (for --at)")
    elif data["kind"] == "versioned":
        rows = [[v["version"], human_time(v["time"]), v["kind"], v["keys"],
                 human_size(v["bytes_written"]), _short(v["write_id"]), ",".join(v["tags"]) or "",
                 v["message"]] for v in data["versions"]]
        out.append(format_table(["VERSION", "TIME", "KIND", "KEYS", "WRITTEN", "WRITE-ID", "TAGS",
                                 "MESSAGE"], rows, right=[0, 3, 4]) if rows else "(no versions)")
    elif data["kind"] == "orbax run":
        rows = [[s["step"], human_time(s["time"]), ",".join(s["items"]) or "-", _metrics(s["metrics"])]
                for s in data["steps"]]
        out.append(format_table(["STEP", "TIME", "ITEMS", "METRICS"], rows, right=[0]))
    elif data["kind"] == "orbax step":
        out.append("items: " + (", ".join(i or "(the step itself)" for i in data["items"])))
    else:
        out.append(_arrays_table(data["arrays"], detail=False))
    return "\n".join(out)


def info(data: dict[str, Any]) -> str:
    out = [_header(data), _arrays_table(data["arrays"], detail=True)]
    scalars = data.get("scalars") or []
    if scalars:
        out.append("scalars: " + ", ".join(f"{s['path']}={(s['value'] or {}).get('v')}" for s in scalars))
    return "\n".join(out)


def history(data: dict[str, Any]) -> str:
    rows = []
    for c in data["commits"]:
        rows.append([
            c["version"], human_time(c["time"]), c["kind"] + (" (deleted)" if c["deleted"] else ""),
            "-" if c.get("step") is None else c["step"], c["keys"],
            "-" if c["keys_changed"] is None else c["keys_changed"], _short(c["write_id"]),
            ",".join(c["tags"]), c["message"],
        ])
    table = format_table(["VERSION", "TIME", "KIND", "STEP", "KEYS", "CHANGED", "WRITE-ID", "TAGS",
                          "MESSAGE"], rows, right=[0, 4, 5]) if rows else "(no commits)"
    return _header(data) + "\n" + table


def _list(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def diff(data: dict[str, Any]) -> str:
    what = "step" if data["kind"] == "checkpoint" else "version"
    out = [f"{style(data['url'], 'bold')}  {what} {data['a']} -> {what} {data['b']}"]
    rows = []
    for a in data["arrays"]:
        status = a.get("status") or ("changed" if any(a.get(f) for f in
                                     ("chunks_added", "chunks_removed", "chunks_changed")) else "unchanged")
        rows.append([a["path"] or ".", status, len(a.get("chunks_added") or []),
                     len(a.get("chunks_removed") or []), len(a.get("chunks_changed") or [])])
    out.append(format_table(["ARRAY", "STATUS", "+CHUNKS", "-CHUNKS", "~CHUNKS"], rows, right=[2, 3, 4])
               if rows else "(no arrays)")
    for a in data["arrays"]:
        if a.get("chunks_changed"):
            out.append(f"  {a['path'] or '.'}: changed {_list(a['chunks_changed'])}")
    keys = data.get("keys") or {}
    for k in ("added", "removed", "changed"):
        if keys.get(k):
            out.append(f"keys {k}: {_list(keys[k])}")
    return "\n".join(out)


def verify(r: VerifyReport) -> str:
    lines = []
    for p in r.problems:
        lines.append(f"{style('PROBLEM', 'red')} [{p.kind}] {p.message}")
    scope = []
    if r.versions:
        scope.append(f"{len(r.versions)} version(s)")
    if r.steps:
        scope.append(f"{len(r.steps)} step(s)")
    scope.append(f"{r.arrays} array(s), {r.chunks} chunk(s), {r.objects} object(s), {r.values} value(s)")
    summary = (f"{r.url} ({r.kind}): checked " + ", ".join(scope) + f"; {human_size(r.bytes_verified)} "
               f"verified, {human_size(r.bytes_read)} read in {r.seconds:.1f}s")
    if r.ok:
        lines.append(f"{style('OK', 'green')} {summary}")
    else:
        lines.append(f"{style('FAILED', 'red')} {len(r.problems)} problem(s); {summary}")
    if r.unreferenced:
        lines.append(
            f"{style('NOTE', 'yellow')} {r.unreferenced} object(s) ({human_size(r.unreferenced_bytes)}) "
            f"no retained version references: left by interrupted writes or deleted versions; "
            f"`tensorstore-py gc {r.url}` lists them (--apply deletes them)"
        )
    return "\n".join(lines)


def gc(data: dict[str, Any]) -> str:
    out = []
    if data["objects"]:
        out.append("\n".join(data["objects"]))
    verb = "deleted" if data["applied"] else "would delete"
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(data["by_kind"].items()))
    out.append(
        f"{verb} {data['count']} object(s){' (' + kinds + ')' if kinds else ''}, "
        f"{human_size(data['bytes'])}; kept {data['kept_referenced']} referenced "
        f"({human_size(data['kept_referenced_bytes'])}) and {data['kept_young']} younger than "
        f"the grace period of {data['grace_seconds']:g}s ({human_size(data['kept_young_bytes'])}); "
        f"{data['retained_versions']} version(s) retained"
    )
    if data.get("kept_leased"):
        out.append(f"kept {data['kept_leased']} more that live writers' leases claim "
                   f"({data['leases']} live lease(s))")
    if data.get("deferred_versions"):
        out.append(f"deleted version(s) {data['deferred_versions']} are still being read (reader "
                   f"leases): their objects go once the readers are done")
    if data.get("temporaries"):
        verb_t = "removed" if data["applied"] else "would remove"
        out.append(f"{verb_t} {len(data['temporaries'])} temporary file(s) of crashed writers:\n"
                   + "\n".join(data["temporaries"]))
    if not data["applied"] and (data["count"] or data.get("temporaries")):
        out.append("dry run: nothing was deleted; run again with --apply to delete")
    return "\n".join(out)


def array(a: np.ndarray) -> str:
    with np.printoptions(threshold=1000, linewidth=120):
        return f"{a.dtype} {list(a.shape)}\n{a!r}" if a.ndim else repr(a.item())


def copy(data: dict[str, Any]) -> str:
    return (f"copied {data['kind']} {data['src']} -> {data['dst']}: {data['objects']} object(s), "
            f"{human_size(data['bytes'])}, every checksum verified")


def export(data: dict[str, Any]) -> str:
    return (f"exported step {data['step']} of {data['root']} -> {data['dest']}: {data['arrays']} zarr v3 "
            f"array(s), {data['scalars']} scalar(s) in the root group's attributes, "
            f"{data['objects']} object(s), {human_size(data['bytes'])}")


def export_safetensors(data: dict[str, Any]) -> str:
    return (f"exported step {data['step']} of {data['root']} -> {data['dest']}: {data['tensors']} tensor(s) "
            f"in {len(data['files'])} file(s) ({', '.join(data['files'])}), {human_size(data['bytes'])}")


def convert(data: dict[str, Any]) -> str:
    line = f"converted {data['src']} -> {data['dest']}: step(s) {data['converted'] or 'none'}"
    return line + (f"; already there: {data['skipped']}" if data["skipped"] else "")
