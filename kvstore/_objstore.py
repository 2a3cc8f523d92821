"""What the object stores (gcs, s3) share above the HTTP client: write-ids, the
outcome of a conditional request whose answer may be stale, parts.

**Write-ids.** Every upload carries a fresh write-id in the object's custom
metadata (``tsp-write-id``). When a conditional write is refused on a retry
(412, or 404 for a compare-and-swap of a key that is gone), or every attempt
failed in transit, an earlier attempt may have landed: :func:`settle_write`
reads the object back and decides.

* The object carries our write-id: the write landed; its generation is returned.
* No attempt can have taken effect (each was refused outright: 408/429/503,
  or the first attempt got the refusal): the refusal stands,
  ConditionFailedError.
* A create-only write refused while another writer's object is there:
  ConditionFailedError. Exact unless another writer replaced our object
  between our lost answer and the retry (possible only for a writer that
  read our value or overwrote without a condition).
* Otherwise (a compare-and-swap, or the key is absent now, or the object
  could not be read back) the outcome is unknown:
  :class:`~tensorstore_py.errors.CommitOutcomeUnknownError` with the
  write-id and key, never ConditionFailedError (a caller that retried on it
  could apply an update twice).

**Unconditional writes** are retried as they are (a second landing of the same
value is harmless), but when the attempts run out after one may have landed,
or a retried multipart completion answers that the upload is gone (S3's
``NoSuchUpload``: completed by the attempt whose answer was lost, or
aborted), :func:`settle_overwrite` looks: our write-id on the object means it
landed (its generation is returned); otherwise the outcome is unknown
(:class:`~tensorstore_py.errors.CommitOutcomeUnknownError`), never a plain
StorageError that says "not written" about a value that may be there.

**Conditional deletes** carry no write-id (there is no object left to hold it),
so :func:`settle_delete` can only tell a refusal that no attempt preceded
(ConditionFailedError) from one after a possibly-landed attempt (outcome
unknown: our delete may have happened before the change that refused the
retry).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from tensorstore_py.core.errors import (
    CommitOutcomeUnknownError,
    ConditionFailedError,
    InvalidSpecError,
    StorageError,
)
from tensorstore_py.kvstore._http import Response, RetriesExhaustedError
from tensorstore_py.kvstore.base import Generation, KvStore, validate_key

__all__ = [
    "WRITE_ID",
    "ObjectKvStore",
    "ObjectState",
    "delete_all",
    "new_write_id",
    "part_ranges",
    "settle_delete",
    "settle_overwrite",
    "settle_write",
]

#: the custom-metadata key of the write-id an upload stores
WRITE_ID = "tsp-write-id"


def new_write_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class ObjectState:
    """What a metadata read of an object tells: its generation and the write-id of
    the upload that made it (None for objects written by other tools)."""

    generation: Generation
    write_id: str | None = None


class ObjectKvStore(KvStore):
    """What the object stores (gcs, s3) share as stores: a validated key prefix,
    pickling as the spec, ``with_path`` views that share one client, and the
    messages of lost conditions. Subclasses say where a key is (``_where``) and
    how a generation reads (``_show``)."""

    def __init__(self, *, path: Any) -> None:
        if not isinstance(path, str):
            raise InvalidSpecError(f"{self.driver}: path must be a string, got {path!r}")
        prefix = path.strip("/")
        if prefix:
            try:
                validate_key(prefix)
            except ValueError as e:
                raise InvalidSpecError(f"{self.driver}: invalid path {path!r}: {e}") from None
        super().__init__(path=prefix + "/" if prefix else "")

    def _where(self, key: str) -> str:
        raise NotImplementedError

    async def _object_state(self, key: str) -> ObjectState | None:
        """The state of full ``key`` (a metadata read), None if absent."""
        raise NotImplementedError

    async def _found(self, key: str) -> ObjectState | None:
        """The state of ``key`` for messages (None if absent or unknown)."""
        try:
            return await self._object_state(key)
        except (StorageError, OSError, ValueError, KeyError):
            return None

    async def _settle_write(self, key: str, write_id: str, if_equal: Generation, what: str, *,
                            refused: bool, maybe_applied: bool) -> Generation:
        """:func:`settle_write` for this store."""
        return await settle_write(
            what=f"{self.driver} {what}", key=key, write_id=write_id, if_equal=if_equal,
            refused=refused, maybe_applied=maybe_applied,
            current=lambda: self._object_state(key),
            lost=lambda st: self._condition_failed("write", key, if_equal, st))

    async def _settle_overwrite(self, key: str, write_id: str, what: str, why: str) -> Generation:
        """:func:`settle_overwrite` for this store."""
        return await settle_overwrite(what=f"{self.driver} {what}", key=key, write_id=write_id,
                                      why=why, current=lambda: self._object_state(key))

    async def _send_delete(self, key: str, if_equal: Generation | None, what: str,
                           send: Callable[[], Awaitable[Response]]) -> Response:
        """``send()`` the DELETE; a conditional one whose attempts all failed after one
        may have landed is settled (outcome unknown) instead of raised as is."""
        try:
            return await send()
        except RetriesExhaustedError as e:
            if if_equal is None or not e.maybe_applied:
                raise
            found = await self._found(key)
            settle_delete(what=f"{self.driver} {what}", key=key, expected=if_equal,
                          maybe_applied=True, state=found,
                          lost=lambda st: self._condition_failed("delete", key, if_equal, st))
            raise  # not reached: settling always raises

    async def _refused_delete(self, key: str, if_equal: Generation, what: str,
                              resp: Response) -> NoReturn:
        """A conditional delete answered 404 (gone) or 412 (changed): settled."""
        found = None if resp.status == 404 else await self._found(key)
        settle_delete(what=f"{self.driver} {what}", key=key, expected=if_equal,
                      maybe_applied=resp.maybe_applied, state=found,
                      lost=lambda st: self._condition_failed("delete", key, if_equal, st))

    def _show(self, g: Generation) -> str:
        """A generation as the service shows it, for messages."""
        return repr(g.token.decode("latin-1"))

    def _condition_failed(self, op: str, key: str, expected: Generation,
                          found: ObjectState | None) -> ConditionFailedError:
        if expected.is_no_value:
            want = "the key to be absent" if op == "delete" else "create-only: the key to be absent"
        else:
            want = f"generation {self._show(expected)}"
        got = "the key is absent" if found is None else f"generation {self._show(found.generation)}"
        return ConditionFailedError(
            f"{self.driver} conditional {op} of {self._where(key)}: expected {want}, found {got}")


FailFn = Callable[[ObjectState | None], ConditionFailedError]
StateFn = Callable[[], Awaitable[ObjectState | None]]


async def settle_write(
    *,
    what: str,
    key: str,
    write_id: str,
    if_equal: Generation,
    refused: bool,
    maybe_applied: bool,
    current: StateFn,
    lost: FailFn,
) -> Generation:
    """The result of a conditional write that was ``refused`` (a precondition answer)
    or whose attempts all failed in transit (``refused=False``); see the module doc.
    ``current()`` reads the object's state, ``lost(state)`` builds the
    ConditionFailedError naming what was found."""
    try:
        state = await current()
    except (TimeoutError, StorageError, OSError) as e:
        if refused and not maybe_applied:
            raise lost(None) from None
        raise _unknown(what, key, write_id, "the object could not be read back") from e
    if state is not None and state.write_id == write_id:
        return state.generation  # an earlier attempt landed; its answer was lost
    if refused and not maybe_applied:
        raise lost(state)
    if refused and if_equal.is_no_value and state is not None:
        raise lost(state)
    found = "the key is absent" if state is None else "another writer's value is there"
    raise _unknown(what, key, write_id, f"an earlier attempt may have landed and {found}")


async def settle_overwrite(
    *, what: str, key: str, write_id: str, why: str, current: StateFn,
) -> Generation:
    """The result of an unconditional write whose last answer does not tell
    whether it landed (``why`` says what happened): the object's generation if
    it carries our write-id, else CommitOutcomeUnknownError (see the module doc)."""
    try:
        state = await current()
    except (TimeoutError, StorageError, OSError) as e:
        raise _unknown(what, key, write_id, f"{why}, and the object could not be read back") from e
    if state is not None and state.write_id == write_id:
        return state.generation  # it landed; the answer saying so was lost
    found = "the key is absent" if state is None else "another writer's value is there"
    raise _unknown(what, key, write_id, f"{why}, and {found}")


def settle_delete(
    *,
    what: str,
    key: str,
    expected: Generation,
    maybe_applied: bool,
    state: ObjectState | None,
    lost: FailFn,
) -> NoReturn:
    """A conditional delete of generation ``expected`` refused with the object now
    in ``state`` (None: absent). Without an earlier possibly-landed attempt the
    refusal stands; after one, our delete may have happened first, so the
    outcome is unknown."""
    if not maybe_applied:
        raise lost(state)
    found = "the key is absent" if state is None else "another value is there now"
    raise _unknown(what, key, None,
                   f"an earlier attempt to delete generation {expected!r} may have landed and {found}")


def _unknown(what: str, key: str, write_id: str | None, why: str) -> CommitOutcomeUnknownError:
    wid = f" (write-id {write_id})" if write_id else ""
    return CommitOutcomeUnknownError(
        f"{what}: outcome unknown{wid}: {why}; read the key to see what it holds",
        write_id=write_id, key=key,
    )


def part_ranges(total: int, part_size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each part of a ``total``-byte value (at least one part)."""
    return [(a, min(a + part_size, total)) for a in range(0, max(total, 1), part_size)]


async def delete_all(names: Sequence[str], delete: Callable[[str], Awaitable[None]]) -> None:
    """``delete(name)`` for every name, concurrently, a thousand at a time (the
    store's client bounds the requests in flight)."""
    for i in range(0, len(names), 1000):
        await asyncio.gather(*(delete(k) for k in names[i:i + 1000]))
