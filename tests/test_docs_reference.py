"""The API reference (docs/reference/, built by `.ci/docs`) documents every public name."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import tensorstore_py as tsp

ROOT = Path(__file__).resolve().parent.parent
DIRECTIVE = re.compile(r"^::: (\S+)\n((?:    .*\n)*)", re.M)


def _resolve(path: str) -> Any:
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def _documented() -> list[Any]:
    """Every object an `::: name` directive of the reference renders."""
    out: list[Any] = []
    for page in sorted((ROOT / "docs" / "reference").glob("*.md")):
        for m in DIRECTIVE.finditer(page.read_text()):
            obj = _resolve(m.group(1))
            out.append(obj)
            options = m.group(2)
            listed = re.search(r"members: \[([^\]]*)\]", options)
            if listed:
                out += [getattr(obj, n.strip()) for n in listed.group(1).split(",")]
            elif "members: false" not in options and hasattr(obj, "__all__"):
                out += [getattr(obj, n) for n in obj.__all__]
    return out


def _missing(module: Any, names: list[str], documented: list[Any]) -> list[str]:
    return [n for n in names if not any(getattr(module, n) is d for d in documented)]


def test_every_public_name_has_a_reference_entry() -> None:
    import tensorstore_py.checkpoint as checkpoint
    import tensorstore_py.dask as tsp_dask
    import tensorstore_py.kvstore as kvstore

    documented = _documented()
    modules = {"checkpoint", "dask", "errors"}  # pages of their own
    assert _missing(tsp, [n for n in tsp.__all__ if n not in modules], documented) == []
    # the lazily loaded names, by their definitions (importing tensorstore_py.zarr_store binds
    # the submodule over the tsp.zarr_store function)
    lazy = {n: _resolve(f"{m}.{a}") for n, (m, a) in tsp._LAZY.items() if n not in modules}
    assert [n for n, obj in lazy.items() if not any(obj is d for d in documented)] == []
    assert _missing(checkpoint, list(checkpoint.__all__), documented) == []
    assert _missing(kvstore, list(kvstore.__all__), documented) == []
    assert _missing(tsp_dask, list(tsp_dask.__all__), documented) == []


def test_the_command_reference_lists_every_command() -> None:
    import argparse
    import sys

    sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
    try:
        from cli_reference import cli_reference  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(ROOT / "docs" / "_hooks"))
    from tensorstore_py.cli import build_parser

    text = cli_reference()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sub.choices
    for name in sub.choices:
        assert f"## tensorstore-py {name}\n" in text
        assert f"usage: tensorstore-py {name}" in text
