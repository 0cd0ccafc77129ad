"""File helpers every writer and verifier shares: streamed sha256 and atomic writes.

An atomic write goes to a hidden temp file beside the target (created with ``O_EXCL`` by :mod:`tempfile`) and
is renamed over it only when complete, so a reader sees the old file or the new one, never half of one; an
error or Ctrl-C removes the temp file. Written files get the usual mode of a new file (``0o666`` minus the
umask), not ``mkstemp``'s private ``0o600``.

Example::

    atomic_write_json(out / "summary.json", result)
    with atomic_output(out / "heatmap.png") as tmp:   # for writers that want a path (matplotlib, safetensors)
        fig.savefig(tmp)
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def sha256_file(path: Path | str) -> str:
    """Hex sha256 of a file's bytes (streamed)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def new_file_mode() -> int:
    """The mode ``open(path, "w")`` would give a new file here: ``0o666`` minus the process umask."""
    return 0o666 & ~_umask()


def new_folder_mode() -> int:
    """The mode ``mkdir`` would give a new folder here: ``0o777`` minus the process umask."""
    return 0o777 & ~_umask()


@contextmanager
def atomic_output(path: Path | str) -> Iterator[Path]:
    """Yield a temp path beside ``path`` (same suffix); rename it onto ``path`` when the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".tmp{path.suffix}")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file + fsync + rename)."""
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: Path | str, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path | str, obj: Any, *, sort_keys: bool = False) -> None:
    """Write ``obj`` as indented JSON (plus a final newline) to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")
