"""The kvstore registry: self-registering store modules, imported only on demand."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tensorstore_py as tsp
from tensorstore_py.errors import InvalidSpecError
from tensorstore_py.kvstore import registry
from tensorstore_py.kvstore.fault import FaultKvStore
from tensorstore_py.kvstore.memory import MemoryKvStore
from tensorstore_py.kvstore.registry import register_kvstore, spec_from_url


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_and_opening_local_stores_imports_no_network_stack(tmp_path: Path) -> None:
    out = _run(
        f"""
        import sys
        import tensorstore_py as tsp
        heavy = ("aiohttp", "fsspec")
        assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]
        kv = tsp.KvStore.open("file://{tmp_path}/").result()
        kv.write("k", b"v").result()
        assert tsp.KvStore.open("memory://").result().driver == "memory"
        assert tsp.KvStore.open(kv.spec()).result() == kv
        assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]
        assert "tensorstore_py.kvstore.http" not in sys.modules
        print("ok")
        """
    )
    assert out == "ok"


def test_a_url_no_native_store_claims_goes_to_the_fsspec_fallback() -> None:
    out = _run(
        """
        import sys
        from tensorstore_py.kvstore.registry import spec_from_url
        assert spec_from_url("az://bucket/x/")["driver"] == "fsspec"
        assert spec_from_url("s3://bucket/x/")["driver"] == "s3"     # a native store now
        assert spec_from_url("gs://bucket/x/")["driver"] == "gcs"   # native wins over fsspec
        print("fsspec" in sys.modules)
        """
    )
    assert out == "True"


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """Undo registrations made by a test."""
    registry.known_drivers()  # every builtin module registered first: they register only once
    saved = (dict(registry._DRIVERS), dict(registry._SCHEMES), set(registry._ADAPTERS),
             dict(registry._FALLBACKS))
    yield
    for table, old in zip((registry._DRIVERS, registry._SCHEMES, registry._ADAPTERS,
                           registry._FALLBACKS), saved):
        table.clear()
        table.update(old)  # type: ignore[attr-defined]


class ToyKvStore(MemoryKvStore):
    """A store of a new driver: one class, one register_kvstore call."""

    driver = "toy"

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> ToyKvStore:
        return cls(path=spec.get("path", ""), name=spec.get("name"))

    @classmethod
    def spec_from_url(cls, url: str) -> dict[str, Any]:
        return {"driver": "toy", "path": url[len("toy://"):]}

    def url(self) -> str:
        return f"toy://{self.path}"


@pytest.mark.usefixtures("clean_registry")
def test_a_new_store_registers_its_driver_and_schemes() -> None:
    with pytest.raises(InvalidSpecError, match="unsupported kvstore URL scheme 'toy'"):
        spec_from_url("toy://a/")
    register_kvstore(ToyKvStore, schemes=("toy",))
    kv = tsp.KvStore.open("toy://a/").result()
    assert isinstance(kv, ToyKvStore) and kv.path == "a/"
    kv.write("k", b"v").result()
    again = tsp.KvStore.open(kv.spec()).result()
    assert again == kv and bytes(again.read("k").result().value) == b"v"
    assert "toy" in registry.known_drivers()


@pytest.mark.usefixtures("clean_registry")
def test_fallbacks_are_asked_only_for_unclaimed_schemes() -> None:
    asked: list[str] = []

    def accepts(scheme: str) -> bool:
        asked.append(scheme)
        return scheme == "toy"

    register_kvstore(ToyKvStore, fallback=accepts)
    assert spec_from_url("toy://x/") == {"driver": "toy", "path": "x/"}
    assert spec_from_url("memory://y/")["driver"] == "memory"
    assert asked == ["toy"]


def test_adapter_urls() -> None:
    kv = tsp.KvStore.open("fault+memory://p/").result()
    assert isinstance(kv, FaultKvStore) and kv.base.driver == "memory"
    assert spec_from_url("versioned+memory://")["driver"] == "versioned"
    with pytest.raises(InvalidSpecError, match="'memory' is not an adapter"):
        spec_from_url("memory+file:///tmp/x/")
    with pytest.raises(InvalidSpecError, match="unknown kvstore driver 'nosuch'"):
        spec_from_url("nosuch+memory://")


def test_an_opened_store_passes_through_and_other_objects_are_refused() -> None:
    kv = MemoryKvStore()
    assert tsp.KvStore.open(kv).result() is kv
    for bad in (42, ["driver", "memory"], object()):
        with pytest.raises(InvalidSpecError, match="must be a URL or a dict"):
            tsp.KvStore.open(bad).result()  # type: ignore[arg-type]
