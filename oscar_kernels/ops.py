"""Launchers for oscar's INT2 Triton kernels: input checks, allocation, grids, configs.

The public API, re-exported from :mod:`oscar_kernels.write_ops` (allocation, quantize-on-write),
:mod:`oscar_kernels.decode_ops` (configs, plans, decode attention), :mod:`oscar_kernels.tier_ops` (the vLLM
backend's BF16 tier copies), :mod:`oscar_kernels.write_step_ops` (its fused decode-step write),
:mod:`oscar_kernels.rotate_ops` (its K/V rotation) and :mod:`oscar_kernels.history_ops`
(its prefill's dequantized history); all check their arguments with :mod:`oscar_kernels.launch_checks`.

Entry points (all tensors on one CUDA device; on CPU only under ``TRITON_INTERPRET=1``, for tests):

- :func:`quantize_write` — rotate, centre, clip, quantize, pack rows ``[N, H_kv, D]`` into a paged cache.
- :func:`quantize_rows` — the same, returning :class:`~oscar_kernels.reference.QuantizedRows` for
  ``x [B, H_kv, T, D]`` (the Triton twin of ``reference.quantize_rows``).
- :func:`decode_attention` — one decode step over paged INT2 history + BF16 sink and recent tiers;
  :class:`DecodePlan` — the same, validated once and launched many times (CUDA graphs, benchmarks).
- :func:`decode_attention_contiguous` — the same over a non-paged cache (``codes [B, H_kv, T, D/4]``).
- :func:`tier_write` / :func:`tier_gather` — scatter new K/V rows into per-sequence BF16 sink and ring tiers /
  gather a decode batch's tier rows, centred, in the order the decode reads them (one launch each); with a
  :class:`GatherQuery` the gather also rotates the decode's queries (``DecodePlan(q_rot=...)`` then skips its own).
- :func:`write_step` — a decode step's K pages, V pages and BF16 tiers of one layer in one launch (the three
  launches of ``quantize_write`` for K and V and ``tier_write``, fused; the same bytes).
- :func:`rotate_kv` — ``(float32(x) @ R).to(dtype)`` for a step's K and V rows ``[N, H_kv, D]`` (strided rows,
  shared or per-head rotations), one launch for both; with a :class:`GatherQuery` the decode's queries too.
- :func:`dequantize_history` — a range of one sequence's paged INT2 keys and values, dequantized through its
  block-table row with the mean added back, into activation-dtype ``[T, H_kv, D]`` buffers (one launch; the vLLM
  backend's prefill chunks attend to it).
- :class:`RopeMean` — the position-dependent key mean (``quant.key_mean: rope``) for :func:`decode_attention`'s
  ``rope_mean``: stage 1 adds the term ``q·RoPE_p(m_pre)`` of every INT2 key itself, from :func:`position_table`.
- :class:`TierIndex` — for :class:`DecodePlan`'s ``tier_index``: stage 1 reads the BF16 tiers where the vLLM
  backend keeps them (through row and ring indices, centred as the gather would), so no gather launch.
- :class:`LowPlane` — INT4 keys' low plane (``quant.int4_keys``) for :func:`decode_attention`'s ``low_plane``:
  stage 1 reads it beside the pages' high plane, in the same tile.
- :func:`rope_mean_logits` — the same term as a ``[B, H_q, L]`` tensor (one float32 GEMM over the table) for the
  kernel's ``logit_bias``: the unfused form, kept to measure the fused one against.
- :func:`new_paged_cache`, :func:`make_workspace`, :class:`DecodeConfig`, :func:`default_config`,
  :func:`default_num_splits`.

Paged layout: keys ``codes uint8 [num_pages, H_kv, P, D/4]`` (quarter-packed rows), values
``codes uint8 [num_pages, H_kv, P/R·D, R/4]`` (token quads in rows of ``R = min(P, 64)`` tokens),
``scale``/``zero`` ``md [num_pages, H_kv, P, D/G]``,
``block_table int32 [B, max_pages]``; token ``t`` of sequence ``b`` lives in page ``block_table[b, t // P]``
at offset ``t % P``. Every launch is CUDA-graph safe: lengths are device tensors, the split count is fixed
by static shapes, nothing syncs with the host (except the opt-in ``OSCAR_KERNEL_DEBUG=1`` range check).
"""

from __future__ import annotations

from oscar_kernels.decode_ops import (
    LAST_LAUNCH,
    TIER_PARTS,
    ConfigError,
    DecodeConfig,
    DecodePlan,
    LowPlane,
    RopeMean,
    TierIndex,
    decode_attention,
    decode_attention_contiguous,
    default_config,
    default_num_splits,
    make_workspace,
    query_scale,
)
from oscar_kernels.history_ops import dequantize_history
from oscar_kernels.rope_ops import position_table, rope_mean_logits
from oscar_kernels.rotate_ops import rotate_kv
from oscar_kernels.tier_ops import GatherQuery, query_rows, tier_gather, tier_write
from oscar_kernels.write_ops import LAYOUTS, new_paged_cache, quantize_rows, quantize_write
from oscar_kernels.write_step_ops import write_step

__all__ = [
    "LAST_LAUNCH",
    "LAYOUTS",
    "TIER_PARTS",
    "ConfigError",
    "DecodeConfig",
    "DecodePlan",
    "GatherQuery",
    "LowPlane",
    "RopeMean",
    "TierIndex",
    "decode_attention",
    "decode_attention_contiguous",
    "dequantize_history",
    "default_config",
    "default_num_splits",
    "make_workspace",
    "new_paged_cache",
    "quantize_rows",
    "query_rows",
    "query_scale",
    "quantize_write",
    "position_table",
    "rope_mean_logits",
    "rotate_kv",
    "tier_gather",
    "tier_write",
    "write_step",
]
