"""A restore reads chunks of whole rows straight into the rows of their host
result (restoring.py, ``lands == "rows"``): no slot of the host pool, no copy,
and the same bytes as every other path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.checkpoint import SaveOptions, hostpool, restoring

MiB = 1 << 20


def _made() -> int:
    return sum(p.made_total for p in hostpool._pools.values())


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_chunks_of_whole_rows_land_in_the_result_and_read_back_exactly(
    tmp_path: Path, compression: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(5)
    tree = {
        "rows": rng.standard_normal((2048, 1024)).astype(np.float32),  # 8 MiB: 4 chunks of rows
        "odd": rng.integers(0, 1 << 30, (1000, 700), dtype=np.int64),  # a partial last chunk
    }
    opts = SaveOptions(target_chunk_bytes=2 * MiB, compression=compression, pack_small_leaves=False)
    mgr = tsp.CheckpointManager(f"file://{tmp_path}/", options=opts)
    mgr.save(1, tree).result()
    landed: list[str] = []
    plan = restoring.plan_buffers

    def spy(crs: list, budget: int):  # type: ignore[no-untyped-def]
        pool = plan(crs, budget)
        landed.extend(cr.lands for cr in crs)
        return pool

    monkeypatch.setattr(restoring, "plan_buffers", spy)
    before = _made()
    got = mgr.restore(1, max_bytes_in_flight=4 * MiB)
    for k, v in tree.items():
        assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), k
    assert "slot" not in landed and landed.count("rows") >= 4, landed
    assert _made() == before  # no buffer of the pool was made
    # the result owns its memory: a second restore leaves the first unchanged
    again = mgr.restore(1, max_bytes_in_flight=4 * MiB)
    again["rows"][:] = 0
    assert got["rows"].tobytes() == tree["rows"].tobytes()
