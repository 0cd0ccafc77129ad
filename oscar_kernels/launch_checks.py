"""Argument checks shared by the launchers in :mod:`oscar_kernels.ops` (write and decode): each names the tensor,
its shape, dtype and device (never its data) in a ``ValueError``; plus the lazy import of the Triton modules.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

ACT = (torch.bfloat16, torch.float16)  # activation dtypes the kernels take
META = (torch.bfloat16, torch.float16, torch.float32)  # scale/zero dtypes
META_WRITE = (*META, torch.uint8)  # and formula 10's bytes (the write and decode kernels; not the history kernel)


def triton_module(name: str) -> Any:
    """Import the Triton module ``oscar_kernels.NAME`` lazily (``TRITON_INTERPRET`` is read when it is first
    imported)."""
    return importlib.import_module(f"oscar_kernels.{name}")


def triton_modules() -> tuple[Any, Any]:
    """The pack and decode Triton modules (:func:`triton_module`)."""
    return triton_module("int2_pack"), triton_module("int2_decode")


def bad_tensor(name: str, t: torch.Tensor, expected: str) -> ValueError:
    return ValueError(f"{name}: expected {expected}, got {t.dtype} {tuple(t.shape)} on {t.device}")


def check_tensor(name: str, t: Any, expected: str, shape: tuple[int | None, ...], dtypes: tuple[torch.dtype, ...],
           device: torch.device) -> None:
    """Raise ValueError naming ``t`` (shape, dtype, device; never data) unless it matches."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor {expected}, got {type(t).__name__}")
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape, strict=True))
    if not ok or t.dtype not in dtypes or t.device != device:
        raise bad_tensor(name, t, f"{expected} on {device}")


def check_rows(name: str, t: Any, expected: str, shape: tuple[int | None, ...], dtypes: tuple[torch.dtype, ...],
               device: torch.device) -> None:
    """:func:`check_tensor`, and a contiguous last dim (rows of ``D`` elements; other strides free)."""
    check_tensor(name, t, expected, shape, dtypes, device)
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: expected a contiguous last dim, got strides {t.stride()}")


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``): Triton block sizes."""
    return 1 << max(int(n) - 1, 0).bit_length()


def triton_dtype(dtype: torch.dtype) -> Any:
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def rotation_arg(name: str, r: torch.Tensor | None, h_kv: int, d: int, dev: torch.device) -> tuple[torch.Tensor | None, int]:
    """Rotation ``[D, D]`` or ``[H_kv, D, D]`` float32 -> (contiguous tensor, head stride)."""
    if r is None:
        return None, 0
    shape: tuple[int, ...] = (d, d) if r.dim() == 2 else (h_kv, d, d)
    check_tensor(name, r, f"float32 {list(shape)}", shape, (torch.float32,), dev)
    r = r.contiguous()
    return r, (0 if r.dim() == 2 else d * d)


def mean_arg(name: str, m: torch.Tensor | None, h_kv: int, d: int, dev: torch.device) -> tuple[torch.Tensor | None, int]:
    if m is None:
        return None, 0
    shape: tuple[int, ...] = (d,) if m.dim() == 1 else (h_kv, d)
    check_tensor(name, m, f"float32 {list(shape)}", shape, (torch.float32,), dev)
    m = m.contiguous()
    return m, (0 if m.dim() == 1 else d)
