"""Multiscale images: OME-Zarr (NGFF) ``multiscales`` and neuroglancer precomputed scales.

:func:`open_multiscale(url)` reads the pyramid description at ``url`` and
returns a :class:`Multiscale`: its axes, its levels (each a dataset path with
its coordinate scale and translation), and ``open(level)`` to open one level
as a :class:`~tensorstore_py.TensorStore`. Two kinds of pyramid are known:

* OME-Zarr, NGFF 0.5: a zarr v3 group whose ``zarr.json`` has
  ``attributes.ome = {"version": "0.5", "multiscales": [...]}``.
* OME-Zarr, NGFF 0.4 (and the older 0.1-0.3): a zarr v2 group whose
  ``.zattrs`` holds ``multiscales`` (each with its ``version``); a v3 group
  carrying ``multiscales`` directly in its attributes is read the same way.
  0.3 axes are plain names; 0.1/0.2 have none (``t, c, z, y, x`` is assumed).
* neuroglancer precomputed: a volume ``info``; level ``i`` is scale ``i``
  (axes x, y, z in nm, channel).

A multiscale entry's ``datasets`` are the levels, highest resolution first;
each dataset's ``coordinateTransformations`` (a ``scale`` and an optional
``translation``) are followed by the entry's own, if any, and folded into one
scale and translation per axis. Malformed documents raise InvalidSpecError
naming the member (``multiscales[0].datasets[1].path``); transformations
stored in a separate file (``"path"`` instead of values) raise UnsupportedError.

:func:`ngff_attributes` builds the document a writer stores
(:mod:`tensorstore_py.pyramid` uses it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tensorstore_py.core.errors import InvalidSpecError, NotFoundError, UnsupportedError
from tensorstore_py.core.future import Future, spawn
from tensorstore_py.drivers.chunked_metadata import json_object
from tensorstore_py.drivers.precomputed.metadata import INFO_KEY, MultiscaleMetadata
from tensorstore_py.kvstore.base import KvStore
from tensorstore_py.kvstore.registry import open_kvstore
from tensorstore_py.opening import open as open_array
from tensorstore_py.tensorstore import TensorStore

__all__ = ["Axis", "Level", "Multiscale", "ngff_attributes", "open_multiscale", "parse_multiscales"]

NGFF_VERSIONS = ("0.1", "0.2", "0.3", "0.4", "0.5")
_DEFAULT_AXES = ("t", "c", "z", "y", "x")  # NGFF 0.1 / 0.2
_AXIS_TYPES = {"t": "time", "c": "channel", "z": "space", "y": "space", "x": "space"}


@dataclass(frozen=True)
class Axis:
    """One dimension of a multiscale image: its name, type (``space``, ``time``,
    ``channel``, ...; None when not given) and unit (None when not given)."""

    name: str
    type: str | None = None
    unit: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in (("name", self.name), ("type", self.type), ("unit", self.unit)) if v is not None}


@dataclass(frozen=True)
class Level:
    """One resolution level: where it is stored (relative to the group or volume) and
    how its indices map to coordinates (``coordinate = index * scale + translation``)."""

    path: str
    scale: tuple[float, ...]
    translation: tuple[float, ...]


@dataclass(frozen=True)
class Multiscale:
    """A pyramid: axes, levels (highest resolution first) and how to open them."""

    kvstore: KvStore
    format: str  # "ome-zarr" or "neuroglancer_precomputed"
    version: str | None  # the NGFF version; None for precomputed
    axes: tuple[Axis, ...]
    levels: tuple[Level, ...]
    name: str | None = None
    metadata: Mapping[str, Any] | None = None  # the multiscale entry (or the info) as stored

    def __len__(self) -> int:
        return len(self.levels)

    def open(self, level: int = 0) -> Future[TensorStore]:
        """Open level ``level`` (0 = highest resolution; negative counts from the end)."""
        if not -len(self.levels) <= level < len(self.levels):
            raise NotFoundError(f"multiscale at {self.kvstore!r}: level {level} does not exist "
                                f"({len(self.levels)} levels)")
        index = level % len(self.levels)
        if self.format == "neuroglancer_precomputed":
            spec: dict[str, Any] = {"driver": "neuroglancer_precomputed", "kvstore": self.kvstore.spec(),
                                    "scale_index": index}
        else:
            spec = {"kvstore": self.kvstore.with_path(self.levels[index].path).spec()}
        return open_array(spec)


def open_multiscale(url: str | Mapping[str, Any] | KvStore, *, index: int = 0) -> Future[Multiscale]:
    """Read the pyramid at ``url`` (a kvstore URL or spec): an OME-Zarr group (the
    ``index``-th of its ``multiscales``) or a neuroglancer precomputed volume.
    NotFoundError when there is neither."""
    return spawn(_open_multiscale(url, index))


async def _open_multiscale(url: Any, index: int) -> Multiscale:
    kv = url if isinstance(url, KvStore) else await open_kvstore(url)
    v3, zattrs, info = await _read_all(kv, ("zarr.json", ".zattrs", INFO_KEY))
    if v3 is not None:
        doc = json_object(v3, f"multiscale at {kv!r}: zarr.json")
        if doc.get("node_type") != "group":
            raise InvalidSpecError(f"multiscale at {kv!r}: zarr.json is not a group (node_type "
                                   f"{doc.get('node_type')!r})")
        return parse_multiscales(doc.get("attributes") or {}, kv, index=index, where="zarr.json attributes")
    if zattrs is not None:
        return parse_multiscales(json_object(zattrs, f"multiscale at {kv!r}: .zattrs"), kv, index=index,
                                 where=".zattrs")
    if info is not None:
        return _precomputed(MultiscaleMetadata.decode(bytes(info)), kv)
    raise NotFoundError(f"no multiscale image at {kv!r}: none of zarr.json, .zattrs, {INFO_KEY} found")


async def _read_all(kv: KvStore, keys: Sequence[str]) -> list[Any]:
    results = await asyncio.gather(*(kv.read(key) for key in keys))
    return [res.value if res.state == "value" else None for res in results]


def _precomputed(info: MultiscaleMetadata, kv: KvStore) -> Multiscale:
    axes = (Axis("x", "space", "nanometer"), Axis("y", "space", "nanometer"),
            Axis("z", "space", "nanometer"), Axis("channel", "channel"))
    levels = tuple(Level(s.key, (*s.resolution, 1.0),
                         (*(o * r for o, r in zip(s.voxel_offset, s.resolution)), 0.0)) for s in info.scales)
    return Multiscale(kv, "neuroglancer_precomputed", None, axes, levels, None, info.to_json())


# -- NGFF documents ---------------------------------------------------------------------------
def _err(where: str, msg: str) -> InvalidSpecError:
    return InvalidSpecError(f"OME-Zarr {where}: {msg}")


def parse_multiscales(attrs: Mapping[str, Any], kv: KvStore, *, index: int = 0,
                      where: str = "attributes") -> Multiscale:
    """The ``index``-th multiscale image described by a group's attributes (NGFF 0.1-0.5)."""
    version = None
    if isinstance(attrs.get("ome"), Mapping):  # 0.5
        ome = attrs["ome"]
        where = f"{where}.ome"
        version = ome.get("version")
        entries = ome.get("multiscales")
    else:
        entries = attrs.get("multiscales")
    if entries is None:
        raise NotFoundError(f"no OME-Zarr multiscales in the {where} at {kv!r}")
    if not isinstance(entries, list) or not entries:
        raise _err(f"{where}.multiscales", f"expected a non-empty array, got {entries!r}")
    if not 0 <= index < len(entries):
        raise NotFoundError(f"OME-Zarr at {kv!r}: multiscale {index} does not exist ({len(entries)} present)")
    w = f"{where}.multiscales[{index}]"
    entry = entries[index]
    if not isinstance(entry, Mapping):
        raise _err(w, f"expected an object, got {entry!r}")
    version = entry.get("version", version)
    if version is not None and version not in NGFF_VERSIONS:
        raise UnsupportedError(f"OME-Zarr {w}.version: {version!r} is not supported "
                               f"(supported: {', '.join(NGFF_VERSIONS)})")
    datasets = entry.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        raise _err(f"{w}.datasets", f"expected a non-empty array, got {datasets!r}")
    axes = _axes(entry.get("axes"), f"{w}.axes")
    rank = len(axes) if axes is not None else None
    outer = _transforms(entry.get("coordinateTransformations"), f"{w}.coordinateTransformations", rank,
                        required=False)
    levels = []
    for i, ds in enumerate(datasets):
        dw = f"{w}.datasets[{i}]"
        if not isinstance(ds, Mapping) or not isinstance(ds.get("path"), str) or not ds["path"]:
            raise _err(f"{dw}.path", f"expected a non-empty string, got {ds!r}")
        scale, translation = _transforms(ds.get("coordinateTransformations"), f"{dw}.coordinateTransformations",
                                         rank, required=version in ("0.4", "0.5"))
        if rank is None:
            rank = len(scale) if scale else None
        levels.append((ds["path"], scale, translation))
    if rank is None:
        raise _err(f"{w}.axes", "missing, and no coordinate transformation tells the rank")
    if axes is None:  # 0.1 / 0.2: t, c, z, y, x, the last ``rank`` of them
        axes = tuple(Axis(n, _AXIS_TYPES[n]) for n in _DEFAULT_AXES[-rank:])
    o_scale, o_translation = outer
    out = []
    for path, scale, translation in levels:
        s = scale or (1.0,) * rank
        t = translation or (0.0,) * rank
        if o_scale:  # the entry's transformations apply after the dataset's
            t = tuple(ti * os for ti, os in zip(t, o_scale))
            s = tuple(si * os for si, os in zip(s, o_scale))
        if o_translation:
            t = tuple(ti + ot for ti, ot in zip(t, o_translation))
        out.append(Level(path, s, t))
    name = entry.get("name")
    return Multiscale(kv, "ome-zarr", version, axes, tuple(out), name if isinstance(name, str) else None,
                      dict(entry))


