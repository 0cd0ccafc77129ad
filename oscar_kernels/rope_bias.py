"""Triton kernel of the position-dependent key mean's logit term (launcher: :mod:`oscar_kernels.rope_ops`).

With ``quant.key_mean: rope`` the INT2 history stores each key centred by its position's mean ``RoPE_p(m_pre)``; what
attention needs back is, per query head and history token, ``sm_scale·q·RoPE_p(m_pre)`` (the float64 spec is
``reference.rope_mean_logits``). Written out over the ``D/2`` RoPE pairs ``k`` (``rotate_half`` pairing, ``k`` with
``k + D/2``), with the rotary embedding's attention scaling ``a``::

    t(p) = Σ_k A_k·cos(θ_k p) + B_k·sin(θ_k p),   A_k = a·s·(q_k m_k + q_{k+D/2} m_{k+D/2}),
                                                  B_k = a·s·(q_{k+D/2} m_k - q_k m_{k+D/2})

A program takes ``BLOCK`` consecutive history tokens of one (batch row, KV head) at positions ``P + n``
(``P = position0[b] + n0``) and its ``g`` query heads. Angle addition turns the block into one matrix product:
``t(P + n) = Σ_k cos(θ_k n)·A'_k + sin(θ_k n)·B'_k`` with ``A' = A cos θP + B sin θP``, ``B' = B cos θP - A sin θP``.
``cos/sin θP`` come from two float32 tables built from float64 angles (``P = F·u + r``: a coarse row ``u`` and a fine
row ``r``, one more angle addition), so no angle is ever rounded to float32 whole (``θ_0·p`` at ``p = 128K`` would lose
about 0.008 rad); ``[cos θ_k n | sin θ_k n]`` are the fine table's first ``BLOCK`` rows, the product is ``tl.dot`` in
tf32x3 (about float32 accuracy).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rope_bias_kernel(
    q_ptr, stride_qb, stride_qh,  # q [B, H_q, D] (unrotated post-RoPE queries)
    m_ptr, stride_mh,  # m_pre [H_kv, D] float32, times the attention scaling
    coarse_ptr, n_coarse, fine_ptr,  # [U, D], U and [F, D] float32: row u = [cos|sin θ·F·u], row r = [cos|sin θr]
    pos0_ptr, hist_len_ptr,  # [B] int32: position of history token 0; history tokens per row
    out_ptr, stride_ob, stride_oh,  # [B, H_q, L] float32
    sm_scale,
    H_KV: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    F: tl.constexpr, PREC: tl.constexpr,
):
    """``out[b, h·g + j, n0 + n] = t(position0[b] + n0 + n)`` for ``n < BLOCK`` below ``hist_len[b]``.
    Grid ``(B·H_kv, cdiv(L, BLOCK))``; blocks past the row's length return at once."""
    pid = tl.program_id(0)
    b = pid // H_KV
    h = pid % H_KV
    n0 = tl.program_id(1) * BLOCK
    length = tl.load(hist_len_ptr + b)
    if n0 >= length:
        return
    HALF: tl.constexpr = D // 2
    k = tl.arange(0, HALF)
    heads = tl.arange(0, GP)
    hok = (heads < GROUP)[:, None]
    qrow = q_ptr + b * stride_qb + (h * GROUP + heads)[:, None] * stride_qh
    q1 = tl.load(qrow + k[None, :], mask=hok, other=0.0).to(tl.float32)  # [GP, D/2]
    q2 = tl.load(qrow + (HALF + k)[None, :], mask=hok, other=0.0).to(tl.float32)
    m1 = tl.load(m_ptr + h * stride_mh + k)[None, :]
    m2 = tl.load(m_ptr + h * stride_mh + HALF + k)[None, :]
    a = (q1 * m1 + q2 * m2) * sm_scale
    bb = (q2 * m1 - q1 * m2) * sm_scale
    p = tl.load(pos0_ptr + b) + n0
    u = tl.minimum(p // F, n_coarse - 1)  # (a position past the tables reads their last row: wrong, never OOB)
    r = p % F
    c1 = tl.load(coarse_ptr + u * D + k)
    s1 = tl.load(coarse_ptr + u * D + HALF + k)
    c2 = tl.load(fine_ptr + r * D + k)
    s2 = tl.load(fine_ptr + r * D + HALF + k)
    cp = (c1 * c2 - s1 * s2)[None, :]
    sp = (s1 * c2 + c1 * s2)[None, :]
    a2 = a * cp + bb * sp  # [GP, D/2]
    b2 = bb * cp - a * sp
    n = tl.arange(0, BLOCK)
    phc = tl.load(fine_ptr + n[:, None] * D + k[None, :])  # [BLOCK, D/2]
    phs = tl.load(fine_ptr + n[:, None] * D + HALF + k[None, :])
    t = tl.dot(phc, tl.trans(a2), input_precision=PREC)
    t = tl.dot(phs, tl.trans(b2), t, input_precision=PREC)  # [BLOCK, GP]
    ptrs = out_ptr + b * stride_ob + (h * GROUP + heads)[None, :] * stride_oh + (n0 + n)[:, None]
    tl.store(ptrs, t, mask=(heads < GROUP)[None, :] & ((n0 + n) < length)[:, None])
