"""``tensorstore-py``: inspect, verify, collect garbage and export checkpoints and arrays.

::

    tensorstore-py ls URL [--json]
    tensorstore-py info URL [--step N | --version N] [--json]
    tensorstore-py history URL [--json]
    tensorstore-py diff URL A B [--json]
    tensorstore-py verify URL [--step N | --all] [--json]
    tensorstore-py gc URL [--grace DURATION] [--apply] [--json]
    tensorstore-py cat URL [ARRAY_PATH] [--index "[0:10, :, 5]"] [--out x.npy] [--step N]
    tensorstore-py copy SRC DST [--json]
    tensorstore-py export ROOT [--step N] DEST [--json]

Exit codes: 0 success; 1 a problem found (``verify``) or the command failed
(nothing at the URL, a missing step, corrupt data, a store error); 2 a usage
error (bad options or arguments). Errors are one readable message on stderr,
never a traceback (set ``TSP_DEBUG=1`` to get one). The command logic lives in
:mod:`tensorstore_py.commands` (each returns data); this module parses
arguments and prints. See docs/CLI.md for the ``--json`` shapes.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from tensorstore_py import __version__
from tensorstore_py.commands import checks, export, inspect, maintenance, printers
from tensorstore_py.commands.errors import describe
from tensorstore_py.commands.output import progress
from tensorstore_py.core.future import spawn

__all__ = ["EXIT_OK", "EXIT_PROBLEMS", "EXIT_USAGE", "build_parser", "main"]

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2


class _UsageError(Exception):
    pass


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


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tensorstore-py", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"tensorstore-py {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def cmd(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        return c

    def json_flag(c: argparse.ArgumentParser) -> None:
        c.add_argument("--json", action="store_true", help="machine-readable output (docs/CLI.md)")

    c = cmd("ls", "list the steps of a checkpoint, the versions of a versioned store, or arrays")
    c.add_argument("url")
    c.add_argument("--version", dest="at_version", type=_int, metavar="N", help="as of version N")
    json_flag(c)

    c = cmd("info", "the arrays stored: shape, dtype, chunks, shards, codecs, sizes")
    c.add_argument("url")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--step", type=_int, metavar="N", help="checkpoint step (default: the latest)")
    g.add_argument("--version", dest="at_version", type=_int, metavar="N", help="store version")
    json_flag(c)

    c = cmd("history", "every commit of a versioned store or checkpoint root")
    c.add_argument("url")
    json_flag(c)

    c = cmd("diff", "which arrays and chunks changed between two steps (checkpoint) or versions")
    c.add_argument("url")
    c.add_argument("a", type=_int)
    c.add_argument("b", type=_int)
    json_flag(c)

    c = cmd("verify", "read everything, check every checksum and reference, decode every chunk")
    c.add_argument("url")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--step", type=_int, metavar="N", help="only this checkpoint step's arrays")
    g.add_argument("--all", action="store_true", help="arrays of every retained version")
    c.add_argument("--version", dest="at_version", type=_int, metavar="N", help="pin a version")
    json_flag(c)

    c = cmd("gc", "delete objects no retained version references (dry run unless --apply)")
    c.add_argument("url")
    c.add_argument("--grace", default=None, metavar="DURATION",
                   help="only objects older than this (default 6h; e.g. 0s, 30m, 7d)")
    c.add_argument("--apply", action="store_true", help="really delete")
    json_flag(c)

    c = cmd("cat", "print or export (.npy) a slice of one array")
    c.add_argument("url")
    c.add_argument("array", nargs="?", default="", metavar="ARRAY_PATH",
                   help="leaf path in a checkpoint, or array path below URL")
    c.add_argument("--index", metavar="EXPR", help='numpy index, e.g. "[0:10, :, 5]"')
    c.add_argument("--out", metavar="FILE.npy", help="write a .npy file instead of printing")
    c.add_argument("--step", type=_int, metavar="N", help="checkpoint step (default: the latest)")
    c.add_argument("--version", dest="at_version", type=_int, metavar="N", help="store version")
    json_flag(c)

    c = cmd("copy", "copy a checkpoint, versioned store or array to another store, verifying it")
    c.add_argument("src")
    c.add_argument("dst")
    json_flag(c)

    c = cmd("export", "write a checkpoint step as plain zarr v3 arrays (zarr-python, TensorStore read them)")
    c.add_argument("root", help="checkpoint root URL")
    c.add_argument("dest", help="destination URL or folder: empty, or an interrupted export to resume")
    c.add_argument("--step", type=_int, metavar="N", help="checkpoint step (default: the latest)")
    json_flag(c)
    return p


# -- running -----------------------------------------------------------------------------
def _run(coro: Any) -> Any:
    return spawn(coro).result()


def _emit(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


def _cmd_ls(a: argparse.Namespace) -> int:
    data = _run(inspect.ls(a.url, version=a.at_version))
    _emit(printers.dump(data) if a.json else printers.ls(data))
    return EXIT_OK


def _cmd_info(a: argparse.Namespace) -> int:
    data = _run(inspect.info(a.url, step=a.step, version=a.at_version))
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


def _cmd_verify(a: argparse.Namespace) -> int:
    with progress("verifying", unit="items", enabled=None if not a.json else False) as bar:
        report = _run(checks.verify(a.url, step=a.step, all_versions=a.all, version=a.at_version,
                                    on_items=bar.advance))
    _emit(printers.dump(report.to_json()) if a.json else printers.verify(report))
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def _cmd_gc(a: argparse.Namespace) -> int:
    grace = None if a.grace is None else maintenance.parse_duration(a.grace)
    data = _run(maintenance.gc(a.url, grace=grace, apply=a.apply))
    _emit(printers.dump(data) if a.json else printers.gc(data))
    return EXIT_OK


def _cmd_cat(a: argparse.Namespace) -> int:
    arr = _run(export.cat(a.url, a.array, index=a.index, step=a.step, version=a.at_version))
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
    with progress("copying", unit="B", enabled=None if not a.json else False) as bar:
        data = _run(export.copy(a.src, a.dst, on_bytes=bar.advance))
    _emit(printers.dump(data) if a.json else printers.copy(data))
    return EXIT_OK


def _cmd_export(a: argparse.Namespace) -> int:
    with progress("exporting", unit="B", enabled=None if not a.json else False) as bar:
        data = _run(export.export_step(a.root, a.step, a.dest, on_bytes=bar.advance))
    _emit(printers.dump(data) if a.json else printers.export(data))
    return EXIT_OK


_COMMANDS = {
    "ls": _cmd_ls, "info": _cmd_info, "history": _cmd_history, "diff": _cmd_diff,
    "verify": _cmd_verify, "gc": _cmd_gc, "cat": _cmd_cat, "copy": _cmd_copy, "export": _cmd_export,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help / --version exit 0, bad usage 2
        return int(e.code or 0)
    try:
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
