"""TensorStore's spec members of the ``neuroglancer_precomputed`` driver.

``multiscale_metadata`` (``type``, ``data_type``, ``num_channels``) and
``scale_metadata`` (``key``, ``size``, ``voxel_offset``, ``resolution``,
``chunk_size``, ``encoding``, ``jpeg_quality``, ``png_level``,
``compressed_segmentation_block_size``, ``sharding``) together with
``scale_index`` either *select and constrain* a scale of an existing volume
(:func:`open_scale`) or *describe* a new one (:func:`create_scale`), exactly
as TensorStore reads them:

* opening: ``scale_index`` picks the scale, else the first whose ``key`` and
  ``resolution`` match; every other member given must then equal the stored
  value (``chunk_size`` must be one of the scale's ``chunk_sizes`` and picks
  it). No such scale -> NotFoundError; a mismatch -> InvalidSpecError naming
  the member, expected vs found.
* creating: a new volume needs all of ``multiscale_metadata``; a new scale
  needs ``size``, ``resolution`` and ``chunk_size`` (``encoding`` defaults to
  raw, ``key`` to ``"<xres>_<yres>_<zres>"``, ``voxel_offset`` to 0, sharding to
  none). Its index is the next one; ``scale_index``, if given, must say so.

:func:`scale_spec` gives the members back for a ``.spec()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tensorstore_py.core.errors import NotFoundError
from tensorstore_py.drivers.precomputed._json import parse_int, spec_error
from tensorstore_py.drivers.precomputed.metadata import (
    MAX_EXTENT,
    MultiscaleMetadata,
    ScaleMetadata,
    default_scale_key,
    parse_data_type,
    parse_encoding,
    parse_resolution,
    parse_vec3,
    parse_volume_type,
)
from tensorstore_py.drivers.precomputed.sharding import ShardingSpec

__all__ = [
    "MultiscaleConstraints",
    "ResolvedScale",
    "ScaleConstraints",
    "create_scale",
    "open_scale",
    "resolve_scale",
    "scale_spec",
]


class _Unset:
    """``sharding`` absent from a spec (None means "unsharded")."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()


def _obj(j: Any, where: str, fields: set[str]) -> Mapping[str, Any]:
    if j is None:
        return {}
    if not isinstance(j, Mapping):
        raise spec_error(where, f"expected an object, got {j!r}")
    extra = sorted(set(j) - fields)
    if extra:
        raise spec_error(where, f"unknown members {extra}")
    return j


@dataclass(frozen=True)
class MultiscaleConstraints:
    """The ``multiscale_metadata`` spec member; None = unconstrained."""

    type: str | None = None
    data_type: str | None = None
    num_channels: int | None = None

    @classmethod
    def from_json(cls, j: Any) -> MultiscaleConstraints:
        w = "multiscale_metadata"
        j = _obj(j, w, {"type", "data_type", "num_channels"})
        return cls(
            type=None if "type" not in j else parse_volume_type(j["type"], f"{w}.type"),
            data_type=None if "data_type" not in j else parse_data_type(j["data_type"], f"{w}.data_type"),
            num_channels=None if "num_channels" not in j else parse_int(
                j["num_channels"], f"{w}.num_channels", 1, 2**31 - 1),
        )

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in (("type", self.type), ("data_type", self.data_type),
                                  ("num_channels", self.num_channels)) if v is not None}

    def check(self, info: MultiscaleMetadata) -> None:
        for name, want in self.to_json().items():
            _expect(f"multiscale_metadata.{name}", want, getattr(info, name))


