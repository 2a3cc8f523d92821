"""The kvstore layer in one page: create-only, compare-and-swap, byte ranges.

Run: python examples/kvstore_basics.py [--root DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import threading

import tensorstore_py as tsp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", help="directory for the file store (default: a temp dir)")
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="tsp-kv-")
    kv = tsp.KvStore.open(f"file://{root}/").result()
    print("store:", kv)

    gen = kv.write("hello.txt", b"hello, world", if_equal=tsp.Generation.NO_VALUE).result()
    try:
        kv.write("hello.txt", b"clobber", if_equal=tsp.Generation.NO_VALUE).result()
    except tsp.ConditionFailedError as e:
        print("create-only refused a second create:", e)
    print("bytes 7..12:", bytes(kv.read("hello.txt", byte_range=slice(7, 12)).result().value))
    print("unchanged since write:", kv.read("hello.txt", if_not_equal=gen).result().state)

    # Four threads increment one counter by compare-and-swap: no update is lost.
    kv.write("counter", b"0").result()

    def worker() -> None:
        for _ in range(25):
            while True:
                r = kv.read("counter").result()
                try:
                    kv.write("counter", b"%d" % (int(bytes(r.value)) + 1), if_equal=r.generation).result()
                    break
                except tsp.ConditionFailedError:
                    continue

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = int(bytes(kv.read("counter").result().value))
    print("counter after 4 x 25 CAS increments:", final)
    if final != 100:
        raise SystemExit(f"lost updates: expected 100, found {final}")
    print("keys:", kv.list().result())


if __name__ == "__main__":
    main()