def _axes(j: Any, where: str) -> tuple[Axis, ...] | None:
    if j is None:
        return None
    if not isinstance(j, list) or not 2 <= len(j) <= 5:
        raise _err(where, f"expected an array of 2 to 5 axes, got {j!r}")
    axes = []
    for i, a in enumerate(j):
        if isinstance(a, str):  # 0.3
            axes.append(Axis(a, _AXIS_TYPES.get(a)))
            continue
        if not isinstance(a, Mapping) or not isinstance(a.get("name"), str):
            raise _err(f"{where}[{i}]", f"expected an object with a 'name', got {a!r}")
        kind, unit = a.get("type"), a.get("unit")
        if kind is not None and not isinstance(kind, str) or unit is not None and not isinstance(unit, str):
            raise _err(f"{where}[{i}]", f"'type' and 'unit' must be strings, got {a!r}")
        axes.append(Axis(a["name"], kind, unit))
    names = [a.name for a in axes]
    if len(set(names)) != len(names):
        raise _err(where, f"axis names must be unique, got {names}")
    return tuple(axes)


def _vector(v: Any, where: str, rank: int | None) -> tuple[float, ...]:
    if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        raise _err(where, f"expected an array of numbers, got {v!r}")
    if rank is not None and len(v) != rank:
        raise _err(where, f"expected {rank} values (one per axis), got {len(v)}")
    return tuple(float(x) for x in v)


