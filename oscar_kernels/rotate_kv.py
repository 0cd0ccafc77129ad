"""Triton rotation of a step's new K and V rows, ``y = (float32(x) @ R).to(dtype)`` (the vLLM backend's
``oscar_cli.vllm.core.PagedInt2Layer.rotate``), both in one launch.

Only ``@triton.jit`` code lives here; launchers and checks are in :mod:`oscar_kernels.rotate_ops`.

``x [N, H_kv, D]`` (any row and head strides, last dim contiguous: vLLM's K and V are views into its qkv output),
``R`` float32 ``[D, D]`` shared by the heads (head stride 0) or ``[H_kv, D, D]``; a program computes ``BLOCK_T``
rows of one head against ``BLOCK_E`` columns of ``R`` (``tl.dot`` in IEEE float32, no TF32), so a decode-sized
batch still spreads over ``2 · H_kv · D / BLOCK_E`` programs. The float32 sum is rounded once to the output dtype
(round to nearest even; explicit bit arithmetic for bfloat16, so that the CPU interpreter, whose cast truncates,
rounds like ``torch.Tensor.to``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from oscar_kernels.int2_decode import rotate_q_tile


@triton.jit
def _cast_rn(y, DTYPE: tl.constexpr):
    """float32 -> ``DTYPE`` rounding to nearest even (NaN stays NaN)."""
    if DTYPE == tl.bfloat16:
        u = y.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = u.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(y == y, r, y.to(tl.bfloat16))
    else:
        return y.to(DTYPE)


@triton.jit
def _rotate_tile(x_ptr, stride_xn, stride_xh, r_ptr, stride_rh, y_ptr, stride_yn, stride_yh, h, rows, n_rows,
                 cols_e, D: tl.constexpr):
    """``y[rows, h, cols_e] = rn(float32(x[rows, h, :]) @ R_h[:, cols_e])`` (rows past ``n_rows`` masked)."""
    d = tl.arange(0, D)
    ok = (rows < n_rows)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_xn + h * stride_xh + d[None, :], mask=ok, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + h * stride_rh + d[:, None] * D + cols_e[None, :])
    y = tl.dot(x, r, input_precision="ieee")
    tl.store(y_ptr + r64 * stride_yn + h * stride_yh + cols_e[None, :], _cast_rn(y, y_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["n_q"])  # the decodes' count: no recompile per its 1 / 16k / other class
def _rotate_kv_kernel(
    k_ptr,  # [N, H_kv, D] keys (bf16 / fp16 / fp32)
    stride_kn,
    stride_kh,
    v_ptr,  # [N, H_kv, D] values (k's dtype)
    stride_vn,
    stride_vh,
    rk_ptr,  # float32 [H_r, D, D] K rotation (one shared [D, D]: stride_rkh = 0)
    stride_rkh,
    rv_ptr,  # float32 [H_r, D, D] V rotation
    stride_rvh,
    yk_ptr,  # [N, H_kv, D] rotated keys (output dtype)
    stride_ykn,
    stride_ykh,
    yv_ptr,  # [N, H_kv, D] rotated values (yk's dtype)
    stride_yvn,
    stride_yvh,
    n_rows,  # N
    t_tiles,  # cdiv(N, BLOCK_T): programs from here on along axis 0 rotate queries (Q_JOBS)
    q_ptr, stride_qb, stride_qh, rq_ptr, stride_rqh, qo_ptr, stride_qob, stride_qoh, qk_scale,  # Q_JOBS: as
    # int2_decode._rotate_q_kernel's q, R_K, q_rot, qk_scale
    n_q,  # Q_JOBS: the queries' B
    H_KV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    Q_JOBS: tl.constexpr = False,
    GROUP: tl.constexpr = 1,
    GP: tl.constexpr = 16,
    QB: tl.constexpr = 1,
):
    """Grid: ``(cdiv(N, BLOCK_T) + cdiv(B_q, QB), 2 · H_kv, D / BLOCK_E)``; axis 1 is ``kv · H_kv + head`` (kv 0: K,
    1: V). ``Q_JOBS``: programs ``t_tiles + j`` of axis 0 with ``head < H_kv`` compute the decode's rotated queries
    of sequences ``j·QB .. j·QB + QB - 1`` for that KV head's ``GROUP`` query heads and ``BLOCK_E`` columns
    (:func:`rotate_q_tile`, the body of the decode plan's own first launch, so the same bits; ``B_q = 0`` without
    queries)."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_e = tl.program_id(2)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    if pid_t >= t_tiles:
        if Q_JOBS:
            if pid_h < H_KV:
                rotate_q_tile(q_ptr, stride_qb, stride_qh, rq_ptr, stride_rqh, qo_ptr, stride_qob, stride_qoh,
                              qk_scale, pid_t - t_tiles, pid_h, cols_e, n_q, GROUP=GROUP, GP=GP, D=D, PREC="tf32x3",
                              QB=QB)
    elif pid_h < H_KV:
        _rotate_tile(k_ptr, stride_kn, stride_kh, rk_ptr, stride_rkh, yk_ptr, stride_ykn, stride_ykh, pid_h, rows,
                     n_rows, cols_e, D)
    else:
        _rotate_tile(v_ptr, stride_vn, stride_vh, rv_ptr, stride_rvh, yv_ptr, stride_yvn, stride_yvh, pid_h - H_KV,
                     rows, n_rows, cols_e, D)
