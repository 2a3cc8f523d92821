"""The neuroglancer precomputed ``info`` document of a (multiscale) volume.

``info`` (JSON, at the volume's root) holds the scale-independent fields
``type`` ("image" | "segmentation"), ``data_type``, ``num_channels`` and a list
of ``scales``, each with ``key`` (its folder, relative to the volume; may hold
"/" and ".."), ``size`` and ``voxel_offset`` (x, y, z voxels), ``resolution``
(nm), ``chunk_sizes``, ``encoding`` (raw, jpeg, png, compressed_segmentation,
compresso) with ``jpeg_quality`` / ``png_level`` /
``compressed_segmentation_block_size``, and optionally ``sharding``. Members we
do not interpret (``mesh``, ``skeletons``, ``hidden``, ...) are kept and
written back.

A scale is an array over the domain [x, y, z, channel] whose origin is
``voxel_offset``. Its chunks form a grid from that origin; chunk ``cell`` covers
``voxel_offset + cell * chunk_size`` up to the volume's end, so edge chunks are
clipped. Unsharded chunks are stored at ``<key>/<x0>-<x1>_<y0>-<y1>_<z0>-<z1>``
(absolute voxel coordinates); sharded ones in ``<key>/<shard>.shard`` under
the compressed Morton code of ``cell`` (:mod:`.sharding`).

Validation follows TensorStore (which also accepts int8/int16/int32 data, png
and 1..4 channels), with typed errors: :class:`InvalidSpecError` naming the
field for malformed documents, :class:`UnsupportedError` naming an encoding or
data type we cannot handle. Chunks above :data:`MAX_CHUNK_ELEMENTS` elements
are refused, so a decoder never allocates from an absurd declaration.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tensorstore_py.core.errors import InvalidArgumentError, UnsupportedError
from tensorstore_py.drivers.precomputed._json import member, parse_enum, parse_int, spec_error
from tensorstore_py.drivers.precomputed.sharding import ShardingSpec, compressed_morton_code, morton_bits

__all__ = [
    "DATA_TYPES",
    "ENCODINGS",
    "INFO_KEY",
    "MAX_CHUNK_ELEMENTS",
    "Domain",
    "MultiscaleMetadata",
    "ScaleMetadata",
    "check_encoding",
    "default_scale_key",
    "join_key",
]

INFO_KEY = "info"
VOLUME_TYPE_ID = "neuroglancer_multiscale_volume"
VOLUME_TYPES = ("image", "segmentation")
#: data types and their (little-endian) numpy dtypes
DATA_TYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "float32")
}
ENCODINGS = ("raw", "jpeg", "png", "compressed_segmentation", "compresso")
DEFAULT_JPEG_QUALITY = 75
MAX_EXTENT = 2**62  # as TensorStore: index arithmetic stays within int64
MAX_CHUNK_ELEMENTS = 2**31  # per chunk, channels included
LABELS = ("x", "y", "z", "channel")
_SCALE_FIELDS = {
    "key", "size", "voxel_offset", "resolution", "chunk_sizes", "encoding", "jpeg_quality",
    "png_level", "compressed_segmentation_block_size", "sharding",
}
_TOP_FIELDS = {"@type", "type", "data_type", "num_channels", "scales"}


def parse_vec3(v: Any, where: str, lo: int, hi: int) -> tuple[int, int, int]:
    if not isinstance(v, (list, tuple)) or len(v) != 3:
        raise spec_error(where, f"expected an array of 3 integers, got {v!r}")
    return tuple(parse_int(x, f"{where}[{i}]", lo, hi) for i, x in enumerate(v))  # type: ignore[return-value]


def parse_resolution(v: Any, where: str) -> tuple[float, float, float]:
    if not isinstance(v, (list, tuple)) or len(v) != 3 or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v
    ):
        raise spec_error(where, f"expected an array of 3 finite numbers, got {v!r}")
    return tuple(float(x) for x in v)  # type: ignore[return-value]


def _parse_name(v: Any, where: str, supported: Any, what: str) -> str:
    """A name from ``supported``, case-insensitive (as the neuroglancer spec says), lower-cased."""
    if not isinstance(v, str):
        raise spec_error(where, f"expected a string, got {v!r}")
    if v.lower() not in supported:
        raise UnsupportedError(f"neuroglancer_precomputed {where}: {what} {v!r} is not supported "
                               f"(supported: {', '.join(supported)})")
    return v.lower()


def parse_data_type(v: Any, where: str = "data_type") -> str:
    return _parse_name(v, where, DATA_TYPES, "data type")


def parse_encoding(v: Any, where: str = "encoding") -> str:
    return _parse_name(v, where, ENCODINGS, "encoding")


def parse_volume_type(v: Any, where: str = "type") -> str:
    return parse_enum(v, where, VOLUME_TYPES)


def check_encoding(encoding: str, data_type: str | None, num_channels: int | None, where: str) -> None:
    """Raise InvalidSpecError if ``encoding`` cannot hold this data type / channel count."""
    allowed: dict[str, tuple[tuple[str, ...], tuple[int, ...] | None]] = {
        "jpeg": (("uint8",), (1, 3)),
        "png": (("uint8", "uint16"), (1, 2, 3, 4)),
        "compressed_segmentation": (("uint32", "uint64"), None),
        "compresso": (("uint8", "uint16", "uint32", "uint64"), (1,)),
    }
    if encoding not in allowed:
        return
    types, channels = allowed[encoding]
    if data_type is not None and data_type not in types:
        raise spec_error(where, f"{encoding!r} encoding supports data types {list(types)}, not {data_type!r}")
    if channels is not None and num_channels is not None and num_channels not in channels:
        raise spec_error(where, f"{encoding!r} encoding supports {list(channels)} channels, not {num_channels}")


def default_scale_key(resolution: Sequence[float]) -> str:
    """``"<x>_<y>_<z>"`` from the resolution, formatted as TensorStore does (``%.6g``)."""
    return "_".join(f"{r:.6g}" for r in resolution)


def join_key(*parts: str) -> str:
    """Join "/"-separated key parts, resolving "." and ".." (a scale key may step out of
    the volume's folder); InvalidSpecError if the result escapes the store's root."""
    out: list[str] = []
    for part in parts:
        for seg in part.split("/"):
            if seg in ("", "."):
                continue
            if seg == "..":
                if not out:
                    raise spec_error("key", f"{'/'.join(p for p in parts if p)!r} escapes the store's root")
                out.pop()
            else:
                out.append(seg)
    return "/".join(out)


@dataclass(frozen=True)
class Domain:
    """An index domain: ``[inclusive_min, exclusive_max)`` per labelled dimension."""

    inclusive_min: tuple[int, ...]
    exclusive_max: tuple[int, ...]
    labels: tuple[str, ...] = LABELS

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.inclusive_min, self.exclusive_max))


@dataclass(frozen=True)
class ScaleMetadata:
    """One entry of ``scales``. Construct with :meth:`from_json` (which validates)
    or directly followed by :meth:`MultiscaleMetadata.validate`."""

    key: str
    size: tuple[int, int, int]
    resolution: tuple[float, float, float]
    chunk_sizes: tuple[tuple[int, int, int], ...]
    encoding: str
    voxel_offset: tuple[int, int, int] = (0, 0, 0)
    compressed_segmentation_block_size: tuple[int, int, int] | None = None
    sharding: ShardingSpec | None = None
    jpeg_quality: int | None = None  # jpeg only; None reads as 75 and is written as 75
    png_level: int | None = None  # png only; None = the encoder's default, not written
    extra: Mapping[str, Any] = field(default_factory=dict)  # members kept as found

    @classmethod
    def from_json(cls, j: Any, *, data_type: str | None = None, num_channels: int | None = None,
                  where: str = "scale") -> ScaleMetadata:
        if not isinstance(j, Mapping):
            raise spec_error(where, f"expected an object, got {j!r}")
        for name in ("key", "size", "resolution", "chunk_sizes", "encoding"):
            member(j, name, where)
        if not isinstance(j["key"], str):
            raise spec_error(f"{where}.key", f"expected a string, got {j['key']!r}")
        sizes = j["chunk_sizes"]
        if not isinstance(sizes, (list, tuple)) or not sizes:
            raise spec_error(f"{where}.chunk_sizes", f"expected a non-empty array of [x, y, z], got {sizes!r}")
        encoding = parse_encoding(j["encoding"], f"{where}.encoding")
        block = j.get("compressed_segmentation_block_size")
        sharding = j.get("sharding")
        scale = cls(
            key=j["key"],
            size=parse_vec3(j["size"], f"{where}.size", 0, MAX_EXTENT),
            voxel_offset=parse_vec3(j.get("voxel_offset", [0, 0, 0]), f"{where}.voxel_offset",
                                    -MAX_EXTENT, MAX_EXTENT),
            resolution=parse_resolution(j["resolution"], f"{where}.resolution"),
            chunk_sizes=tuple(parse_vec3(c, f"{where}.chunk_sizes[{i}]", 1, MAX_EXTENT)
                              for i, c in enumerate(sizes)),
            encoding=encoding,
            compressed_segmentation_block_size=None if block is None else parse_vec3(
                block, f"{where}.compressed_segmentation_block_size", 1, MAX_EXTENT),
            sharding=None if sharding is None else ShardingSpec.from_json(sharding, where=f"{where}.sharding"),
            jpeg_quality=None if "jpeg_quality" not in j else parse_int(
                j["jpeg_quality"], f"{where}.jpeg_quality", 0, 100),
            png_level=None if "png_level" not in j else parse_int(j["png_level"], f"{where}.png_level", 0, 9),
            extra={k: v for k, v in j.items() if k not in _SCALE_FIELDS},
        )
        scale.validate(data_type, num_channels, where=where)
        return scale

    def validate(self, data_type: str | None, num_channels: int | None, *, where: str = "scale") -> None:
        """Cross-field rules: encoding options, chunk limits, sharded chunk ids within 64 bits."""
        check_encoding(self.encoding, data_type, num_channels, f"{where}.encoding")
        for name, only in (("jpeg_quality", "jpeg"), ("png_level", "png"),
                           ("compressed_segmentation_block_size", "compressed_segmentation")):
            if getattr(self, name) is not None and self.encoding != only:
                raise spec_error(f"{where}.{name}", f"only valid with the {only!r} encoding, not {self.encoding!r}")
        if self.encoding == "compressed_segmentation" and self.compressed_segmentation_block_size is None:
            raise spec_error(f"{where}.compressed_segmentation_block_size", "is required with compressed_segmentation")
        for d in range(3):
            lo, hi = self.voxel_offset[d], self.voxel_offset[d] + self.size[d]
            if not -MAX_EXTENT < lo <= hi < MAX_EXTENT:
                raise spec_error(f"{where}.size", f"size {list(self.size)} at voxel_offset "
                                                  f"{list(self.voxel_offset)} leaves the representable range")
        per_voxel = num_channels or 1
        for i, cs in enumerate(self.chunk_sizes):
            if math.prod(cs) * per_voxel > MAX_CHUNK_ELEMENTS:
                raise spec_error(f"{where}.chunk_sizes[{i}]",
                                 f"a chunk of {list(cs)} x {per_voxel} channels exceeds {MAX_CHUNK_ELEMENTS} elements")
        block = self.compressed_segmentation_block_size
        if block is not None and math.prod(block) > MAX_CHUNK_ELEMENTS:
            raise spec_error(f"{where}.compressed_segmentation_block_size",
                             f"a block of {list(block)} exceeds {MAX_CHUNK_ELEMENTS} elements")
        if self.sharding is not None:
            if len(self.chunk_sizes) != 1:
                raise spec_error(f"{where}.chunk_sizes", "the sharded format allows exactly one chunk size")
            bits = sum(morton_bits(self.grid_shape()))
            if bits > 64:
                raise spec_error(f"{where}.sharding", f"size {list(self.size)} with chunk size "
                                                      f"{list(self.chunk_size)} needs {bits} > 64 bits of chunk id")

    def to_json(self) -> dict[str, Any]:
        """The scale's ``info`` entry (unknown members included)."""
        j: dict[str, Any] = dict(self.extra)
        j.update(
            key=self.key, size=list(self.size), voxel_offset=list(self.voxel_offset),
            resolution=list(self.resolution), chunk_sizes=[list(c) for c in self.chunk_sizes],
            encoding=self.encoding,
        )
        if self.encoding == "jpeg":
            j["jpeg_quality"] = self.quality
        if self.png_level is not None:
            j["png_level"] = self.png_level
        if self.compressed_segmentation_block_size is not None:
            j["compressed_segmentation_block_size"] = list(self.compressed_segmentation_block_size)
        if self.sharding is not None:
            j["sharding"] = self.sharding.to_json()
        return j

    @property
    def quality(self) -> int:
        """The JPEG quality to encode with (75 unless the info says otherwise)."""
        return DEFAULT_JPEG_QUALITY if self.jpeg_quality is None else self.jpeg_quality

    @property
    def chunk_size(self) -> tuple[int, int, int]:
        """The first (for sharded scales: the only) chunk size."""
        return self.chunk_sizes[0]

    def domain(self, num_channels: int) -> Domain:
        """[x, y, z, channel], starting at ``voxel_offset``."""
        lo = (*self.voxel_offset, 0)
        return Domain(lo, tuple(a + s for a, s in zip(lo, (*self.size, num_channels))))

    def _chunk(self, chunk_size: Sequence[int] | None) -> tuple[int, int, int]:
        cs = self.chunk_size if chunk_size is None else tuple(chunk_size)
        if cs not in self.chunk_sizes:
            raise InvalidArgumentError(f"chunk size {list(cs)} is not one of {[list(c) for c in self.chunk_sizes]}")
        return cs  # type: ignore[return-value]

    def grid_shape(self, chunk_size: Sequence[int] | None = None) -> tuple[int, int, int]:
        """Chunks along x, y, z: ``ceil(size / chunk_size)``."""
        cs = self._chunk(chunk_size)
        return tuple(-(-s // c) for s, c in zip(self.size, cs))  # type: ignore[return-value]

    def chunk_box(self, cell: Sequence[int], chunk_size: Sequence[int] | None = None
                  ) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """Voxel coordinates ``(begin, end)`` (x, y, z) of grid cell ``cell``, clipped to the volume."""
        cs = self._chunk(chunk_size)
        grid = self.grid_shape(cs)
        if len(cell) != 3 or any(not 0 <= c < g for c, g in zip(cell, grid)):
            raise InvalidArgumentError(f"chunk cell {list(cell)} is outside the grid {list(grid)}")
        begin = tuple(o + c * n for o, c, n in zip(self.voxel_offset, cell, cs))
        end = tuple(min(b + n, o + s) for b, n, o, s in zip(begin, cs, self.voxel_offset, self.size))
        return begin, end  # type: ignore[return-value]

    def chunk_shape(self, cell: Sequence[int], chunk_size: Sequence[int] | None = None) -> tuple[int, int, int]:
        """The (x, y, z) shape of a chunk: ``chunk_size``, clipped at the volume's upper edges."""
        begin, end = self.chunk_box(cell, chunk_size)
        return tuple(e - b for b, e in zip(begin, end))  # type: ignore[return-value]

    def chunk_name(self, cell: Sequence[int], chunk_size: Sequence[int] | None = None) -> str:
        """``<x0>-<x1>_<y0>-<y1>_<z0>-<z1>``: the unsharded file name of a chunk."""
        begin, end = self.chunk_box(cell, chunk_size)
        return "_".join(f"{b}-{e}" for b, e in zip(begin, end))

    def chunk_key(self, cell: Sequence[int], *, path: str = "",
                  chunk_size: Sequence[int] | None = None) -> str:
        """The store key of an unsharded chunk, for a volume at ``path``."""
        if self.sharding is not None:
            raise InvalidArgumentError(f"scale {self.key!r} is sharded: use chunk_id() and shard_key()")
        return join_key(path, self.key, self.chunk_name(cell, chunk_size))

    def chunk_id(self, cell: Sequence[int]) -> int:
        """The uint64 id of a chunk in the sharded format (compressed Morton code of ``cell``)."""
        return compressed_morton_code(cell, self.grid_shape())

    def shard_key(self, cell: Sequence[int], *, path: str = "") -> str:
        """The store key of the shard file that holds grid cell ``cell``."""
        if self.sharding is None:
            raise InvalidArgumentError(f"scale {self.key!r} is not sharded")
        shard, _ = self.sharding.shard_and_minishard(self.chunk_id(cell))
        return join_key(path, self.key, self.sharding.shard_key(shard))


@dataclass(frozen=True)
class MultiscaleMetadata:
    """The whole ``info`` document."""

    type: str
    data_type: str
    num_channels: int
    scales: tuple[ScaleMetadata, ...]
    extra: Mapping[str, Any] = field(default_factory=dict)  # mesh, skeletons, ... kept as found

    @classmethod
    def from_json(cls, j: Any) -> MultiscaleMetadata:
        """Parse and validate a decoded ``info`` document."""
        if not isinstance(j, Mapping):
            raise spec_error("info", f"expected a JSON object, got {type(j).__name__}")
        if "@type" in j and j["@type"] != VOLUME_TYPE_ID:
            raise spec_error("@type", f"expected {VOLUME_TYPE_ID!r}, got {j['@type']!r}")
        for name in ("type", "data_type", "num_channels", "scales"):
            member(j, name, "info")
        data_type = parse_data_type(j["data_type"])
        num_channels = parse_int(j["num_channels"], "num_channels", 1, 2**31 - 1)
        if not isinstance(j["scales"], (list, tuple)):
            raise spec_error("scales", f"expected an array, got {j['scales']!r}")
        return cls(
            type=parse_volume_type(j["type"]),
            data_type=data_type,
            num_channels=num_channels,
            scales=tuple(ScaleMetadata.from_json(s, data_type=data_type, num_channels=num_channels,
                                                 where=f"scales[{i}]") for i, s in enumerate(j["scales"])),
            extra={k: v for k, v in j.items() if k not in _TOP_FIELDS},
        )

    @classmethod
    def decode(cls, data: bytes | str) -> MultiscaleMetadata:
        """Parse the bytes of an ``info`` file."""
        try:
            j = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise spec_error("info", f"not valid JSON: {e}") from None
        return cls.from_json(j)

    def validate(self) -> None:
        """Re-check every rule (for instances built directly rather than parsed)."""
        MultiscaleMetadata.from_json(self.to_json())

    def to_json(self) -> dict[str, Any]:
        j: dict[str, Any] = {"@type": VOLUME_TYPE_ID, **self.extra}
        j.update(type=self.type, data_type=self.data_type, num_channels=self.num_channels,
                 scales=[s.to_json() for s in self.scales])
        return j

    def encode(self) -> bytes:
        """The ``info`` file's bytes: compact JSON with sorted keys, as TensorStore writes it."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    @property
    def dtype(self) -> np.dtype:
        """The voxel type (little-endian, as stored)."""
        return DATA_TYPES[self.data_type]

    def domain(self, scale_index: int) -> Domain:
        return self.scales[scale_index].domain(self.num_channels)

    def with_scale(self, scale: ScaleMetadata) -> MultiscaleMetadata:
        """A copy with ``scale`` appended (validated against the volume's type and channels)."""
        scale.validate(self.data_type, self.num_channels, where=f"scales[{len(self.scales)}]")
        return MultiscaleMetadata(self.type, self.data_type, self.num_channels,
                                  (*self.scales, scale), self.extra)
