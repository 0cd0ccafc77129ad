"""The test suite's own rules: test modules import helpers, never each other, and change no environment at import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent
MODULES = sorted(TESTS.glob("test_*.py"))


def _imported_modules(tree: ast.Module) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _module_level_env_writes(tree: ast.Module) -> list[int]:
    """Line numbers of ``os.environ[...] = ``, ``os.environ.setdefault/update/pop(...)``, ``os.putenv`` outside
    functions and classes (``if`` blocks at module level included)."""
    lines = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        stmt = todo.pop()
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(stmt):
            target = node.func if isinstance(node, ast.Call) else None
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Subscript) and ast.unparse(t.value) == "os.environ" for t in targets):
                    lines.append(node.lineno)
            elif isinstance(target, ast.Attribute) and (
                ast.unparse(target.value) == "os.environ" or ast.unparse(target) == "os.putenv"
            ) and target.attr in ("setdefault", "update", "pop", "putenv", "__setitem__"):
                lines.append(node.lineno)
    return sorted(lines)


def test_the_layout_checks_find_what_they_look_for() -> None:
    tree = ast.parse("import os\nif True:\n    os.environ.setdefault('X', '1')\nos.environ['Y'] = '2'\n"
                     "def f():\n    os.environ['Z'] = '3'\nfrom test_cache import x\n")
    assert _module_level_env_writes(tree) == [3, 4]
    assert "test_cache" in _imported_modules(tree)


@pytest.mark.parametrize("path", MODULES, ids=[p.name for p in MODULES])
def test_module_imports_no_other_test_module_and_leaves_the_environment_alone(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    others = [m for m in _imported_modules(tree) if m.split(".")[0].startswith("test_") or m in ("conftest",)]
    assert others == [], f"{path.name} imports test modules {others}: move shared code to tests/helpers"
    assert _module_level_env_writes(tree) == [], f"{path.name} changes os.environ at import (use monkeypatch)"
