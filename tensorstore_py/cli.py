"""tensorstore-py: inspect, verify, collect garbage, copy and export checkpoints and arrays.

::

    tensorstore-py ls URL [--at N] [--local URL] [--json]
    tensorstore-py info URL [--step N | --at N] [--json]
    tensorstore-py history URL [--json]
    tensorstore-py diff URL A B [--json]
    tensorstore-py verify URL [--step N | --all] [--at N] [--local URL] [--json]
    tensorstore-py gc URL [--grace DURATION] [--apply] [--local URL] [--json]
    tensorstore-py cat URL [ARRAY_PATH] [--index "[0:10, :, 5]"] [--out x.npy] [--step N] [--at N]
    tensorstore-py copy SRC DST [--json]
    tensorstore-py export ROOT [--step N] DEST [--format zarr3|safetensors] [--max-shard-size BYTES] [--json]
    tensorstore-py convert ORBAX_RUN DEST [--json]

Exit codes: 0 success; 1 a problem found (``verify``) or the command failed
(nothing at the URL, a missing step, corrupt data, a store error); 2 a usage
error (bad options or arguments). Errors are one readable message on stderr,
never a traceback (set ``TSP_DEBUG=1`` to get one). Long commands (``verify``,
``copy``, ``export``, ``gc --apply``) draw a progress bar on a terminal and
print a one-line summary on stderr otherwise. The command logic lives in
:mod:`tensorstore_py.commands` (each returns data); this module parses
arguments and prints. See docs/CLI.md for the ``--json`` shapes.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from tensorstore_py import __version__
from tensorstore_py.commands import checks, export, inspect, interop, maintenance, printers, tiers
from tensorstore_py.commands.errors import describe
from tensorstore_py.core.errors import InvalidArgumentError, NotFoundError
from tensorstore_py.core.future import spawn
from tensorstore_py.progress import Progress

__all__ = ["EXIT_OK", "EXIT_PROBLEMS", "EXIT_USAGE", "build_parser", "main"]

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2

_DESCRIPTION = """\
Inspect, verify, collect garbage, copy and export checkpoints and arrays.

