"""Fault scenarios shared by the gcs and s3 tests: lost answers of conditional
requests (scripted through the fault proxy) and a ledger CAS race whose every
increment is accounted for.

``proxied(proxy)`` opens the store under test through a FaultProxy; ``direct``
is the same bucket without it (the ground truth, and "another writer").
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import pytest

import tensorstore_py as tsp
from tensorstore_py.errors import CommitOutcomeUnknownError, ConditionFailedError
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.testing.fault_proxy import FaultProxy

T = 120
PATIENT = {"max_attempts": 25, "initial_delay": 0.002, "max_delay": 0.05}


def ledger_increments(store: KvStore, key: str, n: int, worker: str) -> dict[str, int]:
    """``n`` increments of a ledger (a JSON list of increment ids) by compare-and-swap.

    A lost race (ConditionFailedError) retries the SAME id: if the store wrongly
    called a landed write lost, that id shows up twice in the ledger. An
    unknown outcome is resolved by reading the ledger back."""
    done = unknown = 0
    while done < n:
        inc = f"{worker}-{done}"
        r = store.read(key).result(T)
        ids = json.loads(bytes(r.value))
        try:
            store.write(key, json.dumps(ids + [inc]).encode(), if_equal=r.generation).result(T)
        except ConditionFailedError:
            continue
        except CommitOutcomeUnknownError as e:
            assert e.key is not None and e.key.endswith(key) and e.write_id, e
            unknown += 1
            if inc not in json.loads(bytes(store.read(key).result(T).value)):
                continue  # it did not land: try again (with the same id)
        done += 1
    return {"done": done, "unknown": unknown}


def ledger_race(store: KvStore, direct: KvStore, workers: int, n: int) -> dict[str, int]:
    """``workers`` threads x ``n`` ledger increments; asserts every increment
    landed exactly once. Returns how many outcomes were unknown."""
    direct.write("ledger", b"[]", if_equal=tsp.Generation.NO_VALUE).result(T)
    errors: list[BaseException] = []
    stats: list[dict[str, int]] = []

    def run(w: int) -> None:
        try:
            stats.append(ledger_increments(store, "ledger", n, f"w{w}"))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    ledger = json.loads(bytes(direct.read("ledger").result(T).value))
    acknowledged = sum(s["done"] for s in stats)
    duplicates = sorted({i for i in ledger if ledger.count(i) > 1})
    assert not duplicates, f"increments applied twice: {duplicates}"
    assert len(ledger) == acknowledged == workers * n, (len(ledger), acknowledged)
    return {"landed": len(ledger), "acknowledged": acknowledged,
            "unknown": sum(s["unknown"] for s in stats)}


def lost_answer_scenarios(
    proxied: Callable[[FaultProxy], KvStore], direct: KvStore, upstream: str,
    *, delete_requests: int,
) -> None:
    """Conditional writes and deletes whose first answer is lost (or refused), with
    or without another writer acting in that window. ``delete_requests``: how many
    requests a conditional delete sends before the DELETE itself, plus one."""
    other: dict[str, Any] = {}

    def another_writer(kind: str, head: bytes) -> None:
        act = other.pop("act", None)
        if act is not None:
            act()

    with FaultProxy(upstream, fault_rate=0.0, on_fault=another_writer) as proxy:
        kv = proxied(proxy)

        # 1. a CAS lands, its answer is lost, nobody else writes: success, ours is there
        g0 = direct.write("k", b"0").result(T)
        proxy.script(["lost_response"])
        g1 = kv.write("k", b"mine", if_equal=g0).result(T)
        r = direct.read("k").result(T)
        assert bytes(r.value) == b"mine" and r.generation == g1

        # 2. ... and another writer swaps it before the retry: outcome unknown, never
        #    ConditionFailedError (the caller would apply its update twice)
        other["act"] = lambda: direct.write(
            "k", b"theirs", if_equal=direct.read("k").result(T).generation).result(T)
        proxy.script(["lost_response"])
        with pytest.raises(CommitOutcomeUnknownError) as info:
            kv.write("k", b"mine again", if_equal=g1).result(T)
        assert info.value.write_id and info.value.key is not None and info.value.key.endswith("k")
        assert not isinstance(info.value, ConditionFailedError)
        assert bytes(direct.read("k").result(T).value) == b"theirs"

        # 3. refused outright (503: not carried out) while another writer swaps it:
        #    a plain lost race
        g = direct.read("k").result(T).generation
        other["act"] = lambda: direct.write("k", b"third", if_equal=g).result(T)
        proxy.script(["503"])
        with pytest.raises(ConditionFailedError):
            kv.write("k", b"stale", if_equal=g).result(T)
        assert bytes(direct.read("k").result(T).value) == b"third"

        # 4. a create-only write whose answer is lost is recognised by its write-id
        proxy.script(["lost_response"])
        gc = kv.write("fresh", b"created", if_equal=tsp.Generation.NO_VALUE).result(T)
        assert direct.read("fresh").result(T).generation == gc

        # 5. a conditional delete that landed, answer lost: the retry finds the key
        #    gone, which may be someone else's delete: not "success"
        gd = direct.write("d", b"x").result(T)
        proxy.script([None] * (delete_requests - 1) + ["lost_response"])
        with pytest.raises(CommitOutcomeUnknownError):
            kv.delete("d", if_equal=gd).result(T)
        assert direct.read("d").result(T).state == "missing"

        # 6. a conditional delete refused outright while another writer deletes: lost
        gd = direct.write("d", b"y").result(T)
        other["act"] = lambda: direct.delete("d").result(T)
        proxy.script([None] * (delete_requests - 1) + ["503"])
        with pytest.raises(ConditionFailedError):
            kv.delete("d", if_equal=gd).result(T)
        assert not other
