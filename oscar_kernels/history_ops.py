"""Launcher of the paged INT2 history dequantization (``history``), re-exported by :mod:`oscar_kernels.ops`: one launch
writes a range of one sequence's keys and values, dequantized through its block-table row, mean added back, in the
activation dtype (what a vLLM prefill chunk attends to; ``oscar_cli.vllm.core.PagedInt2Layer.history``).

No host sync (the block table is read on the device; its entries are not checked). Not meant for CUDA graphs: the
grid follows the range's length.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from oscar_kernels.launch_checks import (
    ACT,
    META,
    bad_tensor,
    check_rows,
    check_tensor,
    mean_arg,
    next_pow2,
    triton_module,
)
from oscar_kernels.reference import QuantizedRows, token_quad_row

HISTORY_DTYPES = (*ACT, torch.float32)
# Triton contracts ``zero + code * scale`` into an FMA by default (one rounding instead of torch's two: float32 scales
# would change bits); the kernel is compiled without contraction
COMPILE_OPTIONS: dict[str, Any] = {"enable_fp_fusion": False}


def _meta(name: str, pages: QuantizedRows, shape: tuple[int, int, int], d: int, dev: torch.device) -> int:
    """Check ``name``'s scale/zero ``[pages, H_kv, P, D/G]`` (one dtype, shared strides); returns ``G``."""
    s, z = pages.scale, pages.zero
    check_tensor(f"{name}.scale", s, f"bf16/fp16/fp32/uint8 [{shape[0]}, {shape[1]}, {shape[2]}, D/G]",
                 (*shape, None), (*META, torch.uint8), dev)
    ng = int(s.shape[3])
    if ng == 0 or d % ng:
        raise bad_tensor(f"{name}.scale", s, f"[..., D/G] with D/G dividing D = {d}")
    check_tensor(f"{name}.zero", z, f"{s.dtype} {list(s.shape)} (as {name}.scale)", tuple(s.shape), (s.dtype,), dev)
    if z.stride() != s.stride():
        raise ValueError(f"{name}.zero: expected {name}.scale's strides {s.stride()}, got {z.stride()}")
    return d // ng


