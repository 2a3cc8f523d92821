"""The type check of `.ci/typecheck` catches what it is meant to: a planted type error in a
public function of a strict module fails mypy run with the project's own [tool.mypy] settings."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("mypy")

ROOT = Path(__file__).resolve().parent.parent


def _tree(tmp_path: Path, ranges_source: str) -> Path:
    """A package laid out as installed: tensorstore_py.core with errors.py and ranges.py."""
    core = tmp_path / "tree" / "tensorstore_py" / "core"
    core.mkdir(parents=True)
    (core.parent / "__init__.py").write_text("")
    (core.parent / "py.typed").write_text("")
    (core / "__init__.py").write_text("")
    shutil.copy(ROOT / "core" / "errors.py", core / "errors.py")
    (core / "ranges.py").write_text(ranges_source)
    return core.parent.parent


def _mypy(tree: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(cache), "--no-error-summary", "-p", "tensorstore_py"],
        cwd=tree, capture_output=True, text=True, timeout=300,
    )


def test_mypy_fails_on_a_planted_type_error_in_a_public_function(tmp_path: Path) -> None:
    source = (ROOT / "core" / "ranges.py").read_text()
    clean = _mypy(_tree(tmp_path / "clean", source), tmp_path / "cache")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert clean.stderr == ""  # the settings load without a warning (conflicting overrides)

    # a wrong return type in coalesce(), and an unannotated public function (strict)
    assert source.count("    return groups\n") == 1
    planted = source.replace("    return groups\n", "    return len(groups)\n")
    planted += "\n\ndef planted_unannotated(n):\n    return n\n"
    out = _mypy(_tree(tmp_path / "planted", planted), tmp_path / "cache")
    assert out.returncode == 1, out.stdout + out.stderr
    errors = sorted(line for line in out.stdout.splitlines() if ": error:" in line)
    assert len(errors) == 2, out.stdout
    assert errors[0].startswith("tensorstore_py/core/ranges.py:")
    assert 'Incompatible return value type (got "int", expected "list[tuple[ByteRange, list[int]]]")' in out.stdout
    assert "Function is missing a type annotation" in out.stdout


def _lz4block_tree(tmp_path: Path, lz4block_source: str) -> Path:
    """A package laid out as installed, holding the n5 lz4 framing and the core modules it imports."""
    pkg = tmp_path / "tree" / "tensorstore_py"
    for sub in ("core", "drivers/n5"):
        (pkg / sub).mkdir(parents=True)
    for init in ("", "core", "drivers", "drivers/n5"):
        (pkg / init / "__init__.py").write_text("")
    (pkg / "py.typed").write_text("")
    for name in ("errors.py", "ranges.py"):
        shutil.copy(ROOT / "core" / name, pkg / "core" / name)
    (pkg / "drivers" / "n5" / "lz4block.py").write_text(lz4block_source)
    return pkg.parent


def test_mypy_fails_on_a_planted_type_error_outside_the_strict_modules(tmp_path: Path) -> None:
    """The default checks reach the modules that are not strict: the n5 lz4 framing (once
    skipped while it did not check clean) passes, and a public function calling it with
    a str fails."""
    source = (ROOT / "drivers" / "n5" / "lz4block.py").read_text()
    clean = _mypy(_lz4block_tree(tmp_path / "clean", source), tmp_path / "cache")
    assert clean.returncode == 0, clean.stdout + clean.stderr

    planted = source + '\n\ndef planted_checksum() -> int:\n    return frame_checksum("not bytes")\n'
    out = _mypy(_lz4block_tree(tmp_path / "planted", planted), tmp_path / "cache")
    assert out.returncode == 1, out.stdout + out.stderr
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, out.stdout
    assert errors[0].startswith("tensorstore_py/drivers/n5/lz4block.py:")
    assert 'Argument 1 to "frame_checksum" has incompatible type "str"' in errors[0]


def test_mypy_skips_no_module() -> None:
    """Every module checks clean: none is given ``ignore_errors`` (nor an error code disabled)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    sections = [config, *config.get("overrides", [])]
    skipped = [s.get("module", "<all>") for s in sections if s.get("ignore_errors")]
    assert not skipped, f"mypy skips {skipped}"
    assert not any(s.get("disable_error_code") for s in sections)
