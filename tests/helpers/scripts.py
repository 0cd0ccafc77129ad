"""Import a file under scripts/ as a module (the scripts are not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str) -> Any:
    """``scripts/NAME.py`` as a fresh module object (registered in ``sys.modules`` while it runs: dataclasses
    look their module up there), with ``scripts/`` on ``sys.path`` as ``python scripts/NAME.py`` has it (the
    scripts import their shared helpers, e.g. ``_window``, from there)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
