"""Packaging: every subpackage is listed, the wheel ships ``oscar_kernels`` (never a top-level ``kernels``),
the recipes and ``py.typed`` as data, and the ``oscar`` console script.

``kernels`` is the import name of Hugging Face's PyPI package ``kernels``, which transformers (>= 5.25) imports; a
wheel that installed a top-level ``kernels/``, or a ``kernels/`` folder at the repository root (what ``python -c``
run there puts first on ``sys.path``), would shadow it: the folder is ``oscar_kernels/``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Repository folder -> import name (pyproject [tool.setuptools.package-dir]).
RENAMED = {"recipes": "oscar_cli.recipes"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _import_name(pkg_dir: Path) -> str:
    rel = pkg_dir.relative_to(ROOT).parts
    head = RENAMED.get(rel[0], rel[0])
    return ".".join([head, *rel[1:]])


@pytest.mark.unit
def test_every_subpackage_is_listed_in_pyproject() -> None:
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {
        _import_name(init.parent)
        for top in ("oscar_cli", "oscar_kernels", "recipes")
        for init in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    missing = sorted(found - listed)
    assert not missing, f"add to pyproject.toml [tool.setuptools] packages: {missing}"
    assert "kernels" not in listed
    assert "oscar_kernels" not in _pyproject()["tool"]["setuptools"]["package-dir"]


@pytest.mark.unit
def test_wheel_contents(tmp_path: Path) -> None:
    src = tmp_path / "src"  # build from a copy: setuptools writes build/ and *.egg-info next to the sources
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(".venv", ".git", "artifacts", "build", "dist", "*.egg-info", "__pycache__",
                                      ".*_cache", "runs", "tests"),
    )  # fmt: skip
    out = tmp_path / "wheel"
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = out.glob("oscar_kv-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert "kernels" not in tops and "recipes" not in tops and "tests" not in tops
    assert {"oscar_cli", "oscar_kernels"} <= tops
    for required in ("oscar_kernels/reference.py", "oscar_cli/py.typed", "oscar_cli/model/load.py", "oscar_cli/main.py",
                     "oscar_cli/eval/haystack/alice.txt", "oscar_cli/eval/haystack/botchan.txt"):
        assert required in names, required
    shipped_recipes = {n for n in names if n.startswith("oscar_cli/recipes/") and n.endswith(".yaml")}
    assert {f"oscar_cli/recipes/{p.name}" for p in (ROOT / "recipes").glob("*.yaml")} == shipped_recipes
    (entry,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "oscar = oscar_cli.main:main" in zipfile.ZipFile(wheel).read(entry).decode()


@pytest.mark.unit
@pytest.mark.parametrize("where", ["outside", "repository_root"])
def test_installed_import_names(tmp_path: Path, where: str) -> None:
    """In a clean interpreter outside the repository (as a user has it) and in one started at the repository root
    (``python -c`` there puts the root first on ``sys.path``), ``oscar_kernels`` imports and the name ``kernels``
    is either absent or Hugging Face's package, never a folder of this repository."""
    code = (
        "import importlib.util, json, oscar_kernels.reference as r; s = importlib.util.find_spec('kernels'); "
        "print(json.dumps([r.__file__, s.origin if s else None]))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cwd = tmp_path if where == "outside" else ROOT
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ref_file, kernels_origin = json.loads(proc.stdout)
    assert Path(ref_file).parts[-2:] == ("oscar_kernels", "reference.py")
    # Hugging Face's kernels (a dependency of transformers >= 5.25) may be installed in a .venv inside the checkout
    origin = None if kernels_origin is None else Path(kernels_origin).resolve()
    assert origin is None or "site-packages" in origin.parts or not origin.is_relative_to(ROOT), kernels_origin
