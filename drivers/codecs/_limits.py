"""Size checks shared by the compressors (refuse bombs, catch truncation)."""

from __future__ import annotations

from tensorstore_py.core.errors import DataCorruptionError


def check_size(codec: str, key: str, found: int, size: int | None, limit: int) -> None:
    """Raise DataCorruptionError unless ``found`` matches ``size`` and is within ``limit``."""
    if size is not None and found != size:
        raise DataCorruptionError(
            f"chunk {key!r}: {codec} data decodes to {found} bytes, expected {size}"
        )
    if found > limit:
        raise DataCorruptionError(
            f"chunk {key!r}: {codec} data declares {found} decoded bytes, more than the "
            f"{limit} a chunk may hold"
        )
