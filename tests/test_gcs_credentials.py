"""gcs credentials are looked up and refreshed once per process and configuration,
not once per store: google-auth's application-default credentials from a file
whose token endpoint is a loopback OAuthFront, which also stands in front of the
GCS emulator and lets through only requests carrying a token it issued."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorstore_py as tsp
from tensorstore_py.kvstore.gcs import GcsKvStore
from tensorstore_py.testing.credential_servers import OAuthFront
from tensorstore_py.testing.gcs_server import GcsEmulator

T = 60
pytest.importorskip("google.auth")
pytest.importorskip("cryptography")
_JWT = "urn:ietf:params:oauth:grant-type:jwt-bearer"


def _issuers(front: OAuthFront) -> list[str]:
    return [g["issuer"].split("@")[0] for g in front.grants]


@pytest.fixture
def front(gcs_emulator: GcsEmulator, tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[OAuthFront]:
    """An OAuthFront before the emulator, and application-default credentials (a
    service account) that ask it for tokens; nothing else google-auth could find."""
    with OAuthFront(gcs_emulator.endpoint) as f:
        adc = f.credentials_file(tmp_path / "adc.json")
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(adc))
        monkeypatch.setenv("HOME", str(tmp_path))  # no gcloud files
        monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:1")  # no metadata server
        monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
        yield f


def _spec(front: OAuthFront, bucket: str, path: str = "") -> dict[str, Any]:
    # "default": "auto" sends no token over plain http
    return {"driver": "gcs", "bucket": bucket, "path": path, "endpoint": front.url,
            "credentials": "default", "emulator_workarounds": True}


def _filled_bucket(gcs_emulator: GcsEmulator, value: bytes = b"value") -> str:
    bucket = gcs_emulator.create_bucket()
    GcsKvStore.from_spec(gcs_emulator.spec(bucket)).write("k", value).result(T)
    return bucket


def test_arrays_opened_one_after_another_share_one_token(
        front: OAuthFront, gcs_emulator: GcsEmulator) -> None:
    """Each tsp.open builds a gcs store; all of them ask the token endpoint once."""
    spec = {"kvstore": _spec(front, gcs_emulator.create_bucket(), "a/")}
    data = np.arange(64 * 64, dtype=np.int16).reshape(64, 64)
    tsp.open(spec, create=True, dtype="int16", shape=(64, 64), chunks=(32, 32)).result(T) \
        .write(data).result(T)
    for _ in range(5):
        np.testing.assert_array_equal(tsp.open(spec).result(T).read().result(T), data)
    counters = front.counters()
    assert counters["token_requests"] == 1, counters
    assert counters.get("refused", 0) == 0 and counters["relayed"] >= 6 + 5 * 4, counters
    assert front.grants == [{"grant_type": _JWT, "issuer": "sa-1@tsp-test.iam.gserviceaccount.com"}]


def test_concurrent_first_requests_of_many_stores_wait_for_one_token(
        front: OAuthFront, gcs_emulator: GcsEmulator) -> None:
    """Eight new stores read at once from eight threads while the token is on its
    way (the endpoint holds it 0.3 s): one token request, every read gets it."""
    bucket = _filled_bucket(gcs_emulator)
    front.delay = 0.3
    stores = [GcsKvStore.from_spec(_spec(front, bucket)) for _ in range(8)]

    def two_reads(kv: GcsKvStore) -> list[bytes]:
        futures = [kv.read("k"), kv.read("k")]
        return [bytes(f.result(T).value) for f in futures]

    with ThreadPoolExecutor(len(stores)) as pool:
        values = list(pool.map(two_reads, stores))
    assert values == [[b"value", b"value"]] * len(stores)
    counters = front.counters()
    assert counters["token_requests"] == 1 and counters["relayed"] == 16, counters
    assert "sa-1@tsp-test" in stores[0]._client.describe_auth()


def test_an_expiring_token_is_refreshed_once_for_all_stores(
        front: OAuthFront, gcs_emulator: GcsEmulator) -> None:
    """A token google-auth holds for expired (within its refresh margin of the
    expiry) is replaced before it is sent: once, for every store."""
    from google.auth import _helpers

    margin = 3.0
    front.expires_in = _helpers.REFRESH_THRESHOLD.total_seconds() + margin
    bucket = _filled_bucket(gcs_emulator)
    stores = [GcsKvStore.from_spec(_spec(front, bucket)) for _ in range(4)]
    for kv in stores:
        assert bytes(kv.read("k").result(T).value) == b"value"
    first_done = time.monotonic()
    assert front.counters()["token_requests"] == 1
    front.expires_in = 3600
    time.sleep(margin + 0.3)  # the first token is now within the margin
    futures = [kv.read("k") for kv in stores for _ in range(3)]
    assert [bytes(f.result(T).value) for f in futures] == [b"value"] * 12
    counters = front.counters()
    assert counters["token_requests"] == 2, (counters, time.monotonic() - first_done)
    assert counters.get("refused", 0) == 0, counters  # replaced before it was refused


def test_a_refused_token_is_replaced_once_for_all_stores(
        front: OAuthFront, gcs_emulator: GcsEmulator) -> None:
    """A 401 (the token was revoked, or expired sooner than said) makes every store
    use one new token: requests that carried the refused one are retried with it."""
    bucket = _filled_bucket(gcs_emulator)
    stores = [GcsKvStore.from_spec(_spec(front, bucket)) for _ in range(4)]
    for kv in stores:
        assert bytes(kv.read("k").result(T).value) == b"value"
    assert front.counters()["token_requests"] == 1
    front.revoke()
    front.delay = 0.2
    futures = [kv.read("k") for kv in stores for _ in range(3)]
    assert [bytes(f.result(T).value) for f in futures] == [b"value"] * 12
    counters = front.counters()
    assert counters["token_requests"] == 2 and counters["refused"] >= 1, counters
    # later requests of every store carry the new token at once
    before = front.counters()["refused"]
    for kv in stores:
        assert bytes(kv.read("k").result(T).value) == b"value"
    assert front.counters()["refused"] == before and front.counters()["token_requests"] == 2


def test_a_late_refusal_of_a_replaced_token_keeps_the_new_one(
        front: OAuthFront, gcs_emulator: GcsEmulator) -> None:
    """Two requests carry a token that is then revoked; the first refusal brings a
    new token, the second arrives after it: that request is retried with the new
    token, which stays (no third token)."""
    bucket = _filled_bucket(gcs_emulator)
    stores = [GcsKvStore.from_spec(_spec(front, bucket)) for _ in range(2)]
    for kv in stores:
        kv.read("k").result(T)
    front.revoke()
    # both requests reach the front with the revoked token before the first refusal
    # is answered (else, on a loaded machine, the second may only leave once the new
    # token is in and never be refused); the second refusal comes back a second later
    front.refusal_delays = [0.5, 1.5]
    futures = [kv.read("k") for kv in stores]
    assert [bytes(f.result(T).value) for f in futures] == [b"value"] * 2
    for kv in stores:
        assert bytes(kv.read("k").result(T).value) == b"value"
    counters = front.counters()
    assert counters["refused"] == 2 and counters["token_requests"] == 2, counters


def test_a_changed_credentials_file_is_looked_up_again(
        front: OAuthFront, gcs_emulator: GcsEmulator, tmp_path: Path) -> None:
    """Stores opened after the credentials file was rewritten (same path) look it up
    again, once between them; stores opened before keep their token."""
    bucket = _filled_bucket(gcs_emulator)
    before = [GcsKvStore.from_spec(_spec(front, bucket)) for _ in range(2)]
    for kv in before:
        kv.read("k").result(T)
    adc = Path(os.environ["GOOGLE_APPLICATION_CREDENTIALS"])
    stat = adc.stat()
    front.credentials_file(adc, name="sa-2")
    os.utime(adc, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    after = [GcsKvStore.from_spec(_spec(front, bucket)) for _ in range(3)]
    for kv in after + before:
        assert bytes(kv.read("k").result(T).value) == b"value"
    assert _issuers(front) == ["sa-1", "sa-2"]
    # another file named by the variable is another configuration too
    other = front.credentials_file(tmp_path / "other.json", name="sa-3")
    os.environ["GOOGLE_APPLICATION_CREDENTIALS"] = str(other)  # restored by the fixture
    GcsKvStore.from_spec(_spec(front, bucket)).read("k").result(T)
    GcsKvStore.from_spec(_spec(front, bucket)).read("k").result(T)
    assert _issuers(front) == ["sa-1", "sa-2", "sa-3"]


def _read_in_child(spec: dict[str, Any]) -> str:
    return bytes(GcsKvStore.from_spec(spec).read("k").result(T).value).decode()


def test_forked_children_use_the_token_of_their_parent(
        front: OAuthFront, gcs_emulator: GcsEmulator) -> None:
    """A forked child (a multiprocessing worker) opens stores with the token its
    parent holds: the process's credentials, with locks of its own."""
    spec = _spec(front, _filled_bucket(gcs_emulator))
    GcsKvStore.from_spec(spec).read("k").result(T)
    with multiprocessing.get_context("fork").Pool(2) as pool:
        assert pool.map(_read_in_child, [spec] * 4) == ["value"] * 4
    counters = front.counters()
    assert counters["token_requests"] == 1 and counters.get("refused", 0) == 0, counters


_UNPICKLE = """
import pickle, sys
kv = pickle.loads(bytes.fromhex(sys.argv[1]))
print(bytes(kv.read("k").result(60).value).decode())
print(kv._client.describe_auth())
"""


def test_an_unpickled_store_looks_up_in_its_own_process(
        front: OAuthFront, gcs_emulator: GcsEmulator) -> None:
    """A pickle carries the spec, no credentials: the process that unpickles the
    store asks for its own token (the same store unpickled here shares ours)."""
    kv = GcsKvStore.from_spec(_spec(front, _filled_bucket(gcs_emulator)))
    kv.read("k").result(T)
    again = pickle.loads(pickle.dumps(kv))
    assert bytes(again.read("k").result(T).value) == b"value"
    assert front.counters()["token_requests"] == 1
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_UNPICKLE),
                          pickle.dumps(kv).hex()], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "value"
    assert "sa-1@tsp-test" in out.stdout.splitlines()[1]
    assert front.counters()["token_requests"] == 2
