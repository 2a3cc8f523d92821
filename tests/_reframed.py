"""Run as a script: re-frame a versioned store's objects with valid framing and
checksums but wrong content, and exercise open, read, list and verify on each.

Prints one JSON line per case: ``{"case", "op", "error", "seconds"}``. Run by
``tests/test_versioned_reframed.py`` in a subprocess (a case that spins on the
event loop would otherwise hang the test process).
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

import tensorstore_py as tsp
from tensorstore_py.core.errors import TensorStoreError
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.versioned import VersionedKvStore
from tensorstore_py.kvstore.versioned.format import (
    HINT_NAME,
    MAGIC_COMMIT,
    MAGIC_HINT,
    MAGIC_NODE,
    frame,
    unframe,
)
from tensorstore_py.kvstore.versioned.root import VersionedRoot
from tensorstore_py.kvstore.versioned.verify import verify

T = 30
ABSURD = [10**18, 2**63 - 1, 2**64 - 1, -1, -(2**63), 0, 10**6]


def build() -> dict[str, bytes]:
    """A store of 4 versions over 700 keys (a two-level index), as raw objects."""
    mem = MemoryKvStore()
    kv = VersionedKvStore(mem)
    with tsp.Transaction() as txn:
        view = kv.with_transaction(txn)
        for i in range(700):
            view.write(f"k/{i:04d}", b"v%d" % i).result(T)
    kv.write("k/0001", b"x" * 5000).result(T)  # a data object
    kv.write("k/0002", b"y").result(T)
    kv.delete_versions([1]).result(T)
    time.sleep(1.2)  # the trailing hint rewrite
    return {k: bytes(mem.read(k).result(T).value) for k in mem.list().result(T)}


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


def _set(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    doc[path[0]] = _set(doc[path[0]], path[1:], value)
    return doc


def mutations(objects: dict[str, bytes], rng: random.Random, n: int) -> list[tuple[str, str, Any]]:
    """(name, description, new body) of ``n`` cases: plausible but wrong content."""
    magic = {"commits/": MAGIC_COMMIT, "nodes/": MAGIC_NODE, HINT_NAME: MAGIC_HINT}
    framed = [(k, m) for k in sorted(objects) for p, m in magic.items() if k.startswith(p)]
    nodes = [k for k, _ in framed if k.startswith("nodes/")]
    commits = [k for k, _ in framed if k.startswith("commits/")]
    out = []
    # the named findings first: a node that references itself, its parent, an absurd hint
    head = unframe(MAGIC_COMMIT, objects[commits[-1]], commits[-1])
    newest_root = head["root"]
    for name in [newest_root] + [k for k in nodes if k != newest_root]:
        body = unframe(MAGIC_NODE, objects[name], name)
        if body["t"] == "inner":
            for i in range(len(body["c"])):
                b = json.loads(json.dumps(body))
                b["c"][i] = name
                where = "the newest root" if name == newest_root else "a node"
                out.append((name, f"inner child {i} of {where} is the node itself", b))
            for child in body["c"]:
                cb = unframe(MAGIC_NODE, objects[child], child)
                if cb["t"] == "leaf":
                    out.append((child, "leaf turned into an inner node pointing at its parent",
                                {"t": "inner", "k": cb["k"][:1], "c": [name], "n": [1]}))
                    break
    for v in ABSURD:
        out.append((HINT_NAME, f"hint names version {v}", {"version": v}))
        for c in commits:
            for field in ("version", "parent", "count"):
                b = unframe(MAGIC_COMMIT, objects[c], c)
                if isinstance(b, dict):
                    b[field] = v
                    out.append((c, f"{field} = {v}", b))
    while len(out) < n:
        name, m = rng.choice(framed)
        body = unframe(m, objects[name], name)
        path = rng.choice(_paths(body))
        choice = rng.choice([
            name, rng.choice(nodes), rng.choice(ABSURD), [[1, 10**18]], [], {}, None, "x", [name],
            {"best": 10**18}, 1.5, True,
        ])
        try:
            mutated = _set(body, path, choice)
        except (TypeError, KeyError, IndexError):
            continue
        out.append((name, f"{path} = {choice!r:.60}", mutated))
    return out[:n] if len(out) > n else out


def run(objects: dict[str, bytes], name: str, body: Any) -> list[tuple[str, str | None, float]]:
    m = {"commits/": MAGIC_COMMIT, "nodes/": MAGIC_NODE}.get(name[:name.index("/") + 1] if "/" in name else "", MAGIC_HINT)
    mem = MemoryKvStore()
    for k, v in objects.items():
        mem.write(k, frame(m, body) if k == name else v).result(T)
    kv = VersionedKvStore(mem)
    kv._root = VersionedRoot(mem)  # cold caches, as a new process has
    res = []
    ops = [
        ("newest", lambda: kv.newest_version().result(T)),
        ("read", lambda: [kv.read(f"k/{i:04d}").result(T) for i in (0, 1, 350, 699)]),
        ("list", lambda: kv.list("k/").result(T)),
        ("versions", lambda: kv.versions().result(T)),
        ("read_v2", lambda: kv.snapshot(2).read("k/0500").result(T)),
        ("write", lambda: kv.write("k/0003", b"z").result(T)),
        ("verify", lambda: verify(VersionedKvStore(mem)).result(T)),
    ]
    for op, fn in ops:
        t0 = time.monotonic()
        err = None
        try:
            fn()
        except TensorStoreError as e:
            err = type(e).__name__
        except BaseException as e:  # reported as untyped
            err = f"UNTYPED {type(e).__name__}: {e}"[:200]
        res.append((op, err, time.monotonic() - t0))
    return res


def main() -> None:
    seed, n = int(sys.argv[1]), int(sys.argv[2])
    objects = build()
    for name, what, body in mutations(objects, random.Random(seed), n):
        print(json.dumps({"case": f"{name}: {what}"}), flush=True)
        for op, err, dt in run(objects, name, body):
            print(json.dumps({"case": f"{name}: {what}", "op": op, "error": err, "seconds": round(dt, 3)}),
                  flush=True)


if __name__ == "__main__":
    main()
