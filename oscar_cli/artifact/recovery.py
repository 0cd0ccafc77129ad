"""Repair what an interrupted artifact write left behind, under the same lock the writers take.

``write_artifact`` writes into ``.<name>.tmp-<pid>-*`` and, with ``--overwrite``, moves the old artifact to
``.<name>.old-*`` for the moment of the swap. :func:`recover` (called by every write and every local load of
that path) puts an ``.old`` folder back when the artifact itself is missing (a crash between the two renames),
removes it when the artifact is present, and removes temp folders of processes that are gone.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def locked(parent: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the folder ``parent`` (held by one writer or repairer at a time)."""
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def recover(path: Path | str) -> None:
    """Repair what a crash during ``--overwrite`` left beside ``path``: put the newest ``.<name>.old-*`` back when
    ``path`` is missing, remove the others (and stale temp folders of dead processes). Best effort: a folder that
    cannot be written is left as it is."""
    path = Path(path)
    parent = path.parent
    try:
        olds = sorted(parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime)
        temps = list(parent.glob(f".{path.name}.tmp-*"))
    except OSError:
        return
    if not olds and not temps:
        return
    try:
        with locked(parent):
            olds = [p for p in olds if p.exists()]
            if olds and not (path.exists() or path.is_symlink()):
                os.replace(olds.pop(), path)
            for p in olds:
                shutil.rmtree(p, ignore_errors=True)
            _clean_stale_temps(parent, path.name)
    except OSError:
        return


def _clean_stale_temps(parent: Path, name: str) -> None:
    """Remove leftovers of interrupted writes of ``name`` (``.<name>.tmp-<pid>-*`` of processes that are gone)."""
    for p in parent.glob(f".{name}.tmp-*"):
        try:
            pid = int(p.name[len(f".{name}.tmp-"):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
