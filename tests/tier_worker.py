"""A process that saves steps forever with a local tier, to be killed with SIGKILL.

Usage: python tier_worker.py PERSISTENT_URL LOCAL_URL

Every step is saved to the local tier, every 2nd is promoted to the persistent
root; small chunks keep both kinds of commits in flight for a while. Prints
"saved N" as each save returns. A restart restores the newest step first (and
so finishes a promotion a kill cut).
"""

from __future__ import annotations

import sys

import numpy as np


def expected(step: int) -> dict[str, object]:
    base = np.arange(1 << 20, dtype=np.float32).reshape(256, -1)
    return {"w": base + np.float32(step), "b": {"v": np.full(1000, step, np.int64)}, "step": step}


def _say(line: str) -> None:
    """One write per line (callbacks print from the library's threads too)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    root, local = sys.argv[1], sys.argv[2]
    import tensorstore_py as tsp
    from tensorstore_py.checkpoint import SaveOptions

    mgr = tsp.CheckpointManager(
        root, local=local, local_max_to_keep=2, persist_interval_steps=2, max_to_keep=2,
        options=SaveOptions(target_chunk_bytes=64 << 10, max_bytes_in_flight=1 << 20),
    )
    latest = mgr.latest_step()
    if latest is not None:
        # as a restarted job does: this also promotes the step restored from the
        # local tier again when a kill cut its promotion
        out = mgr.restore()
        assert out["step"] == latest, (out["step"], latest)
    step = (latest or 0) + 1
    print("ready", flush=True)
    while True:
        fut = mgr.save(step, expected(step))
        _say(f"saved {step}")
        fut.add_done_callback(lambda f, s=step: f.exception() or _say(f"local {s}"))
        promotion = mgr._tiers.promotion  # type: ignore[union-attr]
        if step % 2 == 0 and promotion is not None:
            promotion.add_done_callback(lambda f, s=step: f.exception() or _say(f"promoted {s}"))
        step += 1


if __name__ == "__main__":
    main()
