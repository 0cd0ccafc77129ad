"""Launcher of the fused decode-step write (``write_step``), re-exported by :mod:`oscar_kernels.ops`: a layer's
key pages, value pages and BF16 tiers written by one launch instead of three (``quantize_write`` for K, for V, and
``tier_write``), with the same checks and the same bytes.
"""

from __future__ import annotations

import math

import torch

from oscar_kernels.launch_checks import next_pow2, triton_module
from oscar_kernels.reference import QuantizedRows
from oscar_kernels.tier_ops import check_tier_write
from oscar_kernels.write_ops import write_args

Tiers = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # sink_k, sink_v, ring_k, ring_v


def write_step(k: torch.Tensor, v: torch.Tensor, k_cache: QuantizedRows, v_cache: QuantizedRows,
               slots: torch.Tensor, tiers: Tiers, sink_row: torch.Tensor, sink_pos: torch.Tensor,
               ring_row: torch.Tensor, ring_slot: torch.Tensor, *, k_mean: torch.Tensor | None = None,
               v_mean: torch.Tensor | None = None, k_clip: float = 0.0, v_clip: float = 0.0,
               exclusive_words: bool = False, k_low: torch.Tensor | None = None, clip_method: str = "sort",
               tq_update: str = "xor", num_warps: int = 4, pdl: bool = False) -> None:
    """In one launch, what these three do (same bytes):

    - ``quantize_write(k, k_cache, slots, mean=k_mean, clip_ratio=k_clip, layout="rows", low_plane=k_low)``;
    - ``quantize_write(v, v_cache, slots, mean=v_mean, clip_ratio=v_clip, layout="token_quads",
      exclusive_words=exclusive_words)``;
    - ``tier_write(k, v, *tiers, sink_row, sink_pos, ring_row, ring_slot)``.

    ``k``/``v`` are the step's rotated rows ``[N, H_kv, D]`` (the tiers' dtype); the arguments are those calls'
    and are checked as they check them (``clip_method`` / ``tq_update`` as :func:`quantize_write`'s). Grid
    ``(cdiv(N, BLOCK_T), H_kv, 3)``, ``BLOCK_T`` from N as :func:`quantize_write`'s; CUDA-graph safe. ``pdl``
    (CUDA): the launch lets a programmatic dependent launch after it (the decode's stage 1 with an
    ``ops.TierIndex``) start at once; that kernel must wait for this one before reading what it writes.
    """
    kw = write_args(k, k_cache, slots, mean=k_mean, clip_ratio=k_clip, layout="rows", clip_method=clip_method,
                    tq_update=tq_update, low_plane=k_low)
    vw = write_args(v, v_cache, slots, mean=v_mean, clip_ratio=v_clip, layout="token_quads", clip_method=clip_method,
                    tq_update=tq_update)
    sink_k, sink_v, ring_k, ring_v = tiers
    check_tier_write(k, v, sink_k, sink_v, ring_k, ring_v, sink_row, sink_pos, ring_row, ring_slot)
    if kw.page_size != vw.page_size:
        raise ValueError(f"k_cache, v_cache: pages of {kw.page_size} and {vw.page_size} tokens; one page size serves "
                         "both")
    if kw.n == 0:
        return
    n, h_kv, d = kw.n, kw.h_kv, kw.d
    triton_module("write_step")._write_step_kernel[(math.ceil(n / kw.block_t), h_kv, 3)](
        *kw.pointers(), *vw.pointers(), kw.low_plane if kw.low_plane is not None else kw.codes,
        sink_k, sink_v, sink_k.stride(0), sink_k.stride(1), sink_k.stride(2),
        ring_k, ring_v, ring_k.stride(0), ring_k.stride(1), ring_k.stride(2),
        sink_row, sink_pos, ring_row, ring_slot,
        D=d, KG=kw.g, VG=vw.g, BLOCK_T=kw.block_t, BLOCK_D=next_pow2(d), K_HAS_MU=kw.mu is not None,
        V_HAS_MU=vw.mu is not None, K_CLIP=kw.clip_idx >= 0, V_CLIP=vw.clip_idx >= 0, K_INT4=kw.low_plane is not None,
        CLIP_SORT=clip_method == "sort", TQ_XOR=tq_update == "xor", EXCLUSIVE_WORDS=exclusive_words,
        PDL=pdl and k.device.type == "cuda", num_warps=num_warps,
    )
