"""What every ``oscar bench`` record carries about where it ran: the GPU, library versions, the git state of the
checkout and a content hash of the kernel sources."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Any

import torch

from oscar_cli.errors import KernelUnavailableError


def require_cuda() -> torch.device:
    """The CUDA device, or KernelUnavailableError naming what is missing."""
    if not torch.cuda.is_available():
        raise KernelUnavailableError(
            "oscar bench needs a CUDA GPU: torch.cuda.is_available() is False on this machine",
            hint="run it on a machine with an NVIDIA GPU and a CUDA build of torch; nothing was measured",
        )
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - triton ships with CUDA torch
        raise KernelUnavailableError("oscar bench needs triton", hint="pip install triton") from exc
    return torch.device("cuda")


def environment() -> dict[str, Any]:
    """GPU name, versions, git sha and a content hash of the kernel sources recorded with every result (the sha
    names a commit; the hash says which kernels ran even from an uncommitted or copied tree)."""
    import triton

    props = torch.cuda.get_device_properties(0)
    sha, dirty = git_state()
    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "git_sha": sha,
        "git_dirty": dirty,  # tracked files differ from git_sha (e.g. a copied tree with a stale .git): trust the digest
        "kernels_sha256": kernels_digest(),
    }


def git_state() -> tuple[str | None, bool | None]:
    """(HEAD sha, whether tracked files differ from it) of the checkout holding this package; (None, None) outside
    git."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=here)
        except (OSError, subprocess.SubprocessError):
            return None
        return p.stdout if p.returncode == 0 else None

    sha = (git("rev-parse", "HEAD") or "").strip() or None
    status = git("status", "--porcelain", "--untracked-files=no") if sha else None
    return sha, (None if status is None else bool(status.strip()))


def kernels_digest() -> str | None:
    """sha256 over the kernel package's ``.py`` files (names and contents, sorted by name)."""
    try:
        import oscar_kernels
    except ImportError:
        return None
    h = hashlib.sha256()
    for f in sorted(Path(oscar_kernels.__file__).resolve().parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()
