"""Loopback credential sources, for tests and benchmarks of credential lookups.

* :class:`OAuthFront`: an OAuth 2.0 token endpoint (``POST /token``, the
  exchange google-auth makes for service-account credentials) and, on every other path, a front for a GCS server (e.g. the
  GCS emulator) that relays only requests carrying a bearer token it issued
  and has not revoked, and answers 401 to the others, as GCS does to an
  expired token. :meth:`OAuthFront.credentials_file` writes a service-account
  credentials file whose ``token_uri`` is this endpoint (point
  ``GOOGLE_APPLICATION_CREDENTIALS`` at it)::

      with OAuthFront(emulator.endpoint) as front:
          path = front.credentials_file(tmp_path / "adc.json")
          ... GOOGLE_APPLICATION_CREDENTIALS=path, spec endpoint = front.url,
              credentials "default" ...
          assert front.counters()["token_requests"] == 1

* :class:`ContainerCredentials`: the AWS container credentials endpoint
  (what ``AWS_CONTAINER_CREDENTIALS_FULL_URI`` names; botocore accepts a
  loopback address), answering temporary keys that expire after
  ``expires_in`` seconds.

Both count what they were asked, run their own event loop on a background
thread (so they keep serving while test code blocks on Futures) and may hold
each credentials answer for ``delay`` seconds, so that concurrent first
requests of a client meet while its lookup is in flight.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import threading
from collections import Counter
from pathlib import Path
from typing import Self

import aiohttp
from aiohttp import web

__all__ = ["ContainerCredentials", "OAuthFront", "service_account_file"]

# headers a relay does not pass on (hop by hop, or recomputed for the new body)
_NOT_RELAYED = {"host", "authorization", "connection", "keep-alive", "transfer-encoding",
                "content-length"}


class _LoopbackServer:
    """An aiohttp application on 127.0.0.1 (a free port), served by its own thread."""

    def __init__(self) -> None:
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def counters(self) -> dict[str, int]:
        """What was asked so far, by kind (see the class)."""
        with self._lock:
            return dict(self._counters)

    def _count(self, kind: str) -> int:
        with self._lock:
            self._counters[kind] += 1
            return self._counters[kind]

    def _routes(self, app: web.Application) -> None:
        raise NotImplementedError

    async def _started(self) -> None:
        """Runs on the server's loop once it serves."""

    async def _stopping(self) -> None:
        """Runs on the server's loop before it stops."""

    def start(self) -> Self:
        app = web.Application(client_max_size=1 << 30)
        self._routes(app)
        loop = self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            runner = self._runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            loop.run_until_complete(self._started())
            self.port = runner.addresses[0][1]
            ready.set()
            loop.run_forever()

        self._thread = threading.Thread(target=run, name=type(self).__name__, daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError(f"{type(self).__name__} did not start")
        return self

    def stop(self) -> None:
        loop, runner, thread = self._loop, self._runner, self._thread
        if loop is None or runner is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._stopping(), loop).result(30)
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
        self._loop = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class OAuthFront(_LoopbackServer):
    """A token endpoint and a bearer-checking relay to ``upstream`` (see the module doc).

    Tokens are ``tok-1``, ``tok-2``, ... in the order asked; each answer says
    ``expires_in`` (seconds, read at each request: a test may change it).
    Counters: ``token_requests``, ``relayed`` (requests passed on with a valid
    token), ``refused`` (401 answers: no token, an unknown or a revoked one).
    :attr:`refusal_delays`: how long to hold each 401 answer, in the order the
    refused requests arrive (none once used up), so that a request refused late
    comes back after others were refused and a new token was fetched.
    :attr:`grants` lists what each token request exchanged (its ``grant_type``,
    and the ``issuer`` of its signed assertion: the service account).
    """

    def __init__(self, upstream: str, *, expires_in: float = 3600.0, delay: float = 0.0) -> None:
        super().__init__()
        self.upstream = upstream.rstrip("/")
        self.expires_in = expires_in
        self.delay = delay
        self.grants: list[dict[str, str]] = []
        self.refusal_delays: list[float] = []
        self._valid: set[str] = set()
        self._client: aiohttp.ClientSession | None = None

    def revoke(self) -> None:
        """Refuse every token issued so far (401 from now on), as for tokens that expired
        earlier than the client expected."""
        with self._lock:
            self._valid.clear()

    def credentials_file(self, path: str | Path, *, name: str = "sa-1") -> Path:
        """:func:`service_account_file` whose tokens come from this endpoint."""
        return service_account_file(path, f"{self.url}/token", name=name)

    def _routes(self, app: web.Application) -> None:
        app.router.add_post("/token", self._token)
        app.router.add_route("*", "/{tail:.*}", self._relay)

    async def _started(self) -> None:
        self._client = aiohttp.ClientSession(auto_decompress=False)

    async def _stopping(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def _token(self, request: web.Request) -> web.Response:
        form = await request.post()
        n = self._count("token_requests")
        grant = {"grant_type": str(form.get("grant_type", ""))}
        if "assertion" in form:  # a service account's signed JWT: who signed it
            payload = str(form["assertion"]).split(".")[1]
            grant["issuer"] = str(json.loads(_b64decode(payload)).get("iss", ""))
        token = f"tok-{n}"
        with self._lock:
            self.grants.append(grant)
        if self.delay:
            await asyncio.sleep(self.delay)
        with self._lock:
            self._valid.add(token)
        return web.json_response(
            {"access_token": token, "expires_in": self.expires_in, "token_type": "Bearer"})

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        auth = request.headers.get("Authorization", "")
        token = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
        with self._lock:
            valid = token in self._valid
        if not valid:
            self._count("refused")
            with self._lock:
                hold = self.refusal_delays.pop(0) if self.refusal_delays else 0.0
            if hold:
                await asyncio.sleep(hold)
            return web.json_response(
                {"error": {"code": 401, "message": f"invalid or expired token {token!r}"}},
                status=401)
        self._count("relayed")
        if self._client is None:
            raise RuntimeError("OAuthFront: the relay's client is not started")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_RELAYED}
        async with self._client.request(request.method, self.upstream + request.path_qs,
                                        headers=headers, data=await request.read()) as resp:
            body = await resp.read()
            out = {k: v for k, v in resp.headers.items() if k.lower() not in _NOT_RELAYED}
            return web.Response(status=resp.status, body=body, headers=out)


