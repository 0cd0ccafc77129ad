"""oscar's on-disk cache: content hashes of model files and converted (GGUF -> safetensors) models.

Layout under :func:`cache_dir` (``$OSCAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/oscar``, else ``~/.cache/oscar``)::

    hashes.json                      {abs path: {size, mtime_ns, sha256}}: skip re-hashing unchanged files
    converted/<sha256 of source>/    config.json, model.safetensors, tokenizer files, generation_config.json,
                                     oscar-cache.json (written last: the entry is complete only with it)

A converted entry is built in a temporary sibling directory and renamed into place, so readers never see a
half-written entry. Every use re-checks it (sizes and sha256 of every file against ``oscar-cache.json``); an
entry that fails the check is deleted and rebuilt, never trusted. (A file rewritten in place gets a new
mtime and is re-hashed; only corruption that keeps size and mtime would go unseen.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oscar_cli._files import atomic_write_json, sha256_file

logger = logging.getLogger(__name__)

CACHE_ENV = "OSCAR_CACHE_DIR"
ENTRY_FORMAT = 1
META_NAME = "oscar-cache.json"


def cache_dir() -> Path:
    """The root of oscar's cache (created on demand by the writers, not here)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "oscar"


def file_sha256(path: Path, *, use_index: bool = True) -> str:
    """sha256 (hex) of a file's bytes, remembered in ``hashes.json`` keyed by (path, size, mtime_ns).

    A file whose size or modification time changed is hashed again. An unreadable or corrupt index is
    ignored (and rewritten), never fatal.
    """
    path = path.resolve()
    st = path.stat()
    key = str(path)
    index: dict[str, Any] = {}
    if use_index:
        index = _read_index()
        hit = index.get(key)
        if isinstance(hit, dict) and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
            sha = hit.get("sha256")
            if isinstance(sha, str) and len(sha) == 64:
                return sha
    if st.st_size >= 256 << 20:
        logger.info("hashing %s (%.1f GB) for its identity; unchanged files are not hashed again", path, st.st_size / 1e9)
    t0 = time.perf_counter()
    sha = sha256_file(path)
    logger.debug("sha256 %s (%d bytes) in %.2f s", path, st.st_size, time.perf_counter() - t0)
    if use_index:
        index[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
        _write_index(index)
    return sha


def _read_index() -> dict[str, Any]:
    try:
        loaded = json.loads((cache_dir() / "hashes.json").read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _write_index(index: dict[str, Any]) -> None:
    index_path = cache_dir() / "hashes.json"
    index = {k: v for k, v in index.items() if os.path.exists(k)}  # forget deleted files
    try:
        atomic_write_json(index_path, index, sort_keys=True)
    except OSError as exc:  # a read-only cache must not stop a load
        logger.debug("could not update %s: %s", index_path, exc)


def _remember_entry(entry: Path, files: dict[str, Any], mtimes: dict[str, int]) -> None:
    """Put the sha256s just computed for a published entry's files into ``hashes.json``, so the next load's
    :func:`check_entry` finds them there instead of hashing the files again (~0.35 s for the embedded model).
    ``mtimes``: each file's mtime_ns from before it was hashed (the rename into place keeps it); a file whose
    size or mtime differs now is left out (and hashed when checked)."""
    index = _read_index()
    for name, rec in files.items():
        p = (entry / name).resolve()
        try:
            st = p.stat()
        except OSError:
            continue
        if st.st_size == rec["size"] and st.st_mtime_ns == mtimes.get(name):
            index[str(p)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": rec["sha256"]}
    _write_index(index)


def tree_sha256(root: Path) -> str:
    """One sha256 for a model directory: over sorted ``"<relative path>\\0<file sha256>\\n"`` lines.

    Counts every regular file except hidden ones (any path part starting with ``.``) and ``*.md`` (model
    cards), so editing a README does not change a model's identity but any weight, config or tokenizer
    change does.
    """
    lines = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or p.suffix.lower() == ".md" or not p.is_file():
            continue
        lines.append(f"{rel.as_posix()}\0{file_sha256(p)}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def converted_path(source_sha256: str) -> Path:
    """Where the converted copy of the source with this sha256 lives (it may not exist yet)."""
    return cache_dir() / "converted" / source_sha256


def check_entry(entry: Path, source_sha256: str) -> str | None:
    """Why the converted entry at ``entry`` cannot be used, or None when it is complete and intact.

    Checks: ``oscar-cache.json`` parses, has this format and source sha, and lists files that all exist with
    the recorded size and sha256. Hashes go through the ``hashes.json`` index, so a file is re-hashed (about
    0.5 s for the embedded model's 538 MB) only when its size or modification time changed since last time.
    """
    meta_path = entry / META_NAME
    if not entry.is_dir():
        return "missing"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        return f"unreadable {META_NAME} ({type(exc).__name__})"
    if not isinstance(meta, dict) or meta.get("format") != ENTRY_FORMAT:
        return f"{META_NAME} has another format"
    if meta.get("source_sha256") != source_sha256:
        return "made from another source file"
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        return f"{META_NAME} lists no files"
    for name, rec in files.items():
        p = entry / name
        if not p.is_file():
            return f"{name} is missing"
        if not isinstance(rec, dict) or p.stat().st_size != rec.get("size"):
            return f"{name} has the wrong size"
        if file_sha256(p) != rec.get("sha256"):  # re-hashed whenever size or mtime changed
            return f"{name} has the wrong sha256"
    return None


def remove_entry(entry: Path) -> None:
    """Delete a converted entry (ignoring one that is already gone)."""
    shutil.rmtree(entry, ignore_errors=True)


def build_entry(source_sha256: str, build: Callable[[Path], None], info: dict[str, Any] | None = None) -> Path:
    """Build the converted entry for ``source_sha256`` with ``build(tmp_dir)`` and publish it atomically.

    ``build`` writes the model files into the empty directory it is given. The files are hashed into
    ``oscar-cache.json`` (written last), then the directory is renamed into place. If another process
    published a valid entry meanwhile, that one is kept. Returns the entry's path.
    """
    final = converted_path(source_sha256)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{source_sha256[:16]}-", suffix=".tmp"))
    try:
        build(tmp)
        stats = {p.name: p.stat() for p in sorted(tmp.iterdir()) if p.is_file() and p.name != META_NAME}
        files = {name: {"size": st.st_size, "sha256": sha256_file(tmp / name)} for name, st in stats.items()}
        if not files:
            raise RuntimeError("conversion wrote no files")
        meta = {"format": ENTRY_FORMAT, "source_sha256": source_sha256, "files": files, **(info or {})}
        atomic_write_json(tmp / META_NAME, meta, sort_keys=True)
        if final.exists():
            if check_entry(final, source_sha256) is None:
                logger.info("another process converted %s first; using its copy", source_sha256[:12])
                return final
            remove_entry(final)
        try:
            os.replace(tmp, final)
        except OSError:  # lost a race: another process renamed its entry into place first
            if check_entry(final, source_sha256) is not None:
                raise
            return final
        _remember_entry(final, files, {name: st.st_mtime_ns for name, st in stats.items()})
        return final
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def ensure_entry(
    source_sha256: str, build: Callable[[Path], None], info: dict[str, Any] | None = None
) -> tuple[Path, bool]:
    """Return ``(entry path, built_now)``: the valid converted entry, rebuilding a bad one with ``build``."""
    entry = converted_path(source_sha256)
    problem = check_entry(entry, source_sha256)
    if problem is None:
        return entry, False
    if problem != "missing":
        logger.warning("conversion cache %s is unusable (%s): rebuilding it", entry, problem)
        remove_entry(entry)
    return build_entry(source_sha256, build, info), True
