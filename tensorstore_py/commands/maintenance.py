"""``gc``: garbage-collect a versioned store / checkpoint root (dry run by default).

The collection itself is :func:`tensorstore_py.kvstore.versioned.gc.gc`: it
marks everything the retained versions reference and deletes only unmarked
objects older than the grace period (by the store's clock) that no live
writer's lease claims, so saves in flight are never robbed and no retained
version loses a byte. It also works on a store whose first save died before
its commit (data but no commits: everything is an orphan), collects the file
store's temporaries of crashed writers, and refuses when commit records are
missing. This module parses the CLI's options and turns its report into the
documented JSON shape.
"""

from __future__ import annotations

import re
from typing import Any

from tensorstore_py.commands.target import resolve
from tensorstore_py.core.errors import InvalidArgumentError, ReadOnlyError
from tensorstore_py.kvstore.versioned.gc import DEFAULT_GRACE as GC_GRACE
from tensorstore_py.kvstore.versioned.gc import gc as collect
from tensorstore_py.progress import Progress

__all__ = ["gc", "parse_duration"]

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw]?)")


def parse_duration(text: str) -> float:
    """``"0s"``, ``"90"``, ``"15m"``, ``"1h30m"``, ``"7d"`` -> seconds."""
    s = text.strip().lower()
    pos, total = 0, 0.0
    for m in _DURATION.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if not s or pos != len(s):
        raise InvalidArgumentError(
            f"duration {text!r}: expected a number with an optional unit s, m, h, d or w "
            f"(e.g. 0s, 30m, 1h30m, 7d)"
        )
    return total


async def gc(url: str, *, grace: float | None = None, apply: bool = False,
             progress: Progress | None = None) -> dict[str, Any]:
    """Collect garbage at ``url``: list (``apply=False``) or delete what no retained
    version references and is older than ``grace`` seconds (default: the
    collector's, 6 hours). ``progress`` counts the objects deleted."""
    if grace is None:
        grace = GC_GRACE
    if grace < 0:
        raise InvalidArgumentError(f"--grace must not be negative, got {grace}")
    t = await resolve(url)
    if t.head is None:
        raise InvalidArgumentError(
            f"{url} is a {t.kind}: gc applies to checkpoint roots and versioned stores only"
        )
    if apply and t.base.read_only:
        raise ReadOnlyError(f"{url}: this store is read-only; gc --apply needs a writable store")
    rep = await collect(t.head, grace=grace, dry_run=not apply,
                        on_delete=None if progress is None else _counter(progress))
    return {
        "url": url, "kind": t.kind, "applied": apply, "grace_seconds": grace,
        "newest": rep.newest, "retained_versions": rep.retained_versions,
        "deleted_versions": rep.deleted_versions,
        "objects": list(rep.deleted), "count": len(rep.deleted), "bytes": rep.deleted_bytes,
        "by_kind": dict(rep.by_kind),
        "kept_referenced": rep.kept_reachable, "kept_referenced_bytes": rep.kept_reachable_bytes,
        "kept_young": len(rep.kept_young), "kept_young_bytes": rep.kept_young_bytes,
        "kept_leased": len(rep.kept_leased), "leases": rep.leases,
        "expired_leases": list(rep.expired_leases), "deferred_versions": list(rep.deferred_versions),
        "temporaries": list(rep.temporaries), "clock": rep.clock,
    }


def _counter(progress: Progress) -> Any:
    """The collector's ``on_delete(done, total)`` as a progress display's counts."""

    def deleted(done: int, total: int) -> None:
        if progress.total != total:
            progress.set_total(total)
        progress.advance(done - progress.done)

    return deleted
