"""The package as users get it: a non-editable install holds every module of the
source tree (the package-dir mapping lists packages by hand, so a new sub-package
left out of pyproject.toml would be missing from every wheel) and works on its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# source folder -> where it lands in the installed package (pyproject's package-dir)
FOLDERS = {"core": "tensorstore_py/core", "kvstore": "tensorstore_py/kvstore",
           "drivers": "tensorstore_py/drivers", "tensorstore_py": "tensorstore_py"}

_USE = r"""
import sys
import numpy as np
import tensorstore_py as tsp
target, data = sys.argv[2], sys.argv[3]  # argv[1]: this code
assert tsp.__file__.startswith(target), tsp.__file__
for driver, extra in (("zarr3", {"compression": "zstd"}), ("zarr", {"compression": "blosc"}), ("n5", {}),
                      ("neuroglancer_precomputed", {})):
    url = f"file://{data}/{driver}/"
    a = tsp.open(url, driver=driver, create=True, shape=(64, 64, 8, 1), chunks=(16, 16, 8, 1), dtype="uint8",
                 **extra).result()
    want = np.random.default_rng(0).integers(0, 255, (64, 64, 8, 1), dtype=np.uint8)
    a.write(want).result()
    assert (tsp.open(url).result()[3:50, 7, 2:5, 0].read().result() == want[3:50, 7, 2:5, 0]).all(), driver
print("ok")
"""


def test_a_non_editable_install_ships_every_module_and_works(tmp_path: Path) -> None:
    # from a copy of the sources alone: a build/ folder left in a checkout by an
    # earlier build would hand setuptools modules that pyproject.toml does not list
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "__pycache__", ".mypy_cache", ".venv", "tests", "benchmarks", "docs"))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--target", str(target), str(src)], check=True, capture_output=True, timeout=300)
    missing = []
    for folder, installed in FOLDERS.items():
        for src in (ROOT / folder).rglob("*.py"):
            rel = src.relative_to(ROOT / folder)
            if "__pycache__" not in rel.parts and not (target / installed / rel).is_file():
                missing.append(f"{folder}/{rel}")
    assert missing == [], f"modules missing from the installed package: {missing}"
    assert (target / "tensorstore_py" / "py.typed").is_file()
    # the install alone (not the checkout, not an editable install's import hook) runs
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); "
                          + "exec(compile(sys.argv[1], 'use', 'exec'))", _USE, str(target), str(tmp_path / "d")],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
