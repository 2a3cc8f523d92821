"""Pytrees: flatten to (path, leaf) pairs and back, with a stored structure.

A checkpoint records the *structure* of the saved tree as JSON so that
``restore(..., target=None)`` can rebuild it without the original classes:

* ``dict`` (keys: str, int, float, bool or None), ``list``, ``tuple``, ``None``;
* namedtuples (rebuilt as a ``collections.namedtuple`` of the same name and fields);
* dataclasses and other JAX-registered nodes (flax structs, ...) are recorded with
  their attribute / key names and rebuilt as ``dict`` when no target is given.

Every leaf is named by a *path string* in the style of ``jax.tree_util.keystr``:
``['params']['w']``, ``[0]``, ``.kernel``. Paths are how a target tree is matched
to stored leaves, so a restore into a target only needs the same paths, not the
same container classes.

Works with numpy alone; when JAX is importable (and already imported by the
caller) custom pytree nodes registered with ``jax.tree_util`` are walked too.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from tensorstore_py.core.errors import InvalidArgumentError, InvalidSpecError

__all__ = ["flatten", "flatten_target", "path_str", "unflatten"]

Structure = dict[str, Any]  # JSON-able description of one tree node


def _jax_tree_util() -> Any:
    """``jax.tree_util`` if JAX is already imported, else None (never imports JAX)."""
    jax = sys.modules.get("jax")
    return getattr(jax, "tree_util", None) if jax is not None else None


def _key_str(k: Any) -> str:
    return f"[{k!r}]"


def _json_key(k: Any) -> Any:
    if k is None or isinstance(k, (str, bool, int, float)):
        return k
    raise InvalidArgumentError(
        f"pytree dict key {k!r} of type {type(k).__name__} cannot be stored; "
        "use str, int, float, bool or None keys"
    )


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _jax_entry_str(entry: Any) -> str:
    """One ``jax.tree_util`` key entry as a path segment (matches ``keystr``)."""
    name = type(entry).__name__
    if name == "DictKey":
        return _key_str(entry.key)
    if name == "SequenceKey":
        return f"[{entry.idx}]"
    if name == "GetAttrKey":
        return f".{entry.name}"
    if name == "FlattenedIndexKey":
        return f"[<flat index {entry.key}>]"
    return str(entry)


def path_str(entries: Any) -> str:
    """A ``jax.tree_util`` key path as this module's path string."""
    return "".join(_jax_entry_str(e) for e in entries)


def flatten(tree: Any) -> tuple[list[tuple[str, Any]], Structure]:
    """Split ``tree`` into ``[(path, leaf), ...]`` (depth-first order) and a structure.

    ``None`` is an empty node (as in JAX), not a leaf. Raises
    :class:`InvalidArgumentError` for dict keys that JSON can not hold.

    With JAX imported, a tree whose ``jax.tree_util`` structure was seen
    before (a train state saved every few steps, its restore target) is
    flattened by JAX alone and takes the paths and structure found then
    (:func:`_flatten_cached`), instead of a walk in Python.
    """
    tu = _jax_tree_util()
    if tu is None:
        return _walk(tree, None)
    cached = _flatten_cached(tu, tree)
    if cached is not None:
        return cached
    leaves, structure = _walk(tree, tu)
    _remember(tu, tree, leaves, structure)
    return leaves, structure


#: a jax treedef -> the paths of its leaves and the structure :func:`_walk` gave
_BY_TREEDEF: dict[Any, tuple[list[str], Structure]] = {}
_BY_TREEDEF_MAX = 16
#: types of the leaves that :func:`_walk` and ``jax.tree_util`` both take as leaves
_PLAIN_TYPES: set[type] = {bool, int, float, complex, str, bytes}