@dataclass(frozen=True)
class ScaleConstraints:
    """The ``scale_metadata`` spec member; None = unconstrained, ``sharding`` UNSET = unconstrained."""

    key: str | None = None
    size: tuple[int, int, int] | None = None
    voxel_offset: tuple[int, int, int] | None = None
    resolution: tuple[float, float, float] | None = None
    chunk_size: tuple[int, int, int] | None = None
    encoding: str | None = None
    jpeg_quality: int | None = None
    png_level: int | None = None
    compressed_segmentation_block_size: tuple[int, int, int] | None = None
    sharding: ShardingSpec | None = UNSET

    @classmethod
    def from_json(cls, j: Any) -> ScaleConstraints:
        w = "scale_metadata"
        j = _obj(j, w, {"key", "size", "voxel_offset", "resolution", "chunk_size", "encoding", "jpeg_quality",
                        "png_level", "compressed_segmentation_block_size", "sharding"})
        if "voxel_offset" in j and "size" not in j:
            raise spec_error(f"{w}.voxel_offset", "cannot be given without 'size'")
        if "key" in j and not isinstance(j["key"], str):
            raise spec_error(f"{w}.key", f"expected a string, got {j['key']!r}")

        def get(name: str, parse: Any, *args: Any) -> Any:
            return None if name not in j else parse(j[name], f"{w}.{name}", *args)

        sharding = UNSET
        if "sharding" in j:
            sharding = None if j["sharding"] is None else ShardingSpec.from_json(j["sharding"], where=f"{w}.sharding")
        return cls(
            key=j.get("key"),
            size=get("size", parse_vec3, 0, MAX_EXTENT),
            voxel_offset=get("voxel_offset", parse_vec3, -MAX_EXTENT, MAX_EXTENT),
            resolution=get("resolution", parse_resolution),
            chunk_size=get("chunk_size", parse_vec3, 1, MAX_EXTENT),
            encoding=get("encoding", parse_encoding),
            jpeg_quality=get("jpeg_quality", parse_int, 0, 100),
            png_level=get("png_level", parse_int, 0, 9),
            compressed_segmentation_block_size=get("compressed_segmentation_block_size", parse_vec3, 1, MAX_EXTENT),
            sharding=sharding,
        )

    def to_json(self) -> dict[str, Any]:
        j: dict[str, Any] = {}
        for name in ("key", "size", "voxel_offset", "resolution", "chunk_size", "encoding", "jpeg_quality",
                     "png_level", "compressed_segmentation_block_size"):
            v = getattr(self, name)
            if v is not None:
                j[name] = list(v) if isinstance(v, tuple) else v
        if self.sharding is not UNSET:
            j["sharding"] = None if self.sharding is None else self.sharding.to_json()
        return j

    def selects(self, scale: ScaleMetadata) -> bool:
        """Whether ``scale`` is one this spec names (by key and resolution)."""
        return ((self.key is None or self.key == scale.key)
                and (self.resolution is None or self.resolution == scale.resolution))

    def check(self, scale: ScaleMetadata, where: str) -> None:
        """InvalidSpecError unless every given member matches ``scale``."""
        for name in ("key", "encoding", "resolution", "size", "voxel_offset",
                     "compressed_segmentation_block_size", "png_level"):
            want = getattr(self, name)
            if want is not None:
                _expect(f"{where}.{name}", want, getattr(scale, name))
        if self.jpeg_quality is not None and scale.encoding == "jpeg":
            _expect(f"{where}.jpeg_quality", self.jpeg_quality, scale.quality)
        if self.sharding is not UNSET:
            _expect(f"{where}.sharding", self.sharding, scale.sharding)
        if self.chunk_size is not None and self.chunk_size not in scale.chunk_sizes:
            raise spec_error(f"{where}.chunk_size", f"expected one of {[list(c) for c in scale.chunk_sizes]}, "
                                                    f"got {list(self.chunk_size)}")


def _show(v: Any) -> Any:
    return v.to_json() if isinstance(v, ShardingSpec) else list(v) if isinstance(v, tuple) else v


def _expect(where: str, want: Any, found: Any) -> None:
    if want != found:
        raise spec_error(where, f"expected {_show(want)!r}, found {_show(found)!r} in the stored info")


@dataclass(frozen=True)
class ResolvedScale:
    """A scale of an ``info`` (opened or newly created) and the chunk size to use."""

    info: MultiscaleMetadata
    index: int
    chunk_size: tuple[int, int, int]

    @property
    def scale(self) -> ScaleMetadata:
        return self.info.scales[self.index]


def _constraints(scale_metadata: Any, multiscale_metadata: Any) -> tuple[ScaleConstraints, MultiscaleConstraints]:
    sc = scale_metadata if isinstance(scale_metadata, ScaleConstraints) else ScaleConstraints.from_json(scale_metadata)
    mc = (multiscale_metadata if isinstance(multiscale_metadata, MultiscaleConstraints)
          else MultiscaleConstraints.from_json(multiscale_metadata))
    return sc, mc


def open_scale(info: MultiscaleMetadata, *, scale_index: int | None = None,
               scale_metadata: ScaleConstraints | Mapping[str, Any] | None = None,
               multiscale_metadata: MultiscaleConstraints | Mapping[str, Any] | None = None) -> ResolvedScale:
    """Select the scale of an existing volume that the spec names, checking every constraint."""
    sc, mc = _constraints(scale_metadata, multiscale_metadata)
    mc.check(info)
    if scale_index is not None:
        index = parse_int(scale_index, "scale_index", 0, 2**31)
        if index >= len(info.scales):
            raise NotFoundError(f"neuroglancer_precomputed: scale {index} does not exist "
                                f"(the volume has {len(info.scales)})")
    else:
        found = [i for i, s in enumerate(info.scales) if sc.selects(s)]
        if not found:
            raise NotFoundError(f"neuroglancer_precomputed: no scale matches {sc.to_json()} "
                                f"(scales: {[s.key for s in info.scales]})")
        index = found[0]
    sc.check(info.scales[index], f"scale_metadata (scale {index})")
    return ResolvedScale(info, index, sc.chunk_size or info.scales[index].chunk_size)


