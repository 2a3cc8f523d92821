"""Credentials and request signing for the s3 store, by botocore.

botocore (the AWS SDK's core, optional: the ``s3`` extra) provides both halves:
the standard credential chain (environment, shared credentials and config
files with profiles, SSO, web identity, container and EC2 instance metadata,
refreshed before they expire) and Signature Version 4 with S3's rules
(``S3SigV4Auth``: no path normalisation, ``x-amz-content-sha256``), which
:mod:`~tensorstore_py.kvstore._sigv4` computes the same way without building a
botocore request per signature. It is imported lazily, only by stores that
sign requests; lookups and refreshes run on the I/O pool (see
:mod:`~tensorstore_py.kvstore._auth`).

Stores of one profile and AWS configuration (the ``AWS_*`` environment
variables and the shared config and credentials files, by path, size and
modification time) share one botocore session (building one costs about 10 ms
of CPU) and one set of credentials: the chain is walked once for all of them,
and credentials that expire (container or instance metadata, assumed roles,
SSO) are fetched and refreshed once, not once per store. A store opened after
a variable or file changed walks the chain again, with a session of its own.

Payloads: over https the body is sent as ``UNSIGNED-PAYLOAD`` (every body
carries an ``x-amz-checksum-*`` header that S3 verifies, and TLS protects
both), as botocore does; over plain http (local servers) the body's SHA-256
is signed, computed on the CPU pool for large bodies.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Hashable, Mapping
from typing import Any

import yarl

from tensorstore_py.core.pools import run_cpu
from tensorstore_py.core.ranges import Buffer
from tensorstore_py.kvstore._auth import CachedCredentials, CredentialsMode, configuration
from tensorstore_py.kvstore._sigv4 import RESERVED_HEADERS, sigv4_headers

__all__ = ["S3Auth", "default_region", "require_botocore"]

_INSTALL_HINT = 'pip install "tensorstore_py[s3]"'
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_UNSIGNED = "UNSIGNED-PAYLOAD"
_BIG = 1 << 20
_signer_class: Any = None
#: botocore sessions by profile and configuration (see the module doc), each with its lock
_sessions: dict[tuple[Any, ...], tuple[Any, threading.Lock]] = {}
_sessions_lock = threading.Lock()
_MAX_SESSIONS = 8


class S3Auth(CachedCredentials):
    """SigV4 signatures with credentials from the AWS chain (or a named profile)."""

    driver = "s3"

    def __init__(self, mode: CredentialsMode, *, anonymous: bool, region: str,
                 profile: str | None = None) -> None:
        super().__init__(mode, anonymous=anonymous)
        self.region = region
        self.profile = profile

    def _configuration(self) -> tuple[Hashable, ...]:
        return _configuration(self.profile)

    def _lookup(self) -> tuple[Any, str]:
        # botocore is the optional s3 extra: imported only once credentials are used
        import botocore.exceptions  # (lazy, as above)

        where = f"profile {self.profile!r}" if self.profile else "the AWS credential chain"
        session, lock = _session(self.profile)
        try:
            with lock:
                creds = session.get_component("credential_provider").load_credentials()
        except botocore.exceptions.ProfileNotFound as e:
            return None, f"{where}: {e}"
        except botocore.exceptions.BotoCoreError as e:
            return None, f"{where}: {type(e).__name__}: {e}"
        if creds is None:
            return None, (f"{where} (environment, shared credentials/config files, container "
                          "and instance metadata) has none")
        return creds, ""

    def _usable(self, creds: Any) -> bool:
        needed = getattr(creds, "refresh_needed", None)
        return not (needed is not None and needed())

    def _refresh(self, creds: Any) -> None:
        creds.get_frozen_credentials()  # refreshes (blocking) when near expiry

    def _forget(self, creds: Any, sent: Mapping[str, str] | None) -> None:
        pass  # botocore refreshes by expiry; S3 answers 403 (not 401) to a stale token

    def _describe(self, creds: Any) -> str:
        key = getattr(creds, "access_key", "") or ""
        return (f"AWS credentials from {getattr(creds, 'method', 'unknown')} "
                f"(access key ...{key[-4:]}, region {self.region})")

    async def _sign(
        self, creds: Any, method: str, url: str | yarl.URL, headers: Mapping[str, str],
        data: Buffer | None,
    ) -> dict[str, str]:
        url_s = str(url)
        if not data:
            payload = _EMPTY_SHA256
        elif url_s.startswith("https://"):
            payload = _UNSIGNED
        elif len(data) > _BIG:
            payload = await run_cpu(lambda: hashlib.sha256(data).hexdigest())
        else:
            payload = hashlib.sha256(data).hexdigest()
        return _signed_headers(creds.get_frozen_credentials(), self.region, method, url_s,
                               headers, payload)


def _signed_headers(frozen: Any, region: str, method: str, url: str,
                    headers: Mapping[str, str], payload: str) -> dict[str, str]:
    """The headers SigV4 adds (Authorization, X-Amz-Date, X-Amz-Content-SHA256, a
    session token) for a request whose body hashes to ``payload``: computed by
    :mod:`~tensorstore_py.kvstore._sigv4` (botocore's rules, a tenth of its
    cost), by botocore itself for a request that carries a header the signer sets."""
    if not any(k.lower() in RESERVED_HEADERS for k in headers):
        return sigv4_headers(frozen.access_key, frozen.secret_key, frozen.token, region, method, url,
                             headers, payload)
    return _botocore_signed_headers(frozen, region, method, url, headers, payload)


def _botocore_signed_headers(frozen: Any, region: str, method: str, url: str,
                             headers: Mapping[str, str], payload: str) -> dict[str, str]:
    """:func:`_signed_headers` by botocore's ``S3SigV4Auth``."""
    global _signer_class
    # botocore is the optional s3 extra (see S3Auth._lookup)
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest  # (lazy, as above)

    if _signer_class is None:
        class Signer(S3SigV4Auth):  # type: ignore[misc]
            """S3SigV4Auth with the payload hash given (bodies are buffers it can not read)."""

            def payload(self, request: Any) -> str:
                return str(request.context["payload_hash"])

        _signer_class = Signer
    req = AWSRequest(method=method, url=url, headers=dict(headers), data=b"")
    req.context["payload_hash"] = payload
    _signer_class(frozen, "s3", region).add_auth(req)
    return {k: v for k, v in req.headers.items() if k not in headers or headers[k] != v}


