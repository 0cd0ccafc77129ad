"""Triton decode attention over a paged INT2 history plus BF16 sink and recent tiers.

Only ``@triton.jit`` code lives here; launchers, checks, allocation and grids are in :mod:`oscar_kernels.ops`.

Stage 1 (``_decode_stage1_kernel``, grid ``(B * H_kv, S + TIER_PARTS)``): programs ``0..S-1`` of a (batch,
KV head) each take one split of the INT2 history; programs ``S..S+TIER_PARTS-1`` split the BF16/fp16 sink and
recent tiers (concatenated: sink rows then recent rows) into ``TIER_PARTS`` contiguous ranges, so the 320 BF16
rows are not one program's sequential loop (the critical path at short contexts). Every K/V
tile is loaded once and shared by the ``g`` query heads of the KV head (the GQA group is the M dimension of
``tl.dot``, padded to ``GP >= 16``). ``q @ R_K`` is computed in the kernel (``tl.dot`` on float32, tf32x3 on
GPUs) with the softmax scale and ``log2(e)`` folded in. Each program writes a partial ``(o, lse)`` (lse in the
log2 domain) to scratch; an empty split writes ``lse = -inf, o = 0`` so scratch never holds stale data.

Stage 2 (``_merge_rotate_kernel``, grid ``(B * H_q,)``): log-sum-exp merge of the ``S + TIER_PARTS`` partials, add
``mu_V``, rotate back with ``R_Vᵀ``, cast to the activation dtype.

INT2 arithmetic (per token ``n``, K scale ``s_n``, K zero/minimum ``m_n``; codes ``c``):
``score = s_n·(q·c_n) + m_n·Σq`` and ``Σ_n p_n·v̂_n = Σ_n (p_n·s_n)·c_n + Σ_n p_n·m_n``, so the dot products run
on raw codes and every per-token factor is applied once per token, outside the dot.

Unpack (``MAGIC`` 1 or 2): codes are read as int32 words. ``(w >> 2j + 8s) & 0x00030003 | 0x43004300`` puts two
codes of quarter ``j`` into two bf16 lanes whose value is ``128 + c`` exactly (bf16's ulp at 128 is 1; fp16 uses
``0x6400`` = 1024); no int->float conversion. The ``128`` folds into the per-token zero term. With ``MAGIC == 2``
the two lanes of one word stay adjacent (what an MMA operand register pairs) and the unpacked column ``c``
holds dimension ``perm(c)`` (bits 0 and 1 of ``c`` swapped), matched by permuting the columns of ``R_K`` when
rotating q and the output columns of V; ``MAGIC == 1`` interleaves into natural order. ``MAGIC == 0`` is the
straightforward shift/and/convert unpack, kept as the measured baseline.
"""

from __future__ import annotations

import triton
import triton.language as tl


def _unpack_asm(shift: int, fp16: bool) -> str:
    """PTX turning 4 packed code bytes (one quarter selected by ``shift``) into 4 bf16 (or fp16) values.

    ``t = (w >> shift) & 0x03030303`` leaves one code per byte; ``prmt`` interleaves each code byte with the
    constant byte 0x43 (bf16 ``0x43cc`` = 128 + c exactly) or 0x64 (fp16 ``0x64cc`` = 1024 + c), two lanes per
    output register in element order. fp16 subtracts 1024 exactly (``sub.f16x2``) so its dot runs on ``c``;
    bf16 keeps ``128 + c`` and folds the 128 into the per-token zero term.
    """
    const = "0x64646464" if fp16 else "0x43434343"
    lines = ["{", ".reg .b32 t;"]
    lines.append(f"shr.b32 t, $2, {shift};\nand.b32 t, t, 0x03030303;" if shift else "and.b32 t, $2, 0x03030303;")
    lines += [f"prmt.b32 $0, t, {const}, 0x5140;", f"prmt.b32 $1, t, {const}, 0x7362;"]
    if fp16:
        lines += [".reg .b32 m;", "mov.b32 m, 0x64006400;", "sub.f16x2 $0, $0, m;", "sub.f16x2 $1, $1, m;"]
    return "\n".join(lines + ["}"])


