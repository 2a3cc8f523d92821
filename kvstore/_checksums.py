"""Checksums that object stores verify on upload and report on download.

* ``crc32c``: the crc32c package (a dependency; hardware-accelerated). GCS and
  S3 send it as 4 big-endian bytes in base64.
* ``crc64nvme``: S3's default since 2025, 8 bytes in base64; computed by the
  AWS Common Runtime (awscrt, through botocore's checksum classes; both in the
  ``s3`` extra), imported only when used.

Large bodies are checksummed on the CPU pool, off the event loop; a download's
CRC-32C is usually computed while it arrives (``_http.Response.body_crc32c``)
and only encoded here (:func:`crc32c_value_b64`).
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import crc32c as _crc32c

from tensorstore_py.core.errors import InvalidSpecError
from tensorstore_py.core.pools import run_cpu
from tensorstore_py.core.ranges import Buffer

__all__ = ["ALGORITHMS", "Algorithm", "check_algorithm", "checksum_b64", "crc32c_b64", "crc32c_value_b64"]

Algorithm = Literal["crc32c", "crc64nvme"]
ALGORITHMS: tuple[Algorithm, ...] = ("crc32c", "crc64nvme")
_BIG = 1 << 20
_INSTALL_HINT = 'pip install "tensorstore_py[s3]"'


def _crc64nvme_class() -> Any:
    """botocore's CRT-backed CRC64NVME, or None without awscrt."""
    try:
        # botocore and awscrt are the optional s3 extra: imported only for crc64nvme
        from botocore.compat import HAS_CRT
        from botocore.httpchecksum import CrtCrc64NvmeChecksum  # (lazy, as above)
    except ImportError:
        return None
    return CrtCrc64NvmeChecksum if HAS_CRT else None


def check_algorithm(driver: str, value: Any) -> Algorithm:
    """``value`` as a checksum algorithm this process can compute, else InvalidSpecError."""
    if value not in ALGORITHMS:
        raise InvalidSpecError(f"{driver}: checksum must be one of {list(ALGORITHMS)}, got {value!r}")
    if value == "crc64nvme" and _crc64nvme_class() is None:
        raise InvalidSpecError(
            f"{driver}: checksum 'crc64nvme' needs the AWS Common Runtime (awscrt); "
            f"install it with: {_INSTALL_HINT}")
    return value  # type: ignore[no-any-return]


def _compute(alg: Algorithm, data: Buffer) -> bytes | None:
    if alg == "crc32c":
        return _crc32c.crc32c(data).to_bytes(4, "big")
    cls = _crc64nvme_class()
    if cls is None:
        return None
    c = cls()
    c.update(bytes(data) if not isinstance(data, (bytes, bytearray)) else data)
    return bytes(c.digest())


async def checksum_b64(alg: Algorithm, data: Buffer, *, required: bool = True) -> str | None:
    """The base64 checksum of ``data``; None when the algorithm is not available here
    and not ``required`` (a download checked with what can be computed)."""
    if len(data) > _BIG:
        raw = await run_cpu(_compute, alg, data)
    else:
        raw = _compute(alg, data)
    if raw is None:
        if required:
            raise InvalidSpecError(f"checksum {alg!r} needs awscrt: {_INSTALL_HINT}")
        return None
    return base64.b64encode(raw).decode()


async def crc32c_b64(data: Buffer) -> str:
    """The base64 CRC32C of ``data``."""
    return str(await checksum_b64("crc32c", data))


def crc32c_value_b64(value: int) -> str:
    """A CRC-32C value as object stores send it (4 big-endian bytes in base64)."""
    return base64.b64encode(value.to_bytes(4, "big")).decode()