def default_region(profile: str | None) -> str:
    """The region of the AWS configuration: ``AWS_REGION``, ``AWS_DEFAULT_REGION``,
    the profile's ``region`` in the shared config file, else ``us-east-1``."""
    for var in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        if os.environ.get(var):
            return os.environ[var]
    try:
        # botocore is the optional s3 extra: without it only the environment is read
        import botocore.session  # noqa: F401  (_session uses it)
    except ImportError:
        return "us-east-1"
    session, lock = _session(profile)
    try:
        with lock:
            region = session.get_config_variable("region")
    except Exception:  # a missing profile is reported when credentials are looked up
        region = None
    return region or "us-east-1"


def _configuration(profile: str | None) -> tuple[Hashable, ...]:
    """``profile`` and the AWS configuration of now (see the module doc)."""
    files = [os.path.expanduser(os.environ.get(var) or default)
             for var, default in (("AWS_CONFIG_FILE", "~/.aws/config"),
                                  ("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"))]
    return (profile, *configuration(("AWS_",), files))


def _session(profile: str | None) -> tuple[Any, threading.Lock]:
    """The botocore session of ``profile`` under the current AWS configuration
    (made on first use; a changed variable or file makes a new one)."""
    # botocore is the optional s3 extra (see S3Auth._lookup)
    import botocore.session  # (lazy, as above)

    key = _configuration(profile)
    with _sessions_lock:
        got = _sessions.get(key)
        if got is None:
            if len(_sessions) >= _MAX_SESSIONS:
                _sessions.clear()
            got = _sessions[key] = (botocore.session.Session(profile=profile), threading.Lock())
        return got


def _after_fork_in_child() -> None:
    global _sessions_lock
    _sessions_lock = threading.Lock()  # another thread of the parent may have held it
    _sessions.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def require_botocore() -> None:
    try:
        # botocore is optional (the s3 extra): checked here, imported when used
        import botocore.auth  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"the s3 kvstore needs botocore to sign requests ({e.name} is missing); "
            f"install it with: {_INSTALL_HINT}, or use credentials 'anonymous'"
        ) from e
