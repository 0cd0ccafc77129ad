"""Bitwise tensor comparison for the kernel tests: same dtype, shape and bit pattern (``-0.0`` vs ``0.0`` and NaN
payloads count), the first mismatch named."""

from __future__ import annotations

import torch


def bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s elements as integers of the same width (on the CPU)."""
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]).cpu()


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, f"{name}: {got.dtype} {tuple(got.shape)} vs " \
        f"{want.dtype} {tuple(want.shape)}"
    bad = (bits(got) != bits(want)).nonzero()
    assert bad.numel() == 0, f"{name}: {bad.shape[0]} mismatches, first at {bad[0].tolist()}"