def _transforms(j: Any, where: str, rank: int | None, *, required: bool
                ) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
    """(scale, translation) of a list of coordinate transformations (0.4/0.5 rules:
    at most one scale, then at most one translation; identity allowed)."""
    if j is None:
        if required:
            raise _err(where, "is required (a 'scale' transformation per dataset)")
        return None, None
    if not isinstance(j, list):
        raise _err(where, f"expected an array, got {j!r}")
    scale = translation = None
    for i, t in enumerate(j):
        tw = f"{where}[{i}]"
        kind = t.get("type") if isinstance(t, Mapping) else None
        if kind == "identity":
            continue
        if kind not in ("scale", "translation"):
            raise _err(f"{tw}.type", f"expected 'scale', 'translation' or 'identity', got {t!r}")
        if "path" in t and kind not in t:
            raise UnsupportedError(f"OME-Zarr {tw}: transformations stored in a file ({t['path']!r}) "
                                   "are not supported")
        if kind == "scale":
            if scale is not None or translation is not None:
                raise _err(tw, "a 'scale' must come first and only once")
            scale = _vector(t.get("scale"), f"{tw}.scale", rank)
        else:
            if translation is not None:
                raise _err(tw, "at most one 'translation'")
            translation = _vector(t.get("translation"), f"{tw}.translation", rank)
    if required and scale is None:
        raise _err(where, "needs a 'scale' transformation")
    if scale is not None and translation is not None and len(scale) != len(translation):
        raise _err(where, "scale and translation have different lengths")
    return scale, translation


def ngff_attributes(axes: Sequence[Axis], levels: Sequence[Level], *, zarr_format: int,
                    name: str | None = None, method: str | None = None) -> dict[str, Any]:
    """The group attributes describing a pyramid: NGFF 0.5 (``{"ome": {...}}``) for
    zarr v3 groups, NGFF 0.4 (``{"multiscales": [...]}``) for zarr v2 groups."""
    entry: dict[str, Any] = {}
    if name is not None:
        entry["name"] = name
    entry["axes"] = [a.to_json() for a in axes]
    entry["datasets"] = [
        {"path": lv.path, "coordinateTransformations": [{"type": "scale", "scale": list(lv.scale)}]
         + ([{"type": "translation", "translation": list(lv.translation)}] if any(lv.translation) else [])}
        for lv in levels]
    if method is not None:
        entry["type"] = method
        entry["metadata"] = {"method": "tensorstore_py.downsample", "kwargs": {"method": method}}
    if zarr_format == 3:
        return {"ome": {"version": "0.5", "multiscales": [entry]}}
    return {"multiscales": [{"version": "0.4", **entry}]}