_ASM_BF16_0 = tl.constexpr(_unpack_asm(0, False))
_ASM_BF16_1 = tl.constexpr(_unpack_asm(2, False))
_ASM_BF16_2 = tl.constexpr(_unpack_asm(4, False))
_ASM_BF16_3 = tl.constexpr(_unpack_asm(6, False))
_ASM_F16_0 = tl.constexpr(_unpack_asm(0, True))
_ASM_F16_1 = tl.constexpr(_unpack_asm(2, True))
_ASM_F16_2 = tl.constexpr(_unpack_asm(4, True))
_ASM_F16_3 = tl.constexpr(_unpack_asm(6, True))


@triton.jit
def _quarter_cols(J: tl.constexpr, D: tl.constexpr, MAGIC: tl.constexpr):
    """Head-dim index held by each of the ``D/4`` unpacked columns of quarter ``J``."""
    return _perm(tl.arange(0, D // 4), MAGIC) + J * (D // 4)


@triton.jit
def _unpack_quarter(raw, J: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, MAGIC: tl.constexpr,
                    ACT: tl.constexpr):
    """Codes of quarter ``J`` as an ``ACT [BLOCK_N, D/4]`` tile.

    ``raw``: int32 words ``[BLOCK_N, D/16]`` when ``MAGIC`` is 1 or 2 (values ``OFF + c``), else uint8 bytes
    ``[BLOCK_N, D/4]`` (values ``c`` for ``MAGIC == 0``, ``OFF + c`` for ``MAGIC == 3``). Column order: natural for ``MAGIC`` 0 and 1; for ``MAGIC == 2`` the two
    16-bit lanes of one int32 sit in adjacent columns (dims ``4w + s`` and ``4w + s + 2``), see
    :func:`_quarter_cols`.
    """
    if MAGIC == 4:  # bytes; PTX per 32-bit register of 4 codes: shift, and, two byte-permutes (see _UNPACK_ASM)
        if ACT == tl.float16:
            if J == 0:
                out = tl.inline_asm_elementwise(_ASM_F16_0, "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)
            elif J == 1:
                out = tl.inline_asm_elementwise(_ASM_F16_1, "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)
            elif J == 2:
                out = tl.inline_asm_elementwise(_ASM_F16_2, "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)
            else:
                out = tl.inline_asm_elementwise(_ASM_F16_3, "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)
        else:
            if J == 0:
                out = tl.inline_asm_elementwise(_ASM_BF16_0, "=r,=r,r", [raw], dtype=tl.bfloat16, is_pure=True, pack=4)
            elif J == 1:
                out = tl.inline_asm_elementwise(_ASM_BF16_1, "=r,=r,r", [raw], dtype=tl.bfloat16, is_pure=True, pack=4)
            elif J == 2:
                out = tl.inline_asm_elementwise(_ASM_BF16_2, "=r,=r,r", [raw], dtype=tl.bfloat16, is_pure=True, pack=4)
            else:
                out = tl.inline_asm_elementwise(_ASM_BF16_3, "=r,=r,r", [raw], dtype=tl.bfloat16, is_pure=True, pack=4)
        return out
    elif MAGIC == 3:  # bytes in natural layout, magic number per element
        m16: tl.constexpr = 0x6400 if ACT == tl.float16 else 0x4300
        return (((raw.to(tl.int16) >> (2 * J)) & 3) | m16).to(ACT, bitcast=True)
    elif MAGIC != 0:
        magic: tl.constexpr = 0x64006400 if ACT == tl.float16 else 0x43004300
        x0 = ((raw >> (2 * J)) & 0x00030003) | magic
        x1 = ((raw >> (2 * J + 8)) & 0x00030003) | magic
        lo0 = x0.to(tl.int16).to(ACT, bitcast=True)
        hi0 = (x0 >> 16).to(tl.int16).to(ACT, bitcast=True)
        lo1 = x1.to(tl.int16).to(ACT, bitcast=True)
        hi1 = (x1 >> 16).to(tl.int16).to(ACT, bitcast=True)
        if MAGIC == 2:  # element [n, w, s, lane] -> column 4w + 2s + lane
            t = tl.join(tl.join(lo0, lo1), tl.join(hi0, hi1))
        else:  # element [n, w, lane, s] -> column 4w + 2·lane + s = its dim
            t = tl.join(tl.join(lo0, hi0), tl.join(lo1, hi1))
        return tl.reshape(t, [BLOCK_N, D // 4])
    else:
        return ((raw >> (2 * J)) & 3).to(ACT)


@triton.jit
def _rotate_q_kernel(
    q_ptr, stride_qb, stride_qh,  # q [B, H_q, D] act dtype
    r_ptr, stride_rh,  # R_K [H_r, D, D] float32 (stride 0: shared)
    out_ptr, stride_ob, stride_oh,  # q_rot [B, H_q, D] act dtype, columns in stage-1 order
    qk_scale,  # softmax scale * log2(e)
    H_KV: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, MAGIC: tl.constexpr,
    PREC: tl.constexpr,
):
    """``q_rot = (q @ R_K) * qk_scale`` for the ``g`` query heads of one KV head.

    Column ``i`` of the output holds rotated dimension ``perm(i)`` when ``MAGIC == 2`` (the order the INT2
    tiles unpack in; ``perm`` swaps bits 0 and 1, an involution), else dimension ``i``.
    Grid: ``(B * H_kv,)``.
    """
    pid = tl.program_id(0)
    b = pid // H_KV
    h = pid % H_KV
    q32 = _load_q(q_ptr, b, h, stride_qb, stride_qh, GROUP, GP, D)
    cols = tl.arange(0, D)
    src = _perm(cols, MAGIC)
    r = tl.load(r_ptr + h * stride_rh + tl.arange(0, D)[:, None] * D + src[None, :])
    qr = tl.dot(q32, r, input_precision=PREC) * qk_scale
    rows = tl.arange(0, GP)
    ptrs = out_ptr + b * stride_ob + (h * GROUP + rows)[:, None] * stride_oh + cols[None, :]
    tl.store(ptrs, qr.to(out_ptr.dtype.element_ty), mask=(rows < GROUP)[:, None])


@triton.jit
def _perm(c, MAGIC: tl.constexpr):
    """Swap bits 0 and 1 of ``c`` when ``MAGIC == 2`` (lane-paired unpack order), else identity."""
    if MAGIC == 2:
        c = (c & ~3) | ((c & 1) << 1) | ((c >> 1) & 1)
    return c


@triton.jit
def _load_q(q_ptr, b, h, stride_qb, stride_qh, GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr):
    """Query rows of KV head ``h``: float32 ``[GP, D]`` (rows ``>= GROUP`` are zero)."""
    rows = tl.arange(0, GP)
    ptrs = q_ptr + b * stride_qb + (h * GROUP + rows)[:, None] * stride_qh + tl.arange(0, D)[None, :]
    return tl.load(ptrs, mask=(rows < GROUP)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _load_q_cols(q_ptr, b, h, stride_qb, stride_qh, J: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr,
                 D: tl.constexpr):
    """Columns ``[J·D/4, (J+1)·D/4)`` of the rotated queries of KV head ``h``: ``[GP, D/4]`` (pad rows 0)."""
    rows = tl.arange(0, GP)
    ptrs = (q_ptr + b * stride_qb + (h * GROUP + rows)[:, None] * stride_qh
            + (J * (D // 4) + tl.arange(0, D // 4))[None, :])
    return tl.load(ptrs, mask=(rows < GROUP)[:, None], other=0.0)


@triton.jit
def _store_partial(o, lse, op_ptr, lse_ptr, b, h, sp, cols, stride_ob, stride_oh, stride_os, stride_lb,
                   stride_lh, GROUP: tl.constexpr, GP: tl.constexpr):
    """Write ``o [GP, len(cols)]`` to dims ``cols`` of split ``sp`` and (once, with the first tile) ``lse [GP]``."""
    rows = tl.arange(0, GP)
    heads = h * GROUP + rows
    ok = rows < GROUP
    base = op_ptr + b * stride_ob + heads[:, None] * stride_oh + sp * stride_os
    tl.store(base + cols[None, :], o, mask=ok[:, None])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + sp, lse, mask=ok)


@triton.jit
def _int2_split(
    b, h, sp, num_splits,
    q_ptr, stride_qb, stride_qh,  # q_rot [B, H_q, D] (scaled, stage-1 column order)
    kc_ptr, vc_ptr, stride_cp, stride_ch,  # codes [pages, H_kv, P, D/4] (bytes, or int32 words), rows contiguous
    ks_ptr, kz_ptr, vs_ptr, vz_ptr, stride_mp, stride_mh,  # meta [pages, H_kv, P], contiguous along P
    bt_ptr, stride_btb, hist_len_ptr, page_size,  # block table [B, max_pages] int32, lengths [B] int32
    op_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,  # partials
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    MAGIC: tl.constexpr, MODE: tl.constexpr, ACT: tl.constexpr, PAGED: tl.constexpr,
):
    """One split of the INT2 history for one (batch, KV head); writes partial ``sp``."""
    # value that code 0 unpacks to (folded into the per-token zero term); MAGIC 4 on fp16 subtracts it exactly
    OFF: tl.constexpr = (0.0 if (MAGIC == 0 or (MAGIC == 4 and ACT == tl.float16))
                         else (1024.0 if ACT == tl.float16 else 128.0))
    NW: tl.constexpr = D // 16 if (MAGIC == 1 or MAGIC == 2) else D // 4  # int32 words or bytes per row
    c0 = _quarter_cols(0, D, MAGIC)
    c1 = _quarter_cols(1, D, MAGIC)
    c2 = _quarter_cols(2, D, MAGIC)
    c3 = _quarter_cols(3, D, MAGIC)
    q0 = _load_q_cols(q_ptr, b, h, stride_qb, stride_qh, 0, GROUP, GP, D)
    q1 = _load_q_cols(q_ptr, b, h, stride_qb, stride_qh, 1, GROUP, GP, D)
    q2 = _load_q_cols(q_ptr, b, h, stride_qb, stride_qh, 2, GROUP, GP, D)
    q3 = _load_q_cols(q_ptr, b, h, stride_qb, stride_qh, 3, GROUP, GP, D)
    qsum = (tl.sum(q0.to(tl.float32), 1) + tl.sum(q1.to(tl.float32), 1)
            + tl.sum(q2.to(tl.float32), 1) + tl.sum(q3.to(tl.float32), 1))

    length = tl.load(hist_len_ptr + b)
    chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = sp * chunk
    end = tl.minimum(start + chunk, length)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    accm = tl.zeros([GP], tl.float32)
    acc0 = tl.zeros([GP, D // 4], tl.float32)
    acc1 = tl.zeros([GP, D // 4], tl.float32)
    acc2 = tl.zeros([GP, D // 4], tl.float32)
    acc3 = tl.zeros([GP, D // 4], tl.float32)
    wcols = tl.arange(0, NW)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        valid = tok < end
        if PAGED:
            page = tl.load(bt_ptr + b * stride_btb + tok // page_size, mask=valid, other=0).to(tl.int64)
            off = tok % page_size
        else:  # one "page" of T rows per sequence (the non-paged layout): no table lookups
            page = tl.full([BLOCK_N], 0, tl.int64) + b
            off = tok
        cbase = page * stride_cp + h * stride_ch + off * NW
        mbase = page * stride_mp + h * stride_mh + off
        kw = tl.load(kc_ptr + cbase[:, None] + wcols[None, :], mask=valid[:, None], other=0)
        ks = tl.load(ks_ptr + mbase, mask=valid, other=0.0).to(tl.float32)
        kz = tl.load(kz_ptr + mbase, mask=valid, other=0.0).to(tl.float32)
        vw = tl.load(vc_ptr + cbase[:, None] + wcols[None, :], mask=valid[:, None], other=0)
        vs = tl.load(vs_ptr + mbase, mask=valid, other=0.0).to(tl.float32)
        vz = tl.load(vz_ptr + mbase, mask=valid, other=0.0).to(tl.float32)
        if MODE == 1:  # diagnostic: load only
            accm += tl.sum(tl.sum((kw ^ vw).to(tl.float32), 1), 0) + tl.sum(ks + kz + vs + vz, 0)
            l_i += 1.0
        elif MODE == 2:  # diagnostic: load + unpack (no attention math)
            u = _unpack_quarter(kw, 0, BLOCK_N, D, MAGIC, ACT).to(tl.float32)
            u += _unpack_quarter(kw, 1, BLOCK_N, D, MAGIC, ACT).to(tl.float32)
            u += _unpack_quarter(kw, 2, BLOCK_N, D, MAGIC, ACT).to(tl.float32)
            u += _unpack_quarter(kw, 3, BLOCK_N, D, MAGIC, ACT).to(tl.float32)
            u += _unpack_quarter(vw, 0, BLOCK_N, D, MAGIC, ACT).to(tl.float32)
            u += _unpack_quarter(vw, 1, BLOCK_N, D, MAGIC, ACT).to(tl.float32)
            u += _unpack_quarter(vw, 2, BLOCK_N, D, MAGIC, ACT).to(tl.float32)
            u += _unpack_quarter(vw, 3, BLOCK_N, D, MAGIC, ACT).to(tl.float32)
            accm += tl.sum(tl.sum(u, 1) * ks + kz + vs + vz, 0)
            l_i += 1.0
        else:
            raw = tl.dot(q0, tl.trans(_unpack_quarter(kw, 0, BLOCK_N, D, MAGIC, ACT)))
            raw = tl.dot(q1, tl.trans(_unpack_quarter(kw, 1, BLOCK_N, D, MAGIC, ACT)), raw)
            raw = tl.dot(q2, tl.trans(_unpack_quarter(kw, 2, BLOCK_N, D, MAGIC, ACT)), raw)
            raw = tl.dot(q3, tl.trans(_unpack_quarter(kw, 3, BLOCK_N, D, MAGIC, ACT)), raw)
            s = raw * ks[None, :] + qsum[:, None] * (kz - OFF * ks)[None, :]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            pv = (p * vs[None, :]).to(ACT)
            accm = accm * alpha + tl.sum(p * vz[None, :], 1) - OFF * tl.sum(pv.to(tl.float32), 1)
            acc0 = tl.dot(pv, _unpack_quarter(vw, 0, BLOCK_N, D, MAGIC, ACT), acc0 * alpha[:, None])
            acc1 = tl.dot(pv, _unpack_quarter(vw, 1, BLOCK_N, D, MAGIC, ACT), acc1 * alpha[:, None])
            acc2 = tl.dot(pv, _unpack_quarter(vw, 2, BLOCK_N, D, MAGIC, ACT), acc2 * alpha[:, None])
            acc3 = tl.dot(pv, _unpack_quarter(vw, 3, BLOCK_N, D, MAGIC, ACT), acc3 * alpha[:, None])
            m_i = m_new
    has = l_i > 0
    inv = 1.0 / tl.where(has, l_i, 1.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    if MODE != 0:
        lse = tl.where(has, accm * 0.0, float("-inf"))
    _store_partial((acc0 + accm[:, None]) * inv[:, None], lse, op_ptr, lse_ptr, b, h, sp, c0,
                   stride_ob, stride_oh, stride_os, stride_lb, stride_lh, GROUP, GP)
    _store_partial((acc1 + accm[:, None]) * inv[:, None], lse, op_ptr, lse_ptr, b, h, sp, c1,
                   stride_ob, stride_oh, stride_os, stride_lb, stride_lh, GROUP, GP)
    _store_partial((acc2 + accm[:, None]) * inv[:, None], lse, op_ptr, lse_ptr, b, h, sp, c2,
                   stride_ob, stride_oh, stride_os, stride_lb, stride_lh, GROUP, GP)
    _store_partial((acc3 + accm[:, None]) * inv[:, None], lse, op_ptr, lse_ptr, b, h, sp, c3,
                   stride_ob, stride_oh, stride_os, stride_lb, stride_lh, GROUP, GP)


@triton.jit
def _online_bf16_segment(qa, k_base, v_base, stride_t, n, m_i, l_i, acc, D: tl.constexpr,
                         BLOCK_NB: tl.constexpr, ACT: tl.constexpr):
    """Online-softmax update over ``n`` BF16/fp16 rows ``[n, D]`` of one tier (row stride ``stride_t``)."""
    cols = tl.arange(0, D)
    for n0 in range(0, n, BLOCK_NB):
        tok = n0 + tl.arange(0, BLOCK_NB)
        valid = tok < n
        offs = tok[:, None] * stride_t + cols[None, :]
        k = tl.load(k_base + offs, mask=valid[:, None], other=0.0).to(ACT)
        s = tl.dot(qa, tl.trans(k))
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs, mask=valid[:, None], other=0.0).to(ACT)
        acc = tl.dot(p.to(ACT), v, acc * alpha[:, None])
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _bf16_tiers(
    b, h, sp, part,
    q_ptr, stride_qb, stride_qh,
    sk_ptr, sv_ptr, stride_sb, stride_sh, stride_st, sink_len_ptr,  # sink [B, H_kv, T_s, D]
    rk2_ptr, rv2_ptr, stride_rb, stride_rh, stride_rt, recent_len_ptr,  # recent [B, H_kv, T_r, D]
    op_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_NB: tl.constexpr,
    ACT: tl.constexpr, MAGIC: tl.constexpr, TIER_PARTS: tl.constexpr,
):
    """Range ``part`` of ``TIER_PARTS`` over [sink rows | recent rows] of one (batch, KV head) in one online
    softmax; writes partial ``sp``. Ranges are whole tiles of ``BLOCK_NB`` rows; an empty range writes
    ``lse = -inf, o = 0``."""
    cols = tl.arange(0, D)
    rows = tl.arange(0, GP)
    qa = tl.load(q_ptr + b * stride_qb + (h * GROUP + rows)[:, None] * stride_qh + _perm(cols, MAGIC)[None, :],
                 mask=(rows < GROUP)[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    n_sink = tl.load(sink_len_ptr + b)
    n_all = n_sink + tl.load(recent_len_ptr + b)
    chunk = tl.cdiv(tl.cdiv(n_all, TIER_PARTS), BLOCK_NB) * BLOCK_NB
    start = part * chunk
    end = tl.minimum(start + chunk, n_all)
    s0 = tl.minimum(start, n_sink)  # sink rows [s0, s1) of this range
    s1 = tl.minimum(end, n_sink)
    r0 = tl.maximum(start - n_sink, 0)  # recent rows [r0, r1)
    r1 = tl.maximum(end - n_sink, 0)
    sink_off = b * stride_sb + h * stride_sh + s0 * stride_st
    m_i, l_i, acc = _online_bf16_segment(
        qa, sk_ptr + sink_off, sv_ptr + sink_off, stride_st, s1 - s0, m_i, l_i, acc, D, BLOCK_NB, ACT)
    recent_off = b * stride_rb + h * stride_rh + r0 * stride_rt
    m_i, l_i, acc = _online_bf16_segment(
        qa, rk2_ptr + recent_off, rv2_ptr + recent_off, stride_rt, r1 - r0, m_i, l_i, acc, D, BLOCK_NB, ACT)
    has = l_i > 0
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    _store_partial(o, lse, op_ptr, lse_ptr, b, h, sp, cols, stride_ob, stride_oh, stride_os, stride_lb,
                   stride_lh, GROUP, GP)


@triton.jit
def _decode_stage1_kernel(
    q_ptr, stride_qb, stride_qh,  # q_rot [B, H_q, D] act dtype, from _rotate_q_kernel
    kc_ptr, vc_ptr, stride_cp, stride_ch,  # codes [pages, H_kv, P, D/4]: bytes or int32 words; rows contiguous
    ks_ptr, kz_ptr, vs_ptr, vz_ptr, stride_mp, stride_mh,  # scale / zero [pages, H_kv, P] md, P contiguous
    bt_ptr, stride_btb, hist_len_ptr, page_size,  # block table [B, max_pages] int32; hist_len [B] int32
    sk_ptr, sv_ptr, stride_sb, stride_sh, stride_st, sink_len_ptr,  # sink tier [B, H_kv, T_s, D]
    rck_ptr, rcv_ptr, stride_rb, stride_rh, stride_rt, recent_len_ptr,  # recent tier [B, H_kv, T_r, D]
    op_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,  # o [B,H_q,S+TP,D], lse [B,H_q,S+TP]
    num_splits,  # S
    H_KV: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_NB: tl.constexpr, MAGIC: tl.constexpr, MODE: tl.constexpr,
    ACT: tl.constexpr, PAGED: tl.constexpr, TIER_PARTS: tl.constexpr,
):
    """Stage 1: partial attention per (batch, KV head, split); splits ``S..S+TIER_PARTS-1`` are the BF16 tiers.

    Grid: ``(B * H_kv, S + TIER_PARTS)``.
    """
    pid = tl.program_id(0)
    b = pid // H_KV
    h = pid % H_KV
    sp = tl.program_id(1)
    if sp < num_splits:
        _int2_split(b, h, sp, num_splits, q_ptr, stride_qb, stride_qh,
                    kc_ptr, vc_ptr, stride_cp, stride_ch,
                    ks_ptr, kz_ptr, vs_ptr, vz_ptr, stride_mp, stride_mh,
                    bt_ptr, stride_btb, hist_len_ptr, page_size,
                    op_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                    GROUP, GP, D, BLOCK_N, MAGIC, MODE, ACT, PAGED)
    else:
        _bf16_tiers(b, h, sp, sp - num_splits, q_ptr, stride_qb, stride_qh,
                    sk_ptr, sv_ptr, stride_sb, stride_sh, stride_st, sink_len_ptr,
                    rck_ptr, rcv_ptr, stride_rb, stride_rh, stride_rt, recent_len_ptr,
                    op_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                    GROUP, GP, D, BLOCK_NB, ACT, MAGIC, TIER_PARTS)


@triton.jit
def _merge_rotate_kernel(
    op_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,  # partials (see stage 1)
    mu_ptr, stride_muh,  # mu_V [H_r, D] float32 (rotated space)
    rv_ptr, stride_rvh,  # R_V [H_r, D, D] float32
    out_ptr, stride_outb, stride_outh,  # out [B, H_q, D] act dtype
    n_parts,  # S + TIER_PARTS
    H_Q: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, SP: tl.constexpr, BLOCK_E: tl.constexpr,
    HAS_MU: tl.constexpr, HAS_R: tl.constexpr,
):
    """Stage 2: LSE merge over the partials, ``+ mu_V``, ``@ R_Vᵀ``, cast; one program per query head.

    Grid: ``(B * H_q,)``.
    """
    pid = tl.program_id(0)
    b = pid // H_Q
    hq = pid % H_Q
    hkv = hq // GROUP
    parts = tl.arange(0, SP)
    pm = parts < n_parts
    cols = tl.arange(0, D)
    lse = tl.load(lse_ptr + b * stride_lb + hq * stride_lh + parts, mask=pm, other=float("-inf"))
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse - mx)
    den = tl.sum(w, 0)
    o = tl.load(op_ptr + b * stride_ob + hq * stride_oh + parts[:, None] * stride_os + cols[None, :],
                mask=pm[:, None], other=0.0)
    o = tl.sum(w[:, None] * o, 0) / tl.where(den > 0, den, 1.0)
    if HAS_MU:
        o += tl.load(mu_ptr + hkv * stride_muh + cols)
    obase = out_ptr + b * stride_outb + hq * stride_outh
    if HAS_R:
        for e0 in tl.static_range(0, D, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)
            r = tl.load(rv_ptr + hkv * stride_rvh + e[:, None] * D + cols[None, :])  # R_V[e, :]
            tl.store(obase + e, tl.sum(r * o[None, :], 1).to(out_ptr.dtype.element_ty))
    else:
        tl.store(obase + cols, o.to(out_ptr.dtype.element_ty))
