"""What a garbage collection reports (:class:`GcReport`), and how a prompt
reclaim's report and a full collection's combine."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GcReport", "kinds", "merge"]


@dataclass(frozen=True)
class GcReport:
    """What a garbage collection deleted (or, for a dry run, would delete) and kept.

    ``deleted`` lists object names (sorted), ``reclaimed`` the subset that was
    reachable only from deleted versions (prompt reclaim). Byte counts cover
    objects whose size is known (``unknown_size`` counts the rest).
    ``kept_leased``: unreferenced old objects kept because a live writer's
    lease claims them; ``deferred_versions``: deleted versions not reclaimed
    yet (a reader lease or ``read_grace`` keeps them); ``leases``: live
    leases; ``expired_leases``: lease objects of gone owners (deleted unless
    dry run); ``temporaries``: crashed writers' temporaries the base store
    swept (or would); ``clock``: ``"store"`` when ages came from the store's
    clock, ``"host"`` when it could not tell (a read-only store).
    """

    dry_run: bool
    grace: float
    newest: int
    retained_versions: int
    deleted_versions: int
    deleted: tuple[str, ...]
    deleted_bytes: int
    reclaimed: tuple[str, ...]
    kept_reachable: int
    kept_reachable_bytes: int
    kept_young: tuple[str, ...]
    kept_young_bytes: int
    unknown_size: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    kept_leased: tuple[str, ...] = ()
    deferred_versions: tuple[int, ...] = ()
    leases: int = 0
    expired_leases: tuple[str, ...] = ()
    temporaries: tuple[str, ...] = ()
    clock: str = "store"

    @property
    def deleted_count(self) -> int:
        return len(self.deleted)

    def summary(self) -> str:
        verb = "would delete" if self.dry_run else "deleted"
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.by_kind.items())) or "nothing"
        extra = ""
        if self.kept_leased:
            extra += f", {len(self.kept_leased)} claimed by {self.leases} live lease(s)"
        if self.deferred_versions:
            extra += f"; {len(self.deferred_versions)} deleted version(s) still read"
        if self.temporaries:
            extra += f"; {len(self.temporaries)} crashed writers' temporaries"
        return (
            f"gc of {self.newest} versions ({self.retained_versions} retained, "
            f"{self.deleted_versions} deleted): {verb} {self.deleted_count} objects "
            f"({kinds}; {self.deleted_bytes} bytes, {len(self.reclaimed)} of deleted versions); "
            f"kept {self.kept_reachable} referenced ({self.kept_reachable_bytes} bytes) and "
            f"{len(self.kept_young)} younger than {self.grace:g} s ({self.kept_young_bytes} bytes)"
            + extra
        )


def kinds(names: set[str] | list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in names:
        kind = n.split("/", 1)[0]
        out[kind] = out.get(kind, 0) + 1
    return out


def merge(a: GcReport, b: GcReport) -> GcReport:
    """A reclaim's report followed by a full collection's."""
    deleted = set(a.deleted) | set(b.deleted)
    return GcReport(
        dry_run=False, grace=a.grace, newest=b.newest, retained_versions=b.retained_versions,
        deleted_versions=b.deleted_versions, deleted=tuple(sorted(deleted)),
        deleted_bytes=a.deleted_bytes + b.deleted_bytes, reclaimed=a.reclaimed,
        kept_reachable=b.kept_reachable, kept_reachable_bytes=b.kept_reachable_bytes,
        kept_young=b.kept_young, kept_young_bytes=b.kept_young_bytes,
        unknown_size=a.unknown_size + b.unknown_size, by_kind=kinds(deleted),
        kept_leased=b.kept_leased, deferred_versions=a.deferred_versions, leases=b.leases,
        expired_leases=tuple(sorted(set(a.expired_leases) | set(b.expired_leases))),
        temporaries=b.temporaries, clock=a.clock,
    )
