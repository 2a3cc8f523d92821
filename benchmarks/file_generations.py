"""What unique file-store generations cost: the per-write token in the xattr
``user.tsp.gen`` next to the stat stamp alone, same run.

    python benchmarks/file_generations.py [--ops 3000] [--rounds 7] [--size-kib 4] [--dir DIR]

Two stores over the same filesystem: the file store as it is (each write stores
a random token with the file, each read fetches it: one ``fsetxattr`` /
``fgetxattr`` more) and the same store told the filesystem keeps no xattrs (its
generations are the stat stamp alone). Per round, in alternating order: whole
reads of one small value (page cache, called on this thread: no pool hop, so
the per-operation cost shows) and compare-and-swap rewrites (``sync=False``: no
fsync, which would hide everything else). Prints ``name: value unit`` lines
(medians over the rounds) and ``ratio_*`` = token / stamp.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _harness import emit, scratch_dir

from tensorstore_py.kvstore._files import NO_XATTRS, Token
from tensorstore_py.kvstore.file import FileKvStore


class StampOnly(FileKvStore):
    """The file store on a filesystem without xattrs: the stat stamp alone."""

    def _store_token(self, fd: int, token: bytes) -> bool:
        return False

    def _token(self, file: int | str) -> Token:
        return NO_XATTRS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=3000, help="reads per round (a third as many CAS writes)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--size-kib", type=float, default=4.0)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args()
    value = os.urandom(int(args.size_kib * 1024))
    us: dict[str, list[float]] = {f"{op}_{kind}": [] for op in ("read", "cas") for kind in ("token", "stamp")}
    with scratch_dir("tsp-bench-gen-", args.dir) as d:
        stores = {"token": FileKvStore(path=d + "/token", sync=False),
                  "stamp": StampOnly(path=d + "/stamp", sync=False)}
        for kv in stores.values():
            kv._write_sync(kv.path + "k", value, None)
        for rnd in range(args.rounds):
            for kind in ("token", "stamp") if rnd % 2 else ("stamp", "token"):
                kv = stores[kind]
                path = kv.path + "k"
                t0 = time.perf_counter()
                for _ in range(args.ops):
                    g = kv._read_sync(path, None, None).generation
                us[f"read_{kind}"].append((time.perf_counter() - t0) / args.ops * 1e6)
                n = max(1, args.ops // 3)
                t0 = time.perf_counter()
                for _ in range(n):
                    g = kv._write_sync(path, value, g)
                us[f"cas_{kind}"].append((time.perf_counter() - t0) / n * 1e6)
    print(f"value: {args.size_kib:g} KiB, {args.ops} reads and {max(1, args.ops // 3)} CAS writes per "
          f"round, {args.rounds} rounds (medians)")
    for name, xs in us.items():
        emit(f"file_{name}", statistics.median(xs), "us", digits=1)
    for op in ("read", "cas"):
        emit(f"ratio_{op}_token_vs_stamp", statistics.median(us[f"{op}_token"]) /
             statistics.median(us[f"{op}_stamp"]), digits=2)


if __name__ == "__main__":
    main()