def create_scale(info: MultiscaleMetadata | None, *, scale_index: int | None = None,
                 scale_metadata: ScaleConstraints | Mapping[str, Any] | None = None,
                 multiscale_metadata: MultiscaleConstraints | Mapping[str, Any] | None = None) -> ResolvedScale:
    """A new scale (in a new volume when ``info`` is None), as described by the spec.

    The result's ``info`` is the new document, to be written by the caller
    (create-only for a new volume, compare-and-swap to add a scale).
    """
    sc, mc = _constraints(scale_metadata, multiscale_metadata)
    if info is None:
        for name in ("type", "data_type", "num_channels"):
            if getattr(mc, name) is None:
                raise spec_error(f"multiscale_metadata.{name}", "is required to create a volume")
        info = MultiscaleMetadata(mc.type, mc.data_type, mc.num_channels, ())  # type: ignore[arg-type]
    else:
        mc.check(info)
    n = len(info.scales)
    if scale_index is not None and parse_int(scale_index, "scale_index", 0, 2**31) != n:
        raise spec_error("scale_index", f"a new scale gets index {n}, not {scale_index}")
    for name in ("size", "resolution", "chunk_size"):
        if getattr(sc, name) is None:
            raise spec_error(f"scale_metadata.{name}", "is required to create a scale")
    key = sc.key if sc.key is not None else default_scale_key(sc.resolution)  # type: ignore[arg-type]
    if any(s.key == key for s in info.scales):
        raise spec_error("scale_metadata.key", f"a scale {key!r} already exists")
    encoding = sc.encoding or "raw"
    scale = ScaleMetadata(
        key=key,
        size=sc.size,  # type: ignore[arg-type]
        voxel_offset=sc.voxel_offset or (0, 0, 0),
        resolution=sc.resolution,  # type: ignore[arg-type]
        chunk_sizes=(sc.chunk_size,),  # type: ignore[arg-type]
        encoding=encoding,
        compressed_segmentation_block_size=sc.compressed_segmentation_block_size,
        sharding=None if sc.sharding is UNSET else sc.sharding,
        jpeg_quality=sc.jpeg_quality,
        png_level=sc.png_level,
    )
    info = info.with_scale(scale)
    return ResolvedScale(info, n, scale.chunk_size)


def resolve_scale(info: MultiscaleMetadata | None, *, open: bool = True, create: bool = False,
                  scale_index: int | None = None,
                  scale_metadata: ScaleConstraints | Mapping[str, Any] | None = None,
                  multiscale_metadata: MultiscaleConstraints | Mapping[str, Any] | None = None
                  ) -> tuple[ResolvedScale, bool]:
    """Open the scale the spec names or, failing that and if ``create``, make it.

    Returns the scale and whether ``info`` changed (and must be written).
    """
    if open and info is not None:
        try:
            return open_scale(info, scale_index=scale_index, scale_metadata=scale_metadata,
                              multiscale_metadata=multiscale_metadata), False
        except NotFoundError:
            if not create:
                raise
    if not create:
        raise NotFoundError("neuroglancer_precomputed: the volume's info does not exist")
    return create_scale(info, scale_index=scale_index, scale_metadata=scale_metadata,
                        multiscale_metadata=multiscale_metadata), True


def scale_spec(opened: ResolvedScale) -> dict[str, Any]:
    """``scale_index``, ``scale_metadata`` and ``multiscale_metadata`` describing an open scale."""
    s = opened.scale
    sc = ScaleConstraints(
        key=s.key, size=s.size, voxel_offset=s.voxel_offset, resolution=s.resolution,
        chunk_size=opened.chunk_size, encoding=s.encoding,
        jpeg_quality=s.quality if s.encoding == "jpeg" else None, png_level=s.png_level,
        compressed_segmentation_block_size=s.compressed_segmentation_block_size, sharding=s.sharding,
    )
    mc = MultiscaleConstraints(type=opened.info.type, data_type=opened.info.data_type,
                               num_channels=opened.info.num_channels)
    return {"scale_index": opened.index, "scale_metadata": sc.to_json(), "multiscale_metadata": mc.to_json()}