def dequantize_history(k_pages: QuantizedRows, v_pages: QuantizedRows, blocks: torch.Tensor, start: int,
                       k_out: torch.Tensor, v_out: torch.Tensor, k_mean: torch.Tensor, v_mean: torch.Tensor, *,
                       block_t: int = 32, num_warps: int = 4, k_low: torch.Tensor | None = None) -> None:
    """Positions ``start .. start + T`` of one sequence, dequantized into ``k_out``/``v_out`` ``[T, H_kv, D]``:
    ``out[t, h, i] = (float32(zero) + float32(code)·float32(scale) + mean[h, i]).to(out.dtype)`` (the product and
    the sums rounded one by one, left to right, then once to the output dtype, to nearest even), in one launch.

    Args:
        k_pages: keys in quarter-packed rows: ``packed`` uint8 ``[pages, H_kv, P, D/4]``, ``scale``/``zero``
            ``[pages, H_kv, P, D/G]`` (bf16 / fp16 / fp32, shared strides).
        v_pages: values in token quads: ``packed`` uint8 ``[pages', H_kv, P/R·D, R/4]`` (``R = min(P, 64)``; ``P`` a
            multiple of 4, of 64 above 64), ``scale``/``zero`` ``[pages', H_kv, P, D/G_V]``.
        blocks: the sequence's block-table row, int32 / int64 ``[max_pages]``: position ``p`` lives in page
            ``blocks[p // P]`` at offset ``p % P`` (entries in range, unchecked).
        start: the first position, a multiple of ``P`` (``start / P + ⌈T/P⌉ <= max_pages``).
        k_out, v_out: ``[T, H_kv, D]`` bf16 / fp16 / fp32 (one dtype), last dims contiguous.
        k_mean, v_mean: float32 ``[D]`` (all heads) or ``[H_kv, D]``.
        k_low: INT4 keys' low plane (formula 9): uint8 with ``k_pages.packed``'s shape and strides; the keys are
            then ``zero + (4·hi + lo)·(scale/4)`` (``reference.dequantize_int4_planes``).
    """
    if not isinstance(k_out, torch.Tensor):
        raise ValueError(f"k_out: expected a torch.Tensor [T, H_kv, D], got {type(k_out).__name__}")
    dev = k_out.device
    if k_out.dim() != 3 or k_out.dtype not in HISTORY_DTYPES or k_out.shape[-1] % 4 or k_out.shape[-1] == 0:
        raise bad_tensor("k_out", k_out, "bf16/fp16/fp32 [T, H_kv, D] with D a positive multiple of 4")
    n, h_kv, d = (int(s) for s in k_out.shape)
    check_rows("k_out", k_out, f"{k_out.dtype} [T, H_kv, D]", (n, h_kv, d), (k_out.dtype,), dev)
    check_rows("v_out", v_out, f"{k_out.dtype} [{n}, {h_kv}, {d}] (as k_out)", (n, h_kv, d), (k_out.dtype,), dev)
    kc = k_pages.packed
    check_tensor("k_pages.packed", kc, f"uint8 [pages, {h_kv}, P, {d // 4}]", (None, h_kv, None, d // 4),
                 (torch.uint8,), dev)
    num_k, p = int(kc.shape[0]), int(kc.shape[2])
    if p == 0 or p % 4 or (p > 64 and p % 64) or kc.stride(-1) != 1:
        raise bad_tensor("k_pages.packed", kc, "P a multiple of 4 (of 64 above 64) and a contiguous last dim")
    g_k = _meta("k_pages", k_pages, (num_k, h_kv, p), d, dev)
    if k_low is not None and (not isinstance(k_low, torch.Tensor) or k_low.dtype != torch.uint8
                              or k_low.device != dev or k_low.shape != kc.shape or k_low.stride() != kc.stride()):
        raise bad_tensor("k_low", k_low, f"uint8 {list(kc.shape)} with k_pages.packed's strides {kc.stride()}")
    r = token_quad_row(p)
    vc = v_pages.packed
    check_tensor("v_pages.packed", vc, f"uint8 [pages, {h_kv}, {p // r * d}, {r // 4}] (token quads of pages of {p})",
                 (None, h_kv, p // r * d, r // 4), (torch.uint8,), dev)
    if vc.stride(-1) != 1:
        raise ValueError(f"v_pages.packed: expected a contiguous last dim, got strides {vc.stride()}")
    g_v = _meta("v_pages", v_pages, (int(vc.shape[0]), h_kv, p), d, dev)
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 1 or blocks.dtype not in (torch.int32, torch.int64) \
            or blocks.device != dev or blocks.stride(0) != 1:
        raise ValueError(f"blocks: expected a contiguous int32/int64 [max_pages] on {dev}, got "
                         + (f"{blocks.dtype} {tuple(blocks.shape)} on {blocks.device}" if isinstance(blocks, torch.Tensor)
                            else type(blocks).__name__))
    if isinstance(start, bool) or not isinstance(start, int) or start < 0 or start % p:
        raise ValueError(f"start: expected a non-negative multiple of the page size {p}, got {start!r}")
    pages_needed = start // p + math.ceil(n / p)
    if pages_needed > blocks.shape[0]:
        raise ValueError(f"blocks: positions {start} .. {start + n} need {pages_needed} pages, the row has "
                         f"{blocks.shape[0]}")
    km, km_stride = mean_arg("k_mean", k_mean, h_kv, d, dev)
    vm, vm_stride = mean_arg("v_mean", v_mean, h_kv, d, dev)
    if km is None or vm is None:
        raise ValueError("k_mean, v_mean: expected float32 means, got None")
    if block_t <= 0 or block_t & (block_t - 1):
        raise ValueError(f"block_t: expected a power of two, got {block_t}")
    if n == 0:
        return
    ks, vs = k_pages.scale, v_pages.scale
    triton_module("history")._history_kernel[(math.ceil(n / block_t), h_kv)](
        kc, kc.stride(0), kc.stride(1), kc.stride(2), ks, k_pages.zero, *ks.stride(),
        vc, vc.stride(0), vc.stride(1), vc.stride(2), vs, v_pages.zero, *vs.stride(),
        blocks, start // p, km, km_stride, vm, vm_stride,
        k_out, k_out.stride(0), k_out.stride(1), v_out, v_out.stride(0), v_out.stride(1), n,
        P=p, R=r, D=d, BLOCK_D=next_pow2(d), G_K=g_k, NG_K=d // g_k, G_V=g_v, NG_V=d // g_v,
        BLOCK_T=block_t, META8=ks.dtype == torch.uint8, lo_ptr=kc if k_low is None else k_low,
        HAS_LO=k_low is not None, num_warps=num_warps, **COMPILE_OPTIONS)