class ContainerCredentials(_LoopbackServer):
    """The AWS container credentials endpoint (any GET path): keys ``AKIDCONTAINER<n>``
    with a session token, expiring ``expires_in`` seconds after they were asked.
    Counter: ``requests``."""

    def __init__(self, *, expires_in: float = 3600.0, delay: float = 0.0) -> None:
        super().__init__()
        self.expires_in = expires_in
        self.delay = delay

    @property
    def full_uri(self) -> str:
        """The value for ``AWS_CONTAINER_CREDENTIALS_FULL_URI``."""
        return f"{self.url}/credentials"

    def _routes(self, app: web.Application) -> None:
        app.router.add_get("/{tail:.*}", self._credentials)

    async def _credentials(self, request: web.Request) -> web.Response:
        n = self._count("requests")
        if self.delay:
            await asyncio.sleep(self.delay)
        expires = datetime.datetime.now(datetime.UTC) + datetime.timedelta(
            seconds=self.expires_in)
        return web.json_response({
            "AccessKeyId": f"AKIDCONTAINER{n}", "SecretAccessKey": f"secret-{n}",
            "Token": f"session-{n}", "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
        })


def service_account_file(path: str | Path, token_uri: str, *, name: str = "sa-1") -> Path:
    """Write service-account credentials (the kind of application-default credentials
    whose ``token_uri`` google-auth honours) that ask ``token_uri`` for tokens;
    ``name`` is the account (``<name>@tsp-test.iam.gserviceaccount.com``, the
    ``issuer`` of its grants), so a rewritten file can be told apart."""
    info = {"type": "service_account", "project_id": "tsp-test", "private_key_id": "k1",
            "private_key": _private_key_pem(), "client_id": "1",
            "client_email": f"{name}@tsp-test.iam.gserviceaccount.com", "token_uri": token_uri}
    path = Path(path)
    path.write_text(json.dumps(info))
    return path


def _b64decode(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


_pem: str | None = None


def _private_key_pem() -> str:
    """An RSA key for service-account files (made once per process: ~50 ms)."""
    global _pem
    if _pem is None:
        # cryptography (a test dependency, which google-auth needs to sign) is only
        # needed for credentials files
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa  # (lazy, as above)

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        _pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption()).decode()
    return _pem