URL is a local path, file:///abs/dir/, gs://bucket/dir/, s3://bucket/dir/,
http(s)://host/dir/ or versioned+<URL>[@<version>]. Run
`tensorstore-py COMMAND --help` for a command's options; docs/CLI.md has the
JSON shapes. Exit codes: 0 success, 1 a problem found or the command failed,
2 a usage error.
"""

_URL_HELP = "a checkpoint root, versioned store, zarr array or folder (path or URL)"


_LOCAL_HELP = "the checkpoint manager's local tier of this root (each step's tiers are shown)"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse prints usage and exits 2 itself
        self.print_usage(sys.stderr)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(EXIT_USAGE)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _at(c: Any, help: str) -> None:
    """``--at N`` (a version of the store), with the old spelling ``--version N``
    kept as a hidden alias (it clashed with the program's ``--version``)."""
    c.add_argument("--at", dest="at_version", type=_int, metavar="N", help=help)
    c.add_argument("--version", dest="at_version", type=_int, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tensorstore-py", description=_DESCRIPTION,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"tensorstore-py {__version__}",
                   help="print the program's version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def cmd(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        return c

    def json_flag(c: argparse.ArgumentParser) -> None:
        c.add_argument("--json", action="store_true", help="machine-readable output (docs/CLI.md)")

    c = cmd("ls", "list the steps of a checkpoint, the versions of a versioned store, or arrays")
    c.add_argument("url", help=_URL_HELP)
    _at(c, "as of version N of the store")
    c.add_argument("--local", metavar="URL", help=_LOCAL_HELP)
    json_flag(c)

    c = cmd("info", "the arrays stored: shape, dtype, chunks, shards, codecs, sizes")
    c.add_argument("url", help=_URL_HELP)
    g = c.add_mutually_exclusive_group()
    g.add_argument("--step", type=_int, metavar="N", help="checkpoint step (default: the latest)")
    _at(g, "as of version N of the store")
    json_flag(c)

    c = cmd("history", "every commit of a versioned store or checkpoint root")
    c.add_argument("url", help="a checkpoint root or versioned store (path or URL)")
    json_flag(c)

    c = cmd("diff", "which arrays and chunks changed between two steps (checkpoint) or versions")
    c.add_argument("url", help="a checkpoint root or versioned store (path or URL)")
    c.add_argument("a", type=_int, metavar="A", help="the older step (checkpoint) or version")
    c.add_argument("b", type=_int, metavar="B", help="the newer step (checkpoint) or version")
    json_flag(c)

    c = cmd("verify", "read everything, check every checksum and reference, decode every chunk")
    c.add_argument("url", help=_URL_HELP)
    g = c.add_mutually_exclusive_group()
    g.add_argument("--step", type=_int, metavar="N", help="only this checkpoint step's arrays")
    g.add_argument("--all", action="store_true", help="arrays of every retained version")
    _at(c, "verify the arrays as of version N of the store")
    c.add_argument("--local", metavar="URL", help=_LOCAL_HELP + " (verified too)")
    json_flag(c)

    c = cmd("gc", "delete objects no retained version references (dry run unless --apply)")
    c.add_argument("url", help="a checkpoint root or versioned store (path or URL)")
    c.add_argument("--grace", default=None, metavar="DURATION",
                   help="only objects older than this (default 6h; e.g. 0s, 30m, 7d)")
    c.add_argument("--apply", action="store_true", help="really delete")
    c.add_argument("--local", metavar="URL", help="the checkpoint manager's local tier of this root (every local part is collected too)")
    json_flag(c)

    c = cmd("cat", "print or export (.npy) a slice of one array")
    c.add_argument("url", help=_URL_HELP)
    c.add_argument("array", nargs="?", default="", metavar="ARRAY_PATH",
                   help="leaf path in a checkpoint, or array path below URL")
    c.add_argument("--index", metavar="EXPR", help='numpy index, e.g. "[0:10, :, 5]"')
    c.add_argument("--out", metavar="FILE.npy", help="write a .npy file instead of printing")
    c.add_argument("--step", type=_int, metavar="N", help="checkpoint step (default: the latest)")
    _at(c, "as of version N of the store")
    json_flag(c)

    c = cmd("copy", "copy a checkpoint, versioned store or array to another store, verifying it")
    c.add_argument("src", help="what to copy: " + _URL_HELP)
    c.add_argument("dst", help="destination URL or folder: empty, or an interrupted copy of SRC to resume")
    json_flag(c)

    c = cmd("export", "write a checkpoint step as plain zarr v3 arrays (zarr-python, TensorStore read them)")
    c.add_argument("root", help="checkpoint root URL")
    c.add_argument("dest", help="destination URL or folder: empty, or an interrupted export to resume")
    c.add_argument("--step", type=_int, metavar="N", help="checkpoint step (default: the latest)")
    c.add_argument("--format", choices=("zarr3", "safetensors"), default="zarr3",
                   help="zarr3 (default): one zarr v3 array per leaf; safetensors: Hugging Face files")
    c.add_argument("--max-shard-size", type=_int, metavar="BYTES", default=5_000_000_000,
                   help="safetensors: the most bytes per file (default 5000000000, as transformers)")
    json_flag(c)

    c = cmd("convert", "turn an Orbax run folder (or one Orbax step) into a checkpoint: one commit per step")
    c.add_argument("src", help="Orbax run folder or step folder URL")
    c.add_argument("dest", help="checkpoint root URL or folder (steps it already holds are skipped)")
    json_flag(c)
    return p


# -- running -----------------------------------------------------------------------------
def _run(coro: Any) -> Any:
    return spawn(coro).result()


def _emit(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


def _orbax_or(native: Any, orbax: Any) -> Any:
    """The native command's data (``native()``); for a folder that is none of ours,
    the Orbax view of it (``orbax()``) when it is an Orbax run or step."""
    try:
        data = _run(native())
    except (NotFoundError, InvalidArgumentError) as e:  # not ours: a folder given --step, nothing
        found = _run(orbax())
        if found is None:
            raise e from None
        return found
    if data.get("kind") != "folder" or data.get("arrays"):
        return data
    found = _run(orbax())
    return data if found is None else found


def _cmd_ls(a: argparse.Namespace) -> int:
    if a.local:
        data = _run(tiers.ls_tiers(a.url, a.local))
        _emit(printers.dump(data) if a.json else printers.ls(data))
        return EXIT_OK
    data = _orbax_or(lambda: inspect.ls(a.url, version=a.at_version), lambda: interop.orbax_ls(a.url))
    _emit(printers.dump(data) if a.json else printers.ls(data))
    return EXIT_OK


def _cmd_info(a: argparse.Namespace) -> int:
    data = _orbax_or(lambda: inspect.info(a.url, step=a.step, version=a.at_version),
                     lambda: interop.orbax_info(a.url, a.step))
    _emit(printers.dump(data) if a.json else printers.info(data))
    return EXIT_OK


def _cmd_history(a: argparse.Namespace) -> int:
    data = _run(inspect.history(a.url))
    _emit(printers.dump(data) if a.json else printers.history(data))
    return EXIT_OK


def _cmd_diff(a: argparse.Namespace) -> int:
    data = _run(inspect.diff(a.url, a.a, a.b))
    _emit(printers.dump(data) if a.json else printers.diff(data))
    return EXIT_OK


def _progress(a: argparse.Namespace, description: str, unit: str = "B") -> Progress:
    """A bar on a terminal; otherwise one summary line at the end (not with --json,
    whose output holds the counts)."""
    return Progress(description, unit=unit, bar=False if a.json else None, summary=not a.json)


def _cmd_verify(a: argparse.Namespace) -> int:
    if a.local:
        with _progress(a, "verify") as bar:
            reports = _run(tiers.verify_tiers(a.url, a.local, step=a.step, progress=bar))
        if a.json:
            _emit(printers.dump([r.to_json() for r in reports]))
        else:
            _emit("\n".join(printers.verify(r) for r in reports))
        return EXIT_OK if all(r.ok for r in reports) else EXIT_PROBLEMS
    with _progress(a, "verify") as bar:
        report = _run(checks.verify(a.url, step=a.step, all_versions=a.all, version=a.at_version,
                                    progress=bar))
    _emit(printers.dump(report.to_json()) if a.json else printers.verify(report))
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def _cmd_gc(a: argparse.Namespace) -> int:
    grace = None if a.grace is None else maintenance.parse_duration(a.grace)
    # --local: the root, then every local part, each collected on its own
    urls = [a.url] + (_run(tiers.local_parts(a.local)) if a.local else [])
    reports = []
    for url in urls:
        if a.apply:
            with _progress(a, f"gc --apply {url}" if a.local else "gc --apply", unit="objects") as bar:
                reports.append(_run(maintenance.gc(url, grace=grace, apply=True, progress=bar)))
        else:
            reports.append(_run(maintenance.gc(url, grace=grace, apply=False)))
    if not a.local:
        _emit(printers.dump(reports[0]) if a.json else printers.gc(reports[0]))
    else:
        _emit(printers.dump(reports) if a.json else "\n".join(f"{r['url']}:\n{printers.gc(r)}" for r in reports))
    return EXIT_OK


def _cmd_cat(a: argparse.Namespace) -> int:
    try:
        arr = _run(export.cat(a.url, a.array, index=a.index, step=a.step, version=a.at_version))
    except NotFoundError as e:  # an Orbax step's array?
        arr = _run(interop.orbax_cat(a.url, a.array, index=a.index, step=a.step))
        if arr is None:
            raise e from None
    if a.out:
        np.save(a.out, arr, allow_pickle=False)
        sys.stderr.write(f"wrote {a.out}: {arr.dtype} {list(arr.shape)}\n")
    elif a.json:
        _emit(printers.dump({"shape": list(arr.shape), "dtype": str(arr.dtype),
                             "values": arr.tolist()}))
    else:
        _emit(printers.array(arr))
    return EXIT_OK


def _cmd_copy(a: argparse.Namespace) -> int:
    with _progress(a, "copy") as bar:
        data = _run(export.copy(a.src, a.dst, progress=bar))
    _emit(printers.dump(data) if a.json else printers.copy(data))
    return EXIT_OK


def _cmd_export(a: argparse.Namespace) -> int:
    if a.format == "safetensors":
        data = _run(interop.export_to_safetensors(a.root, a.step, a.dest, max_shard_bytes=a.max_shard_size))
        _emit(printers.dump(data) if a.json else printers.export_safetensors(data))
        return EXIT_OK
    with _progress(a, "export") as bar:
        data = _run(export.export_step(a.root, a.step, a.dest, progress=bar))
    _emit(printers.dump(data) if a.json else printers.export(data))
    return EXIT_OK


def _cmd_convert(a: argparse.Namespace) -> int:
    data = _run(interop.convert(a.src, a.dest))
    _emit(printers.dump(data) if a.json else printers.convert(data))
    return EXIT_OK


_COMMANDS = {
    "ls": _cmd_ls, "info": _cmd_info, "history": _cmd_history, "diff": _cmd_diff,
    "verify": _cmd_verify, "gc": _cmd_gc, "cat": _cmd_cat, "copy": _cmd_copy, "export": _cmd_export,
    "convert": _cmd_convert,
}


@contextmanager
def _quiet_credentials_warning() -> Iterator[None]:
    """Every error names the credentials its request used, so the library's
    one-time "no credentials found, using anonymous access" warning would say it
    twice: the CLI drops it (for the command's duration)."""
    loggers = [logging.getLogger(f"tensorstore_py.kvstore.{d}") for d in ("gcs", "s3")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help / --version exit 0, bad usage 2
        return int(e.code or 0)
    try:
        with _quiet_credentials_warning():
            return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        sys.stderr.write("tensorstore-py: interrupted\n")
        return 130
    except BrokenPipeError:  # e.g. `... | head`
        return EXIT_OK
    except BaseException as e:
        if isinstance(e, SystemExit):
            raise
        if os.environ.get("TSP_DEBUG"):
            raise
        code, lines = describe(e)
        for line in lines:
            sys.stderr.write(f"tensorstore-py {args.command}: {line}\n" if line is lines[0] else f"  {line}\n")
        return code


if __name__ == "__main__":
    sys.exit(main())
