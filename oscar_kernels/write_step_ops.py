"""Launcher of the fused decode-step write (``write_step``), re-exported by :mod:`oscar_kernels.ops`: a layer's
key pages, value pages and BF16 tiers written by one launch instead of three (``quantize_write`` for K, for V, and
``tier_write``), with the same checks and the same bytes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from oscar_kernels.launch_checks import ACT, bad_tensor, check_tensor, next_pow2, triton_module
from oscar_kernels.reference import QuantizedRows
from oscar_kernels.tier_ops import check_tier_write
from oscar_kernels.write_ops import write_args

Tiers = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # sink_k, sink_v, ring_k, ring_v
Q_BLOCK = 32  # output columns per query-rotation job (``_rotate_q_kernel``'s BLOCK_E)


class StepQuery(NamedTuple):
    """The decode's query rotation as a job of :func:`write_step`: ``out = (q @ R_K) · qk_scale`` in ``q``'s dtype,
    bit for bit what ``DecodePlan``'s first launch writes (pass ``out`` to ``DecodePlan(q_rot=out)``). ``q``
    ``[B, H_q, D]`` post-RoPE queries of the step's first ``B`` tokens (its decodes), ``qk_scale``
    :func:`oscar_kernels.decode_ops.query_scale`."""

    q: torch.Tensor
    out: torch.Tensor
    qk_scale: float


class StepRopeMean(NamedTuple):
    """Keys centred by position (``quant.key_mean: rope``) in :func:`write_step`: the key of row ``i`` is centred by
    ``scaling · (table[positions[i]] @ matrix[h])`` = ``RoPE_p(m_pre)·R_K`` up to float32 rounding, computed in the
    launch. ``positions`` int64 ``[N]`` (clamped into the table: padding rows may hold anything); ``table`` float32 ``[P, D]``
    (``rope_ops.position_table``); ``matrix`` float32 ``[H_kv, D, D]`` (``rope_ops.rope_mean_matrix``)."""

    positions: torch.Tensor
    table: torch.Tensor
    matrix: torch.Tensor
    scaling: float


def _check_rope(rm: StepRopeMean, n: int, h_kv: int, d: int, dev: torch.device) -> None:
    check_tensor("rope_mean.positions", rm.positions, f"int64 [{n}]", (n,), (torch.int64,), dev)
    check_tensor("rope_mean.table", rm.table, f"float32 [positions, {d}]", (None, d), (torch.float32,), dev)
    check_tensor("rope_mean.matrix", rm.matrix, f"float32 [{h_kv}, {d}, {d}]", (h_kv, d, d), (torch.float32,), dev)
    if not (rm.table.is_contiguous() and rm.matrix.is_contiguous()):
        raise ValueError("rope_mean: table and matrix must be contiguous")


def _check_query(sq: StepQuery, n: int, h_kv: int, d: int) -> tuple[int, int]:
    """(B, GROUP) of a valid :class:`StepQuery` for a step of ``n`` tokens; raises ValueError naming the tensor."""
    q, out = sq.q, sq.out
    if q.dim() != 3 or q.dtype not in ACT or q.stride(-1) != 1 or q.shape[-1] != d or q.shape[0] > n or \
            q.shape[1] % h_kv or q.device != out.device:
        raise bad_tensor("query.q", q, f"bf16/fp16 [B <= {n}, H_q, {d}] with H_q a multiple of {h_kv} and a "
                         "contiguous last dim")
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise bad_tensor("query.out", out, f"{q.dtype} {list(q.shape)} with a contiguous last dim")
    return int(q.shape[0]), int(q.shape[1]) // h_kv


def write_step(k: torch.Tensor, v: torch.Tensor, k_cache: QuantizedRows, v_cache: QuantizedRows,
               slots: torch.Tensor, tiers: Tiers, sink_row: torch.Tensor, sink_pos: torch.Tensor,
               ring_row: torch.Tensor, ring_slot: torch.Tensor, *, k_mean: torch.Tensor | None = None,
               v_mean: torch.Tensor | None = None, k_clip: float = 0.0, v_clip: float = 0.0,
               exclusive_words: bool = False, k_low: torch.Tensor | None = None, clip_method: str = "sort",
               tq_update: str = "xor", rotation: tuple[torch.Tensor, torch.Tensor] | None = None,
               query: StepQuery | None = None, rope_mean: StepRopeMean | None = None, num_warps: int = 4) -> None:
    """In one launch, what these three do (same bytes):

    - ``quantize_write(k, k_cache, slots, mean=k_mean, clip_ratio=k_clip, layout="rows", low_plane=k_low)``;
    - ``quantize_write(v, v_cache, slots, mean=v_mean, clip_ratio=v_clip, layout="token_quads",
      exclusive_words=exclusive_words)``;
    - ``tier_write(k, v, *tiers, sink_row, sink_pos, ring_row, ring_slot)``.

    ``k``/``v`` are the step's rotated rows ``[N, H_kv, D]`` (the tiers' dtype); the arguments are those calls'
    and are checked as they check them (``clip_method`` / ``tq_update`` as :func:`quantize_write`'s). Grid
    ``(cdiv(N, BLOCK_T), H_kv, 3)``, ``BLOCK_T`` from N as :func:`quantize_write`'s; CUDA-graph safe.

    ``rotation=(R_K, R_V)`` (float32 ``[D, D]`` or ``[H_kv, D, D]``): ``k``/``v`` are the unrotated rows and the
    launch first does what ``rotate_kv(k, v, R_K, R_V, dtype=k.dtype)`` does (the same bytes follow; 16-row tiles,
    ``tl.dot``'s minimum). ``query`` (needs ``rotation``): also the decode's query rotation (:class:`StepQuery`),
    ``H_q / H_kv`` query heads per KV head, ``D / 32`` more jobs per tile. Grid ``(cdiv(N, BLOCK_T), H_kv, 3 +
    (D / 32 with a query))``. ``rope_mean`` (needs ``rotation``): the keys' position-dependent mean
    (:class:`StepRopeMean`), subtracted after ``k_mean`` if that is given too.
    """
    if query is not None and rotation is None:
        raise ValueError("query: the query rotation rides on a write_step with rotation=(R_K, R_V) (it uses R_K)")
    if rope_mean is not None and rotation is None:
        raise ValueError("rope_mean: the in-launch key mean needs rotation=(R_K, R_V) (16-row tiles for its product)")
    rk, rv = rotation if rotation is not None else (None, None)
    bt = 16 if rotation is not None else None
    kw = write_args(k, k_cache, slots, rotation=rk, mean=k_mean, clip_ratio=k_clip, block_t=bt, layout="rows",
                    clip_method=clip_method, tq_update=tq_update, low_plane=k_low)
    vw = write_args(v, v_cache, slots, rotation=rv, mean=v_mean, clip_ratio=v_clip, block_t=bt, layout="token_quads",
                    clip_method=clip_method, tq_update=tq_update)
    sink_k, sink_v, ring_k, ring_v = tiers
    check_tier_write(k, v, sink_k, sink_v, ring_k, ring_v, sink_row, sink_pos, ring_row, ring_slot)
    if kw.page_size != vw.page_size:
        raise ValueError(f"k_cache, v_cache: pages of {kw.page_size} and {vw.page_size} tokens; one page size serves "
                         "both")
    if rotation is not None and k.dtype != sink_k.dtype:
        raise bad_tensor("k", k, f"{sink_k.dtype} rows (the tiers' dtype: the rotated rows are rounded to it)")
    n, h_kv, d = kw.n, kw.h_kv, kw.d
    nq, group = _check_query(query, n, h_kv, d) if query is not None else (0, 1)
    if rope_mean is not None:
        _check_rope(rope_mean, n, h_kv, d, k.device)
    if n == 0:
        return
    ks, vs = kw.scale, vw.scale
    q, qo = (query.q, query.out) if query is not None else (k, k)
    q_jobs = d // Q_BLOCK if query is not None else 0
    triton_module("write_step")._write_step_kernel[(math.ceil(n / kw.block_t), h_kv, 3 + q_jobs)](
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        kw.r if kw.r is not None else k, kw.r_stride, vw.r if vw.r is not None else v, vw.r_stride,
        q, q.stride(0), q.stride(1), qo, qo.stride(0), qo.stride(1), nq, query.qk_scale if query is not None else 1.0,
        *((rope_mean.positions, rope_mean.table, rope_mean.matrix, float(rope_mean.scaling),
           int(rope_mean.table.shape[0])) if rope_mean is not None else (slots, k, k, 1.0, 1)),
        slots,
        kw.mu if kw.mu is not None else k, kw.mu_row, kw.mu_stride,
        vw.mu if vw.mu is not None else v, vw.mu_row, vw.mu_stride,
        kw.codes, *kw.code_strides(), ks, kw.zero, ks.stride(0), ks.stride(1), ks.stride(2),
        kw.low_plane if kw.low_plane is not None else kw.codes,
        vw.codes, *vw.code_strides(), vs, vw.zero, vs.stride(0), vs.stride(1), vs.stride(2),
        sink_k, sink_v, sink_k.stride(0), sink_k.stride(1), sink_k.stride(2),
        ring_k, ring_v, ring_k.stride(0), ring_k.stride(1), ring_k.stride(2),
        sink_row, sink_pos, ring_row, ring_slot,
        n, kw.page_size, vw.row, kw.clip_idx, vw.clip_idx,
        D=d, KG=kw.g, VG=vw.g, BLOCK_T=kw.block_t, BLOCK_D=next_pow2(d), K_HAS_MU=kw.mu is not None,
        V_HAS_MU=vw.mu is not None, K_CLIP=kw.clip_idx >= 0, V_CLIP=vw.clip_idx >= 0, K_INT4=kw.low_plane is not None,
        CLIP_SORT=clip_method == "sort", TQ_XOR=tq_update == "xor", EXCLUSIVE_WORDS=exclusive_words,
        HAS_R=rotation is not None, Q_JOBS=q_jobs, GROUP=group, GP=max(16, next_pow2(group)),
        K_ROPE=rope_mean is not None, num_warps=num_warps,
    )
