"""The software and device a result was made with: recorded in artifact manifests and evaluation summaries.

Example::

    environment()                                   # {"oscar": "0.1.0", "torch": "2.13.0", ..., "device": "cpu"}
    environment(device="cuda:0", dtype="bfloat16")  # + "device_name": "NVIDIA H200", "dtype": "bfloat16"
"""

from __future__ import annotations

import platform
from importlib import metadata
from typing import Any

import torch


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def software_versions() -> dict[str, str | None]:
    """Versions of oscar, Python, torch (and its CUDA), transformers and triton (None when not installed)."""
    from oscar_cli._version import __version__

    return {
        "oscar": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
    }


def environment(device: str | torch.device | None = None, dtype: str | torch.dtype | None = None) -> dict[str, Any]:
    """:func:`software_versions` plus the device (default: the first CUDA GPU, else ``cpu``) and, when given, the
    dtype. A CUDA device also gets its ``device_name``."""
    env: dict[str, Any] = dict(software_versions())
    if device is None:
        dev = torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    else:
        dev = torch.device(device)
    env["device"] = str(dev)
    if dev.type == "cuda" and torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name(dev)
    if dtype is not None:
        env["dtype"] = str(dtype).removeprefix("torch.")
    return env
