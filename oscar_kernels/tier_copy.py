"""Triton copies of the BF16 sink / recent tiers of the vLLM backend (``oscar_cli.vllm.core``).

Only ``@triton.jit`` code lives here; launchers and checks are in :mod:`oscar_kernels.tier_ops`.

Tiers are ``[rows + 1, H_kv, T, D]`` (activation dtype; the last row is scratch for padding tokens):

- ``_tier_write_kernel`` scatters the new tokens' rotated K and V rows ``[N, H_kv, D]`` into the sink at
  ``(sink_row, sink_pos)`` and into the ring at ``(ring_row, ring_slot)`` (four stores per token and head, as the
  four index assignments it replaces; tokens that go nowhere point at the scratch row, slot 0, possibly several at
  once: whichever lands last is kept, and nothing reads it);
- ``_tier_gather_kernel`` builds the decode's four inputs ``[B, H_kv, S or R, D]``: the batch's sink rows and its
  ring rows in the order of ``ring_index`` (oldest first), each ``float32(x) - mean[h]`` rounded to the output
  dtype (round to nearest even: bitwise the torch expression ``(x.float() - mean).to(dtype)``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from oscar_kernels.int2_decode import rotate_q_tile


@triton.jit
def _tier_write_kernel(
    k_ptr,  # [N, H_kv, D] rotated keys (the tiers' dtype)
    stride_kn,
    stride_kh,
    v_ptr,  # [N, H_kv, D] rotated values
    stride_vn,
    stride_vh,
    sink_k_ptr,  # [rows + 1, H_kv, S, D]
    sink_v_ptr,  # same strides as sink_k
    stride_sr,
    stride_sh,
    stride_st,
    ring_k_ptr,  # [rows + 1, H_kv, R, D]
    ring_v_ptr,  # same strides as ring_k
    stride_rr,
    stride_rh,
    stride_rt,
    sink_row_ptr,  # int64 [N]
    sink_pos_ptr,  # int64 [N]
    ring_row_ptr,  # int64 [N]
    ring_slot_ptr,  # int64 [N]
    n_tokens,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """``BLOCK_T`` tokens of one KV head. Grid: ``(cdiv(N, BLOCK_T), H_kv)``."""
    tier_write_tile(tl.program_id(0), tl.program_id(1), k_ptr, stride_kn, stride_kh, v_ptr, stride_vn, stride_vh,
                    sink_k_ptr, sink_v_ptr, stride_sr, stride_sh, stride_st, ring_k_ptr, ring_v_ptr, stride_rr,
                    stride_rh, stride_rt, sink_row_ptr, sink_pos_ptr, ring_row_ptr, ring_slot_ptr, n_tokens,
                    D=D, BLOCK_D=BLOCK_D, BLOCK_T=BLOCK_T)


@triton.jit
def tier_write_tile(pid, h, k_ptr, stride_kn, stride_kh, v_ptr, stride_vn, stride_vh, sink_k_ptr, sink_v_ptr, stride_sr,
                    stride_sh, stride_st, ring_k_ptr, ring_v_ptr, stride_rr, stride_rh, stride_rt, sink_row_ptr,
                    sink_pos_ptr, ring_row_ptr, ring_slot_ptr, n_tokens, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_T: tl.constexpr):
    """Tokens ``pid * BLOCK_T ..`` of KV head ``h`` into the tiers: the body of ``_tier_write_kernel`` and of the
    fused decode-step write (:mod:`oscar_kernels.write_step`); arguments as the kernel's."""
    tok = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    ok = tok < n_tokens
    m = ok[:, None] & (cols < D)[None, :]
    t64 = tok[:, None].to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kn + h * stride_kh + cols[None, :], mask=m)
    v = tl.load(v_ptr + t64 * stride_vn + h * stride_vh + cols[None, :], mask=m)
    sr = tl.load(sink_row_ptr + tok, mask=ok, other=0)
    sp = tl.load(sink_pos_ptr + tok, mask=ok, other=0)
    rr = tl.load(ring_row_ptr + tok, mask=ok, other=0)
    rs = tl.load(ring_slot_ptr + tok, mask=ok, other=0)
    s_off = (sr * stride_sr + h * stride_sh + sp * stride_st)[:, None] + cols[None, :]
    r_off = (rr * stride_rr + h * stride_rh + rs * stride_rt)[:, None] + cols[None, :]
    tl.store(sink_k_ptr + s_off, k, mask=m)
    tl.store(sink_v_ptr + s_off, v, mask=m)
    tl.store(ring_k_ptr + r_off, k, mask=m)
    tl.store(ring_v_ptr + r_off, v, mask=m)