def _plain(x: Any) -> bool:
    t = type(x)
    if t in _PLAIN_TYPES:
        return True
    jax = sys.modules.get("jax")
    kinds: tuple[type, ...] = (np.ndarray, np.generic)
    if jax is not None:
        kinds += (jax.Array, jax.ShapeDtypeStruct)
    if isinstance(x, kinds):
        _PLAIN_TYPES.add(t)
        return True
    return False


def _flatten_cached(tu: Any, tree: Any) -> tuple[list[tuple[str, Any]], Structure] | None:
    """:func:`flatten` of a tree of a known treedef whose leaves are all plain
    (arrays, scalars: leaves for both), else None."""
    if not _BY_TREEDEF:
        return None
    try:
        jleaves, treedef = tu.tree_flatten(tree)
        hit = _BY_TREEDEF.get(treedef)
    except Exception:  # not flattenable by JAX, an unhashable node: walk it
        return None
    if hit is None or not all(map(_plain, jleaves)):
        return None
    paths, structure = hit
    return list(zip(paths, jleaves)), structure


def _remember(tu: Any, tree: Any, leaves: list[tuple[str, Any]], structure: Structure) -> None:
    """Keep the paths and structure of ``tree`` by its treedef when JAX sees the
    very same leaves in the same order, all plain."""
    try:
        jleaves, treedef = tu.tree_flatten(tree)
        same = len(jleaves) == len(leaves) and all(a is b for a, (_, b) in zip(jleaves, leaves))
        if not same or not all(map(_plain, jleaves)):
            return
        if len(_BY_TREEDEF) >= _BY_TREEDEF_MAX:
            _BY_TREEDEF.pop(next(iter(_BY_TREEDEF)))
        _BY_TREEDEF[treedef] = ([p for p, _ in leaves], structure)
    except Exception:  # not flattenable by JAX, an unhashable node: nothing kept
        return


def _walk(tree: Any, tu: Any) -> tuple[list[tuple[str, Any]], Structure]:
    """:func:`flatten` by a walk of the tree in Python."""
    leaves: list[tuple[str, Any]] = []

    def walk(x: Any, path: str) -> Structure:
        if type(x) in _PLAIN_TYPES:  # the common leaf (an array): none of the node tests below
            leaves.append((path, x))
            return {"t": "leaf", "i": len(leaves) - 1}
        if x is None:
            return {"t": "none"}
        if isinstance(x, dict):
            keys = _sorted_keys(x)
            return {
                "t": "dict",
                "keys": [_json_key(k) for k in keys],
                "c": [walk(x[k], path + _key_str(k)) for k in keys],
            }
        if _is_namedtuple(x):
            fields = list(type(x)._fields)
            return {
                "t": "namedtuple",
                "name": type(x).__name__,
                "keys": fields,
                "c": [walk(getattr(x, f), f"{path}.{f}") for f in fields],
            }
        if isinstance(x, (list, tuple)):
            return {
                "t": "list" if isinstance(x, list) else "tuple",
                "c": [walk(v, f"{path}[{i}]") for i, v in enumerate(x)],
            }
        if tu is not None and not _is_leaf_for_jax(tu, x):
            pairs, _aux = tu.flatten_one_level_with_keys(x)
            segs = [_jax_entry_str(k) for k, _ in pairs]
            return {
                "t": "node",
                "name": type(x).__name__,
                "keys": segs,
                "c": [walk(v, path + s) for s, (_, v) in zip(segs, pairs)],
            }
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            fields = [f.name for f in dataclasses.fields(x)]
            return {
                "t": "node",
                "name": type(x).__name__,
                "keys": [f".{f}" for f in fields],
                "c": [walk(getattr(x, f), f"{path}.{f}") for f in fields],
            }
        _plain(x)  # an array type is then known as a leaf (checked first next time)
        leaves.append((path, x))
        return {"t": "leaf", "i": len(leaves) - 1}

    return leaves, walk(tree, "")


def _sorted_keys(d: dict[Any, Any]) -> list[Any]:
    # JAX sorts dict keys when flattening; we do the same so leaf order agrees.
    try:
        return sorted(d)
    except TypeError:
        return sorted(d, key=lambda k: (type(k).__name__, repr(k)))


