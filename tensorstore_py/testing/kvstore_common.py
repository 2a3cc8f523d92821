"""What the writable and read-only kvstore conformance suites share."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any, ClassVar

import pytest

from tensorstore_py.core.errors import UnsupportedError
from tensorstore_py.core.future import Future
from tensorstore_py.kvstore.base import KvStore

__all__ = ["BAD_KEYS", "Conformance", "raises_from"]

#: keys every store must refuse with InvalidKeyError (before any I/O)
BAD_KEYS: tuple[str, ...] = ("", "/a", "a/../b", "..", "./a", "a//b", "a\x00b", "a/")


def raises_from(exc: type[BaseException], fn: Callable[[], Future[Any]], timeout: float) -> BaseException:
    """``fn()`` must raise ``exc``, either at call time or from its Future."""
    with pytest.raises(exc) as info:
        fn().result(timeout)
    return info.value


class Conformance:
    """What both suites share: the Future timeout and the pickling checks."""

    #: seconds to wait for any one Future
    timeout: ClassVar[float] = 60.0
    #: False for stores that can not be reopened in another process (see the module doc)
    picklable: ClassVar[bool] = True

    def _res(self, fut: Future[Any]) -> Any:
        return fut.result(self.timeout)

    def _check_pickle(self, store: KvStore, key: str, data: bytes) -> KvStore | None:
        """``store`` pickled and unpickled (it must still read ``key`` as ``data``),
        or None for a store that must refuse to pickle; copies are handles on the same data."""
        for dup in (copy.copy(store), copy.deepcopy(store)):
            assert dup == store and bytes(self._res(dup.read(key)).value) == data
        if not self.picklable:
            with pytest.raises(UnsupportedError, match="pickle"):
                pickle.dumps(store)
            return None
        again = pickle.loads(pickle.dumps(store.with_path("")))
        assert type(again) is type(store) and again.spec() == store.spec()
        assert bytes(self._res(again.read(key)).value) == data
        return again
