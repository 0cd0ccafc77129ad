"""Write-side launchers: empty paged INT2 storage and quantize-on-write (``int2_pack``), re-exported by
:mod:`oscar_kernels.ops` (its docstring has the paged layout).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

from oscar_kernels.launch_checks import (
    ACT,
    META_WRITE,
    bad_tensor,
    check_tensor,
    mean_arg,
    next_pow2,
    rotation_arg,
    triton_modules,
)
from oscar_kernels.reference import TOKEN_QUAD_ROW, QuantizedRows, token_quad_row

LAYOUTS = ("rows", "token_quads")
CLIP_METHODS = ("select", "sort")
TQ_UPDATES = ("xor", "and_or")


def new_paged_cache(num_pages: int, h_kv: int, page_size: int, d: int, group_size: int | None = None,
                    meta_dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
                    layout: str = "rows") -> QuantizedRows:
    """Empty paged INT2 storage; scale/zero ``[num_pages, H_kv, P, D/G]``.

    ``layout="rows"`` (keys): codes ``uint8 [num_pages, H_kv, P, D/4]``, quarter packing.
    ``layout="token_quads"`` (values, what the decode kernel reads): codes ``uint8 [num_pages, H_kv, P/R·D, R/4]``
    with ``R = min(P, 64)`` tokens per row (``reference.pack_token_quads``; ``P % 16 == 0`` so that every row is
    whole 32-bit words, and pages above 64 tokens are multiples of 64: each 64-token tile is ``D`` rows of 16
    contiguous bytes).
    """
    g = d if group_size is None else group_size
    if layout == "token_quads":
        if page_size % 16 or (page_size > TOKEN_QUAD_ROW and page_size % TOKEN_QUAD_ROW):
            raise ValueError(f"page_size: token quads need a multiple of 16 (of 64 above 64), got {page_size}")
        row = token_quad_row(page_size)
        codes = torch.zeros(num_pages, h_kv, page_size // row * d, row // 4, dtype=torch.uint8, device=device)
    elif layout == "rows":
        codes = torch.zeros(num_pages, h_kv, page_size, d // 4, dtype=torch.uint8, device=device)
    else:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    scale = torch.zeros(num_pages, h_kv, page_size, d // g, dtype=meta_dtype, device=device)
    return QuantizedRows(codes, scale, torch.zeros_like(scale))


def auto_block_t(n: int, rotation: bool) -> int:
    """Default rows per program of :func:`quantize_write`: next power of two of ``n``, at most 16 (no masked rows
    to clip and quantize at decode batch sizes); 16 when the kernel rotates (``tl.dot`` needs 16 rows)."""
    if rotation:
        return 16
    return min(16, next_pow2(n))


class WriteArgs(NamedTuple):
    """One checked :func:`quantize_write` call's kernel arguments (``int2_pack.quantize_write_tile``'s, by name)."""

    n: int
    h_kv: int
    d: int
    x: torch.Tensor
    slots: torch.Tensor
    r: torch.Tensor | None
    r_stride: int
    mu: torch.Tensor | None
    mu_row: int
    mu_stride: int
    codes: torch.Tensor  # the int32 view for token quads
    scale: torch.Tensor
    zero: torch.Tensor
    page_size: int
    row: int  # token quads: tokens per row R; rows: 0
    clip_idx: int
    g: int
    block_t: int
    tq: bool
    low_plane: torch.Tensor | None

    def pointers(self) -> tuple[object, ...]:
        """``x_ptr .. clip_idx`` of ``_quantize_write_kernel``, in order."""
        c, sc = self.codes, self.scale
        return (self.x, self.x.stride(0), self.x.stride(1), self.r if self.r is not None else self.x, self.r_stride,
                self.mu if self.mu is not None else self.x, self.mu_row, self.mu_stride, self.slots, c,
                *self.code_strides(), sc, self.zero, sc.stride(0), sc.stride(1), sc.stride(2), self.n,
                self.page_size, self.row, self.clip_idx)

    def code_strides(self) -> tuple[int, int, int]:
        """Byte strides (page, head, row) of the codes (the uint8 array's, also for the int32 view)."""
        s = self.codes.stride()
        k = 4 if self.tq else 1
        return s[0] * k, s[1] * k, s[2] * k


def quantize_write(x: torch.Tensor, cache: QuantizedRows, slots: torch.Tensor, *,
                   rotation: torch.Tensor | None = None, mean: torch.Tensor | None = None,
                   clip_ratio: float = 0.0, block_t: int | None = None, num_warps: int = 4, layout: str = "rows",
                   clip_method: str = "sort", exclusive_words: bool = False, tq_update: str = "xor",
                   low_plane: torch.Tensor | None = None) -> None:
    """Quantize rows and scatter them into a paged cache, in one launch for all tokens and KV heads.

    Args:
        x: ``[N, H_kv, D]`` bf16/fp16/fp32 post-RoPE keys or values (last dim contiguous).
        cache: paged storage from :func:`new_paged_cache` with the same ``layout`` (``"rows"``:
            ``packed [pages, H_kv, P, D/4]``; ``"token_quads"``: ``packed [pages, H_kv, P/R·D, R/4]``, R = min(P, 64)).
        slots: int64 ``[N]``: destination ``page * P + offset``; negative = skip the row.
        rotation: float32 ``[D, D]`` or ``[H_kv, D, D]``; mean: float32 ``[D]``, ``[H_kv, D]`` or one per row
            ``[N, H_kv, D]`` (rotated space; per row: the position-dependent key mean, ``quant.key_mean: rope``).
        clip_ratio: as in ``reference.clip_rows`` (threshold ``sort(|y|)[min(int(ratio·D), D-1)]``; ``<= 0``: off).
        block_t: rows per program, a power of two; default from ``N``: the next power of two of ``N`` capped at 16
            (16 with a rotation: ``tl.dot`` needs it). ``N`` is static per captured CUDA-graph size, so the choice
            (and the compiled variant) is fixed inside a graph: graph-safe.
        clip_method: ``"sort"`` (default: ``tl.sort`` of ``|y|``) or ``"select"`` (a bitwise select on the float32
            bit patterns, no sort); both give exactly the sorted element, bitwise equal results. On an H200 the sort
            is faster (2.9 vs 5.4 µs for one K row; docs/results/write-bench-h200.json).
        exclusive_words: ``layout="token_quads"`` only (ignored for rows): the caller promises that no two rows of
            this call share a 32-bit token-quad word (16 consecutive tokens of one page and channel; e.g. a
            decode-only step, one new token per sequence, sequences on distinct pages); each row then updates its
            words by a plain load / modify / store, no atomics. A broken promise loses bits of the other rows.
        tq_update: token quads without ``exclusive_words`` (rows of one word written by several programs):
            ``"xor"`` (default: a load and one ``atomic_xor`` per word) or ``"and_or"`` (``atomic_and`` +
            ``atomic_or``); bitwise the same bytes (:mod:`oscar_kernels.int2_pack` has the argument).

        low_plane: INT4 keys (formula 9, ``reference.quantize_rows_int4``; ``layout="rows"``, no clip): a uint8 array
            with ``cache.packed``'s shape and strides that takes each row's low plane at its codes' offsets, while
            ``cache`` takes the high plane and the scale and zero (the vLLM backend's pages).

    Every non-negative slot may appear at most once per call (the token-quad updates assume one writer per token).
    """
    w = write_args(x, cache, slots, rotation=rotation, mean=mean, clip_ratio=clip_ratio, block_t=block_t,
                   layout=layout, clip_method=clip_method, tq_update=tq_update, low_plane=low_plane)
    if w.n == 0:
        return
    pack, _ = triton_modules()
    pack._quantize_write_kernel[(math.ceil(w.n / w.block_t), w.h_kv)](
        *w.pointers(), D=w.d, G=w.g, BLOCK_T=w.block_t, HAS_R=w.r is not None, HAS_MU=w.mu is not None,
        DO_CLIP=w.clip_idx >= 0, TQ=w.tq, CLIP_SORT=clip_method == "sort", TQ_XOR=tq_update == "xor",
        EXCLUSIVE_WORDS=w.tq and exclusive_words, lo_ptr=w.low_plane if w.low_plane is not None else w.codes,
        INT4=w.low_plane is not None, num_warps=num_warps,
    )


def write_args(x: torch.Tensor, cache: QuantizedRows, slots: torch.Tensor, *, rotation: torch.Tensor | None = None,
               mean: torch.Tensor | None = None, clip_ratio: float = 0.0, block_t: int | None = None,
               layout: str = "rows", clip_method: str = "sort", tq_update: str = "xor",
               low_plane: torch.Tensor | None = None) -> WriteArgs:
    """:func:`quantize_write`'s checks (a bad argument raises, naming it) and its kernel arguments."""
    dev = x.device
    if x.dim() != 3 or x.dtype not in (*ACT, torch.float32) or x.shape[-1] % 16 or x.stride(-1) != 1:
        raise bad_tensor("x", x, "bf16/fp16/fp32 [N, H_kv, D] with D % 16 == 0 and contiguous rows")
    n, h_kv, d = x.shape
    codes, scale, zero = cache.packed, cache.scale, cache.zero
    tq = layout == "token_quads"
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if clip_method not in CLIP_METHODS:
        raise ValueError(f"clip_method: expected one of {CLIP_METHODS}, got {clip_method!r}")
    if tq_update not in TQ_UPDATES:
        raise ValueError(f"tq_update: expected one of {TQ_UPDATES}, got {tq_update!r}")
    if tq:
        check_tensor("cache.packed", codes, f"uint8 [pages, {h_kv}, P/R·{d}, R/4]", (None, h_kv, None, None), (torch.uint8,),
               dev)
        row = 4 * int(codes.shape[-1])
        blocks = int(codes.shape[2]) // d
        if int(codes.shape[2]) % d or blocks < 1 or (blocks > 1 and row != TOKEN_QUAD_ROW):
            raise bad_tensor("cache.packed", codes, f"token-quad pages [pages, {h_kv}, P/R·{d}, R/4] (R = min(P, 64))")
        if codes.shape[-1] % 4 or codes.stride(-1) != 1 or codes.stride(-2) != codes.shape[-1] or \
                codes.stride(1) % 4 or codes.stride(0) % 4 or codes.storage_offset() % 4:
            raise bad_tensor("cache.packed", codes, "contiguous token-quad pages of whole 32-bit words (P % 16 == 0)")
        page_size = blocks * row
    else:
        check_tensor("cache.packed", codes, f"uint8 [pages, {h_kv}, P, {d // 4}]", (None, h_kv, None, d // 4),
               (torch.uint8,), dev)
        page_size = int(codes.shape[2])
    ng = int(scale.shape[-1]) if scale.dim() == 4 else 0
    if ng <= 0 or d % ng or (d // ng) & (d // ng - 1):
        raise bad_tensor("cache.scale", scale, f"[pages, {h_kv}, P, D/G] with G a power of two dividing {d}")
    check_tensor("cache.scale", scale, f"[pages, {h_kv}, P, {ng}]", (codes.shape[0], h_kv, page_size, ng), META_WRITE,
                 dev)
    check_tensor("cache.zero", zero, f"{scale.dtype} {list(scale.shape)}", tuple(scale.shape), (scale.dtype,), dev)
    if zero.stride() != scale.stride() or codes.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError("cache: scale and zero must share strides and have contiguous last dims")
    check_tensor("slots", slots, f"int64 [{n}]", (n,), (torch.int64,), dev)
    r, r_stride = rotation_arg("rotation", rotation, h_kv, d, dev)
    mu: torch.Tensor | None
    if mean is not None and mean.dim() == 3:  # one mean per row
        check_tensor("mean", mean, f"float32 [{n}, {h_kv}, {d}]", (n, h_kv, d), (torch.float32,), dev)
        mu, mu_stride, mu_row = mean.contiguous(), d, h_kv * d
    else:
        mu, mu_stride = mean_arg("mean", mean, h_kv, d, dev)
        mu_row = 0
    if low_plane is not None:
        if tq or clip_ratio > 0:
            raise ValueError("low_plane: INT4 keys are written in the rows layout and without a clip")
        if low_plane.dtype != torch.uint8 or low_plane.device != codes.device or low_plane.shape != codes.shape \
                or low_plane.stride() != codes.stride():
            raise bad_tensor("low_plane", low_plane, f"uint8 {list(codes.shape)} with cache.packed's strides "
                             f"{codes.stride()}")
    if os.environ.get("OSCAR_KERNEL_DEBUG") == "1" and n and int(slots.max()) >= codes.shape[0] * page_size:
        raise ValueError(f"slots: max slot {int(slots.max())} >= pages*P = {codes.shape[0] * page_size}")
    clip_idx = min(int(clip_ratio * d), d - 1) if clip_ratio > 0 else -1
    bt = auto_block_t(n, r is not None) if block_t is None else block_t
    if bt < 1 or bt & (bt - 1) or (r is not None and bt < 16):
        raise ValueError(f"block_t: expected a power of two (>= 16 with a rotation), got {bt}")
    return WriteArgs(n, h_kv, d, x, slots, r, r_stride, mu, mu_row, mu_stride, codes.view(torch.int32) if tq else codes,
                     scale, zero, page_size, row if tq else 0, clip_idx, d // ng, bt, tq, low_plane)


def quantize_rows(x: torch.Tensor, rotation: torch.Tensor | None = None, mean: torch.Tensor | None = None,
                  clip_ratio: float = 0.0, group_size: int | None = None,
                  meta_dtype: torch.dtype = torch.bfloat16) -> QuantizedRows:
    """Triton twin of ``reference.quantize_rows`` for ``x [B, H_kv, T, D]`` -> packed ``[B, H_kv, T, D/4]``."""
    if x.dim() != 4:
        raise bad_tensor("x", x, "[B, H_kv, T, D]")
    b, h_kv, t, d = x.shape
    rows = x.permute(0, 2, 1, 3).reshape(b * t, h_kv, d).contiguous()
    cache = new_paged_cache(b * t, h_kv, 1, d, group_size, meta_dtype, x.device)
    slots = torch.arange(b * t, dtype=torch.int64, device=x.device)
    quantize_write(rows, cache, slots, rotation=rotation, mean=mean, clip_ratio=clip_ratio)

    def back(u: torch.Tensor) -> torch.Tensor:
        return u.reshape(b, t, h_kv, -1).permute(0, 2, 1, 3).contiguous()

    return QuantizedRows(back(cache.packed), back(cache.scale), back(cache.zero))