def _is_leaf_for_jax(tu: Any, x: Any) -> bool:
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array):  # the common leaf, without a tree walk
        return True
    try:
        return bool(tu.all_leaves([x]))
    except Exception:
        return True


def unflatten(structure: Structure, leaves: list[Any]) -> Any:
    """Rebuild a tree from :func:`flatten`'s structure and its leaves (by index).

    Dataclasses and custom nodes come back as ``dict`` keyed by their attribute /
    key names (without the leading ``.``); namedtuples as namedtuples.
    """

    def build(s: Structure) -> Any:
        t = s.get("t")
        if t == "leaf":
            return leaves[s["i"]]
        if t == "none":
            return None
        if t == "dict":
            return {k: build(c) for k, c in zip(s["keys"], s["c"])}
        if t == "list":
            return [build(c) for c in s["c"]]
        if t == "tuple":
            return tuple(build(c) for c in s["c"])
        if t == "namedtuple":
            cls = _namedtuple_class(s["name"], tuple(s["keys"]))
            return cls(*(build(c) for c in s["c"]))
        if t == "node":
            return {_strip_seg(k): build(c) for k, c in zip(s["keys"], s["c"])}
        raise InvalidSpecError(f"checkpoint tree structure: unknown node type {t!r}")

    return build(structure)


def _strip_seg(seg: str) -> str:
    if seg.startswith("."):
        return seg[1:]
    if seg.startswith("['") and seg.endswith("']"):
        return seg[2:-2]
    return seg


_NT_CACHE: dict[tuple[str, tuple[str, ...]], type] = {}
# called by another name: a type checker reads ``namedtuple(...)`` as a class statement,
# whose name must be a literal
_new_namedtuple = collections.namedtuple


def _namedtuple_class(name: str, fields: tuple[str, ...]) -> type:
    key = (name, fields)
    cls = _NT_CACHE.get(key)
    if cls is None:
        try:
            cls = _new_namedtuple(name, fields)
        except ValueError:
            cls = _new_namedtuple("Record", fields, rename=True)
        _NT_CACHE[key] = cls
    return cls


def flatten_target(target: Any) -> tuple[list[tuple[str, Any]], Callable[[list[Any]], Any]]:
    """Flatten a restore target; returns ``[(path, leaf)]`` and a rebuild function.

    The rebuilt tree has the target's own classes (dataclasses, namedtuples and,
    with JAX, any node registered with ``jax.tree_util`` such as flax structs).
    """
    leaves, _structure = flatten(target)

    def rebuild(vals: list[Any]) -> Any:
        return _rebuild_like(target, iter(vals), _jax_tree_util())

    return leaves, rebuild


def _rebuild_like(x: Any, it: Any, tu: Any) -> Any:
    """Rebuild ``x``'s containers with leaves taken from ``it`` in :func:`flatten` order."""
    if x is None:
        return None
    if isinstance(x, dict):
        vals = {k: _rebuild_like(x[k], it, tu) for k in _sorted_keys(x)}
        out = {} if type(x) is dict else type(x)()
        for k in x:
            out[k] = vals[k]
        return out
    if _is_namedtuple(x):
        return type(x)(*(_rebuild_like(getattr(x, f), it, tu) for f in type(x)._fields))
    if isinstance(x, (list, tuple)):
        return type(x)(_rebuild_like(v, it, tu) for v in x)
    if tu is not None and not _is_leaf_for_jax(tu, x):
        children, _aux = tu.flatten_one_level(x)
        node = tu.tree_structure(x, is_leaf=lambda n: n is not x)
        return node.unflatten([_rebuild_like(c, it, tu) for c in children])
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        vals = {f.name: _rebuild_like(getattr(x, f.name), it, tu) for f in dataclasses.fields(x)}
        return dataclasses.replace(x, **vals)
    return next(it)
