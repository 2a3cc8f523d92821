"""Hand-made compressed data for the decompression-bomb tests."""

from __future__ import annotations


def zstd_rle_frame(total: int, byte: int = 7, block: int = 1 << 17) -> bytes:
    """A zstd frame WITHOUT a declared content size (as streaming writers make
    them): RLE blocks of ``byte``, 128 KiB window. Four bytes per 128 KiB of
    output, so an 8 GiB bomb is 256 KiB."""
    out = bytearray(b"\x28\xb5\x2f\xfd\x00\x38")
    sizes = [block] * (total // block) + ([total % block] if total % block else [])
    for i, n in enumerate(sizes):
        out += ((n << 3) | (1 << 1) | (i == len(sizes) - 1)).to_bytes(3, "little") + bytes([byte])
    return bytes(out)


def zstd_declaring(total: int, byte: int = 7) -> bytes:
    """:func:`zstd_rle_frame` whose header declares ``total`` bytes (8-byte size field)."""
    frame = zstd_rle_frame(total, byte)
    return frame[:4] + b"\xc0" + frame[5:6] + total.to_bytes(8, "little") + frame[6:]