@triton.jit
def _centred_copy(src_k, src_v, src_off, dst_k, dst_v, dst_off, m, k_mean, v_mean):
    """``dst[off] = rn(float32(src[off]) - mean)`` for K and V (``*_off`` ``[BLOCK_T, BLOCK_D]``, mask ``m``)."""
    k = tl.load(src_k + src_off, mask=m, other=0.0).to(tl.float32)
    v = tl.load(src_v + src_off, mask=m, other=0.0).to(tl.float32)
    tl.store(dst_k + dst_off, (k - k_mean[None, :]).to(dst_k.dtype.element_ty), mask=m)
    tl.store(dst_v + dst_off, (v - v_mean[None, :]).to(dst_v.dtype.element_ty), mask=m)


@triton.jit
def _tier_gather_kernel(
    sink_k_ptr,  # [rows + 1, H_kv, S, D]
    sink_v_ptr,  # same strides as sink_k
    stride_sr,
    stride_sh,
    stride_st,
    ring_k_ptr,  # [rows + 1, H_kv, R, D]
    ring_v_ptr,  # same strides as ring_k
    stride_rr,
    stride_rh,
    stride_rt,
    rows_ptr,  # int64 [B]: each sequence's tier row
    idx_ptr,  # int64 [B, R]: ring slot of the j-th recent token
    stride_ib,
    k_mean_ptr,  # float32 [H_kv, D] (stride_mh = 0: one [D] mean for all heads)
    v_mean_ptr,
    stride_kmh,
    stride_vmh,
    sk_out,  # [B, H_kv, S, D] centred sink keys
    sv_out,  # same strides as sk_out
    stride_ob,
    stride_oh,
    stride_ot,
    rk_out,  # [B, H_kv, R, D] centred recent keys
    rv_out,  # same strides as rk_out
    stride_pb,
    stride_ph,
    stride_pt,
    n_sink,  # S
    n_ring,  # R
    sink_tiles,  # cdiv(S, BLOCK_T): programs 0 .. sink_tiles - 1 copy the sink, the rest the ring
    tiles,  # cdiv(S, BLOCK_T) + cdiv(R, BLOCK_T): programs from here on rotate queries (Q_JOBS)
    q_ptr, stride_qb, stride_qh, rq_ptr, stride_rqh, qo_ptr, stride_qob, stride_qoh, qk_scale,  # Q_JOBS: as
    # int2_decode._rotate_q_kernel's q, R_K, q_rot, qk_scale
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    Q_JOBS: tl.constexpr = 0,
    Q_BLOCK: tl.constexpr = 32,
    GROUP: tl.constexpr = 1,
    GP: tl.constexpr = 16,
    PDL: tl.constexpr = False,
):
    """``BLOCK_T`` slots of one sequence and KV head, or (``Q_JOBS`` > 0, programs ``tiles ..``) the decode's query
    rotation for ``Q_BLOCK`` output columns of that sequence and KV head (:func:`int2_decode.rotate_q_tile`, the body
    of the decode plan's own first launch, so the same bits). Grid: ``(tiles + Q_JOBS, H_kv, B)``. ``PDL``: let the
    decode's stage 1 (a programmatic dependent launch) start right away, as the rotation kernel does."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    if pid >= tiles:  # only with Q_JOBS > 0: the grid has `tiles` programs along axis 0 otherwise
        if Q_JOBS > 0:
            e = (pid - tiles) * Q_BLOCK + tl.arange(0, Q_BLOCK)
            rotate_q_tile(q_ptr, stride_qb, stride_qh, rq_ptr, stride_rqh, qo_ptr, stride_qob, stride_qoh, qk_scale,
                          b, h, e, b + 1, GROUP=GROUP, GP=GP, D=D, PREC="tf32x3")  # one sequence, b
    else:
        cols = tl.arange(0, BLOCK_D)
        cm = cols < D
        k_mean = tl.load(k_mean_ptr + h * stride_kmh + cols, mask=cm, other=0.0)
        v_mean = tl.load(v_mean_ptr + h * stride_vmh + cols, mask=cm, other=0.0)
        row = tl.load(rows_ptr + b)
        if pid < sink_tiles:
            j = pid * BLOCK_T + tl.arange(0, BLOCK_T)
            ok = j < n_sink
            src = (row * stride_sr + h * stride_sh + j.to(tl.int64) * stride_st)[:, None] + cols[None, :]
            dst = (b.to(tl.int64) * stride_ob + h * stride_oh + j * stride_ot)[:, None] + cols[None, :]
            _centred_copy(sink_k_ptr, sink_v_ptr, src, sk_out, sv_out, dst, ok[:, None] & cm[None, :], k_mean,
                          v_mean)
        else:
            j = (pid - sink_tiles) * BLOCK_T + tl.arange(0, BLOCK_T)
            ok = j < n_ring
            slot = tl.load(idx_ptr + b.to(tl.int64) * stride_ib + j, mask=ok, other=0)
            src = (row * stride_rr + h * stride_rh + slot * stride_rt)[:, None] + cols[None, :]
            dst = (b.to(tl.int64) * stride_pb + h * stride_ph + j * stride_pt)[:, None] + cols[None, :]
            _centred_copy(ring_k_ptr, ring_v_ptr, src, rk_out, rv_out, dst, ok[:, None] & cm[None, :], k_mean,
                          v_mean)
