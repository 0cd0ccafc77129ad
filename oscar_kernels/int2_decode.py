"""Triton decode attention over a paged INT2 history plus BF16 sink and recent tiers.

Only ``@triton.jit`` code lives here; launchers, checks, allocation and grids are in :mod:`oscar_kernels.ops`
(``DecodePlan``), the format and the float64 semantics in :mod:`oscar_kernels.reference`. docs/KERNELS.md has the
measurements behind each choice.

**Layout** (``reference.py``). Keys: quarter-packed rows ``[pages, H_kv, P, D/4]`` (a byte holds dims ``i, i + D/4,
i + D/2, i + 3D/4`` of one token, so quarter ``J`` of a byte row is ``D/4`` consecutive dims: the reduction axis of
``C_K·qᵀ``). Values: token quads ``[pages, H_kv, P/R·D, R/4]`` in rows of ``R = min(P, 64)`` tokens (a byte holds
tokens ``4i .. 4i+3`` of one dim, so residue ``j`` of a byte row is consecutive quads: the reduction axis of
``C_Vᵀ·Pᵀ``; non-paged: ``[B, H_kv, ⌈T/64⌉·D, 16]``). A 64-token tile is ``D`` rows of 16 contiguous bytes for every
page size; neither operand is transposed through shared memory. Scale and zero (``G = D``): ``[pages, H_kv, P]``.

**Grid and pipeline.** Three kernels, launched by ``DecodePlan.run``:

1. ``_rotate_q_kernel`` ``(cdiv(B, QB)·H_kv, D/32)``: ``q @ R_K`` (``tl.dot`` on float32, tf32x3 on GPUs) with the softmax
   scale and ``log2(e)`` folded in.
2. ``_decode_stage1_kernel`` ``(B·H_kv, S + TIER_PARTS)``: programs ``0..S-1`` of a (batch, KV head) each take one
   split of the INT2 history; programs ``S..S+TIER_PARTS-1`` cut the BF16/fp16 sink and recent rows (sink rows then
   recent rows) into ``TIER_PARTS`` ranges. Every K/V tile is loaded once and shared by the ``g`` query heads of the
   KV head: the tokens are the M dimension of ``tl.dot`` and the query heads its N (padded to ``GP``),
   ``Sᵀ = C_K·qᵀ`` and ``Oᵀ += C_Vᵀ·(P∘s_V)ᵀ``. A ``BLOCK_N``-token tile is four token residues ``j`` (tokens
   ``n0 + 4i + j``); whole tiles run unmasked, the last tile of a split masked; the loop is pipelined
   ``HIST_STAGES`` deep (Triton's pipeliner divides the depth between the block-table load and the copies it
   addresses: 5 double-buffers the K/V/metadata copies). Each program writes a partial ``(o, lse)`` (lse in the log2
   domain); an empty split writes ``lse = -inf, o = 0``. ``PREFETCH``: before waiting for the rotation each program
   starts the DRAM -> L2 transfer of its first tile (or its BF16 rows).
3. ``_merge_rotate_kernel`` ``(B·H_q, D/E_PROG)``: log-sum-exp merge of the ``S + TIER_PARTS`` partials, ``+ mu_V``,
   ``@ R_Vᵀ``, cast to the activation dtype.

With ``PDL`` stage 1 and the merge are programmatic dependent launches: each waits for its producer with
``griddepcontrol.wait`` and is launched while the producer drains.

**INT2 arithmetic** (per token ``n``, K scale ``s_n``, K zero ``m_n``, codes ``c``):
``score = s_n·(q·c_n) + m_n·Σq`` and ``Σ_n p_n·v̂_n = Σ_n (p_n·s_n)·c_n + Σ_n p_n·m_n``: the dot products run on
raw codes and every per-token factor is applied once per token, outside the dot.

**Per-key logit bias** (``HAS_BIAS``): ``bias [B, H_q, L]`` float32 adds ``bias[b, h_q, n]`` (natural units, times
``log2(e)`` here) to the score of INT2 history token ``n`` (one ``[NQ, 4, GP]`` load per tile, split into the
residues like the metadata); the BF16 tiers take none. The position-dependent key mean uses it
(``oscar_kernels.rope_ops``).

**INT4 keys** (``HAS_LO``; ``reference`` formula 9): the pages hold the high plane as an INT2 row with its own
scale and zero; the low plane, ``uint8 [B, H_kv, C, D/4]`` quarter packed like the key rows and indexed by slot
(history token ``n`` of row ``b`` at slot ``first[b] + n``), is read with the same field dots and added at a quarter
of the scale: ``score = s_n·(q·hi_n + q·lo_n/4) + m_n·Σq``. One more ``D/4``-byte row per token and four more MMAs
per residue, in the layers that have it. ``HAS_LO == 2`` (paged low plane, the vLLM backend's pages): the plane is a
second array laid out exactly as the key codes (same page, head and row strides), so a token's low row sits at its
key row's offset from ``lo_ptr``: no slot index, the block table addresses both.

**Position-dependent key mean** (``HAS_ROPE``): the term ``t(p) = Σ_k A_k·cos θ_k p + B_k·sin θ_k p`` of keys
centred by ``RoPE_p(m_pre)`` (``oscar_kernels.rope_ops``), computed in the tile instead of read from a ``[B, H_q, L]``
buffer. Each program forms ``A``, ``B`` (``[D/2, GP]`` float32, times ``a·sm_scale·log2(e)``) once from the raw
queries and ``m_pre``. For the tile whose first token sits at position ``p0`` (``pos0_b + n0``) they are rotated by
the position table's row ``p0`` (angle addition: ``A' = A·cos θp0 + B·sin θp0``, ``B' = B·cos θp0 - A·sin θp0``), and
``t(p0 + r) = [cos θr | sin θr]·[A' | B']`` for the tile's offsets ``r < BLOCK_N``: per residue ``j`` one ``[NQ, D]
× [D, GP]`` product against the rows ``r = 4i + j``, the same for every tile. ``ROPE_PREC = "fp16"``: those rows as
fp16 (a ``[BLOCK_N, D]`` copy, pipelined like the codes), ``A'``, ``B'`` times a power of two per program as fp16,
float32 sums; ``"tf32x3"`` and the others: float32 rows of the table and ``tl.dot`` at that precision, the
coefficients rotated per residue. No angle is rounded to float32 (the table's rows are float32 roundings of float64
values).

**Unpack: fp16 subnormal fields, the whole byte as the top field.** Two ``prmt`` zero-extend 4 code bytes to 4
uint16 lanes (:func:`_spread`); an ``and`` with ``0x00030003 << 2J`` per two codes leaves the bit pattern of the
fp16 subnormal ``c_J·4^J·2^-24`` exactly (:func:`_field`, fields ``J = 0..2``), and the zero-extended byte itself,
``c0 + 4c1 + 16c2 + 64c3``, is the fp16 subnormal ``Σ_J c_J·4^J·2^-24`` (no instruction). So four MMAs per residue
take fields 0, 1, 2 and the whole byte; the other operand of field ``J < 3`` is ``x_J - x_3`` and that of the byte
``x_3`` (``Σ_{J<3} A_J·(x_J - x_3) + (Σ_J A_J)·x_3 = Σ_J A_J·x_J``), where ``x_J`` is quarter ``J`` of ``q`` times
``4^-J`` and a per-program power of two that keeps ``|q| <= 2^14`` (keys), or residue ``j`` of ``P∘s_V`` times
``4^-j`` and a per-tile power of two ``F`` with ``p·s_V·F <= 2^14`` (values; the accumulator is rescaled by
``F_new/F_old`` with the softmax ``α``). The corrected operands are rounded to fp16 once per program (q) or per tile
(``P``); the dots run on fp16 for bf16 and fp16 activations alike, and ``2^24`` and the powers of two are undone on
the fp32 results: 0.5 integer instructions per code. ``PTX`` selects the inline-PTX unpack (CUDA); the CPU
interpreter runs the same fields element by element (bitwise the same values).
"""

from __future__ import annotations

import triton
import triton.language as tl

from oscar_kernels.int2_pack import meta8_decode

# "Spread": 4 code bytes -> 4 uint16 (each byte zero-extended, two ``prmt``); "field J": ``and`` with
# ``0x00030003 << 2J`` leaves code ``c`` of every uint16 lane in bits ``2J, 2J+1``: the fp16 bit pattern of the
# subnormal ``c * 4^J * 2^-24``, exactly, two codes per instruction (tensor cores keep fp16 subnormal inputs).
_ASM_SPREAD = tl.constexpr("prmt.b32 $0, $2, 0, 0x4140;\nprmt.b32 $1, $2, 0, 0x4342;")
_ASM_FIELD_0 = tl.constexpr("and.b32 $0, $1, 0x00030003;")
_ASM_FIELD_1 = tl.constexpr("and.b32 $0, $1, 0x000c000c;")
_ASM_FIELD_2 = tl.constexpr("and.b32 $0, $1, 0x00300030;")


@triton.jit
def _spread(raw, PTX: tl.constexpr):
    """Code bytes ``raw`` (uint8) zero-extended to uint16, position by position (``PTX``: two ``prmt`` per 4
    bytes; else a plain conversion)."""
    if PTX:
        return tl.inline_asm_elementwise(_ASM_SPREAD, "=r,=r,r", [raw], dtype=tl.uint16, is_pure=True, pack=4)
    else:
        return raw.to(tl.uint16)


@triton.jit
def _field(wide, J: tl.constexpr, PTX: tl.constexpr):
    """Field ``J`` (0..2) of spread codes ``wide`` (uint16) as the fp16 subnormals ``c * 4^J * 2^-24`` (exact), one
    ``and`` per two codes (``PTX``) or per element."""
    if PTX:
        if J == 0:
            out = tl.inline_asm_elementwise(_ASM_FIELD_0, "=r,r", [wide], dtype=tl.float16, is_pure=True, pack=2)
        elif J == 1:
            out = tl.inline_asm_elementwise(_ASM_FIELD_1, "=r,r", [wide], dtype=tl.float16, is_pure=True, pack=2)
        else:
            out = tl.inline_asm_elementwise(_ASM_FIELD_2, "=r,r", [wide], dtype=tl.float16, is_pure=True, pack=2)
        return out
    else:
        return (wide & (3 << (2 * J))).to(tl.float16, bitcast=True)


@triton.jit
def _top_field(wide):
    """The top MMA operand of spread codes ``wide``: the whole byte ``c0 + 4c1 + 16c2 + 64c3`` as an fp16 subnormal
    (no instruction)."""
    return wide.to(tl.float16, bitcast=True)


@triton.jit
def _pow2_scale(xmax):
    """A power of two ``f = 2^(14 - c)`` with ``c = ⌈log2 xmax⌉`` (``xmax >= 0``), so ``xmax·f <= 2^14``: scales an
    fp16 MMA operand away from both overflow and the subnormals. ``c`` comes from the float32 bits (exponent, plus
    one unless the mantissa is zero; exact, and a few integer instructions instead of ``log2``/``exp2`` on the
    loop's critical path), clamped to ``[-24, 112]`` so that ``f`` is a normal float32 even for ``xmax = 0``."""
    bits = xmax.to(tl.int32, bitcast=True)
    c = (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    c = tl.minimum(tl.maximum(c, -24), 112)
    return ((141 - c) << 23).to(tl.float32, bitcast=True)


@triton.jit
def rotate_q_tile(q_ptr, stride_qb, stride_qh, r_ptr, stride_rh, out_ptr, stride_ob, stride_oh, qk_scale, b, h, e,
                  n_seq, GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr,
                  QB: tl.constexpr = 1):
    """``q_rot[s, g, e] = (q[s, g] @ R_K[:, e]) * qk_scale`` for the ``GROUP`` query heads ``g`` of KV head ``h``,
    the output columns ``e`` and the ``QB`` sequences ``s = b·QB ..`` below ``n_seq``: the body of
    ``_rotate_q_kernel``, of the tier gather's query jobs (:mod:`oscar_kernels.tier_copy`) and of the K/V rotation's
    (:mod:`oscar_kernels.rotate_kv`), so all give the same bits. The MMA's ``GP`` rows are sequence-major
    (``QB · GROUP <= GP``): with ``QB > 1`` the rows that one sequence's heads leave as padding hold the next
    sequences' heads (one ``R_K`` tile load and split per ``QB`` sequences; a row's sum does not depend on the other
    rows, so ``QB`` does not change a bit)."""
    rows = tl.arange(0, GP)
    cols = tl.arange(0, D)
    seq = b * QB + rows // GROUP
    head = h * GROUP + rows % GROUP
    ok = ((rows < QB * GROUP) & (seq < n_seq))[:, None]
    seq64 = seq.to(tl.int64)
    q32 = tl.load(q_ptr + seq64[:, None] * stride_qb + head[:, None] * stride_qh + cols[None, :], mask=ok,
                  other=0.0).to(tl.float32)
    r = tl.load(r_ptr + h * stride_rh + cols[:, None] * D + e[None, :])
    qr = tl.dot(q32, r, input_precision=PREC) * qk_scale
    ptrs = out_ptr + seq64[:, None] * stride_ob + head[:, None] * stride_oh + e[None, :]
    tl.store(ptrs, qr.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["n_seq"])  # B: no recompile per batch size's 1 / 16k / other class
def _rotate_q_kernel(
    q_ptr, stride_qb, stride_qh,  # q [B, H_q, D] act dtype
    r_ptr, stride_rh,  # R_K [H_r, D, D] float32 (stride 0: shared)
    out_ptr, stride_ob, stride_oh,  # q_rot [B, H_q, D] act dtype
    qk_scale,  # softmax scale * log2(e)
    n_seq,  # B
    H_KV: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_E: tl.constexpr,
    PREC: tl.constexpr, PDL: tl.constexpr, QB: tl.constexpr = 1,
):
    """``q_rot[:, e] = (q @ R_K[:, e]) * qk_scale`` for the ``g`` query heads of one KV head, ``QB`` sequences and
    output columns ``[e0, e0 + BLOCK_E)`` (:func:`rotate_q_tile`). Grid: ``(cdiv(B, QB) * H_kv, D / BLOCK_E)``.
    ``PDL``: let stage 1 (a programmatic dependent launch) start right away; it waits for this grid with
    ``griddepcontrol.wait`` before reading ``q_rot``."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    rotate_q_tile(q_ptr, stride_qb, stride_qh, r_ptr, stride_rh, out_ptr, stride_ob, stride_oh, qk_scale,
                  pid // H_KV, pid % H_KV, e, n_seq, GROUP=GROUP, GP=GP, D=D, PREC=PREC, QB=QB)


@triton.jit
def _load_qt(q_ptr, b, h, stride_qb, stride_qh, J: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr,
             D: tl.constexpr):
    """Quarter ``J`` of the rotated queries of KV head ``h``, transposed: ``[D/4, GP]`` (pad columns 0)."""
    heads = tl.arange(0, GP)
    ptrs = (q_ptr + b * stride_qb + (h * GROUP + heads)[None, :] * stride_qh
            + (J * (D // 4) + tl.arange(0, D // 4))[:, None])
    return tl.load(ptrs, mask=(heads < GROUP)[None, :], other=0.0)


@triton.jit
def _store_partial_t(ot, lse, op_ptr, lse_ptr, b, h, sp, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                     GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr):
    """Write ``oᵀ [D, GP]`` (float32) and ``lse [GP]`` as partial ``sp`` of the ``g`` heads of KV head ``h``."""
    heads = tl.arange(0, GP)
    ok = heads < GROUP
    base = op_ptr + b * stride_ob + (h * GROUP + heads)[None, :] * stride_oh + sp * stride_os
    tl.store(base + tl.arange(0, D)[:, None], ot, mask=ok[None, :])
    tl.store(lse_ptr + b * stride_lb + (h * GROUP + heads) * stride_lh + sp, lse, mask=ok)



@triton.jit
def _field_dots(kb, q0, q1, q2, q3, PTX: tl.constexpr):
    """``C_K·qᵀ`` for the K code bytes ``kb`` ``[M, D/4]`` in the field scaling (float32 ``[M, GP]``): one dot per
    field, the whole byte ``c0 + 4c1 + 16c2 + 64c3`` as the top field, ``q0..q2`` carrying ``- q3``."""
    w = _spread(kb, PTX)
    raw = tl.dot(_field(w, 0, PTX), q0)
    raw = tl.dot(_field(w, 1, PTX), q1, raw)
    raw = tl.dot(_field(w, 2, PTX), q2, raw)
    raw = tl.dot(_top_field(w), q3, raw)
    return raw


@triton.jit
def _residue_scores(q0, q1, q2, q3, qsum, kmul, ks, kz, kc_ptr, kbase, koff, valid, lo_ptr, lrow,
                    D: tl.constexpr, PTX: tl.constexpr, MASKED: tl.constexpr, HAS_LO: tl.constexpr):
    """Scoresᵀ ``[NQ, GP]`` (log2 domain) of one token residue: K rows at ``kbase + koff`` (``[NQ]`` each), K
    scales ``ks`` and zeros ``kz`` (float32 ``[NQ]``); ``HAS_LO``: INT4 keys, the low plane's rows at
    ``lo_ptr + lrow`` (``[NQ]`` element offsets), worth a quarter of the stored scale per code.

    ``q0..q3`` are the fp16 field operands (see :func:`_int2_split`); ``kmul`` undoes their power of two and the
    fields' ``2^-24``."""
    kptr = kc_ptr + (kbase + koff * (D // 4))[:, None] + tl.arange(0, D // 4)[None, :]
    if MASKED:
        kb = tl.load(kptr, mask=valid[:, None], other=0)
    else:
        kb = tl.load(kptr)
    raw = _field_dots(kb, q0, q1, q2, q3, PTX)
    if HAS_LO:  # formula 9: zero + hi·scale + lo·scale/4
        lptr = lo_ptr + lrow[:, None] + tl.arange(0, D // 4)[None, :]
        if MASKED:
            lb = tl.load(lptr, mask=valid[:, None], other=0)
        else:
            lb = tl.load(lptr)
        raw += _field_dots(lb, q0, q1, q2, q3, PTX) * 0.25
    s = raw * (ks * kmul)[:, None] + kz[:, None] * qsum[None, :]
    if MASKED:
        s = tl.where(valid[:, None], s, float("-inf"))
    return s


@triton.jit
def _tile_meta(ptr, mbase, koff, n0, quad, end, MASKED: tl.constexpr, META8: tl.constexpr = False):
    """One metadata array (scale or zero) of a tile as its four token residues (float32 ``[NQ]`` each), loaded
    as one ``[NQ, 4]`` tile of consecutive tokens (wide enough for the loop pipeliner's asynchronous copies, where
    per-residue ``[NQ]`` loads would be 2-byte loads whose latency every tile waits for). ``META8``: formula 10's
    bytes, returned as int32 for :func:`meta8_decode` (1: as that byte tile; 2: each quad's four bytes as one
    32-bit word, the metadata on 4-byte boundaries)."""
    NQ: tl.constexpr = quad.shape[0]
    if META8 == 2:  # a quad's four bytes as one 32-bit word (a [NQ, 4] byte tile is 2 bytes a thread, which the
        # loop pipeliner leaves as synchronous loads: DecodeConfig.meta_words)
        wptr = (ptr + mbase + koff).to(tl.pointer_type(tl.int32), bitcast=True)
        if MASKED:
            w = tl.load(wptr, mask=(n0 + quad) < end, other=0)
        else:
            w = tl.load(wptr)
        r0, r1, r2, r3 = w & 255, (w >> 8) & 255, (w >> 16) & 255, (w >> 24) & 255
        if MASKED:  # a quad that starts before the end is loaded whole: its bytes past the end read as 0, as the
            # element-masked loads do (stale bytes there would reach the tile's value scale f_new)
            r1 = tl.where(n0 + quad + 1 < end, r1, 0)
            r2 = tl.where(n0 + quad + 2 < end, r2, 0)
            r3 = tl.where(n0 + quad + 3 < end, r3, 0)
    else:
        offs = (mbase + koff)[:, None] + tl.arange(0, 4)[None, :]
        if MASKED:
            x = tl.load(ptr + offs, mask=(n0 + quad[:, None] + tl.arange(0, 4)[None, :]) < end, other=0)
        else:
            x = tl.load(ptr + offs)
        if META8:
            x = x.to(tl.int32)
        else:
            x = x.to(tl.float32)
        even, odd = tl.split(tl.reshape(x, [NQ, 2, 2]))  # residues (0, 2) and (1, 3)
        r0, r2 = tl.split(even)
        r1, r3 = tl.split(odd)
    return r0, r1, r2, r3



@triton.jit
def _tile_bias(bias_ptr, bbase, stride_bh, n0, quad, end, GROUP: tl.constexpr, GP: tl.constexpr,
               MASKED: tl.constexpr):
    """The per-key logit bias of a tile's tokens ``[n0, n0 + BLOCK_N)`` for the ``g`` query heads, as its four token
    residues (float32 ``[NQ, GP]`` each, times ``log2(e)``: the scores' domain), loaded as one ``[NQ, 4, GP]``
    tile of consecutive tokens (pad heads 0)."""
    NQ: tl.constexpr = quad.shape[0]
    heads = tl.arange(0, GP)
    tok = n0 + quad[:, None, None] + tl.arange(0, 4)[None, :, None]
    ptrs = bias_ptr + bbase + tok + (heads * stride_bh)[None, None, :]
    ok = (heads < GROUP)[None, None, :]
    if MASKED:
        ok = ok & (tok < end)
    x = tl.load(ptrs, mask=ok, other=0.0) * 1.4426950408889634
    x = tl.reshape(tl.permute(x, (0, 2, 1)), [NQ, GP, 2, 2])  # [.., a, c]: residue 2a + c
    even, odd = tl.split(x)  # residues (0, 2) and (1, 3)
    r0, r2 = tl.split(even)
    r1, r3 = tl.split(odd)
    return r0, r1, r2, r3


@triton.jit
def _rope_residue(ca, cb, tc, ts, rt_ptr, p, D: tl.constexpr, PREC: tl.constexpr):
    """The position-dependent key mean's term (log2 domain) of the tokens at positions ``p + 4i`` (``i < NQ``): the
    coefficients ``[A | B]`` (``ca``, ``cb``: float32 ``[D/2, GP]``) rotated by the table's row ``p`` (angle
    addition), times the rows ``[cos θ4i | sin θ4i]`` (``tc``, ``ts``: ``[NQ, D/2]``) -> ``[NQ, GP]``."""
    half = tl.arange(0, D // 2)
    row = rt_ptr + p.to(tl.int64) * D
    c = tl.load(row + half)[:, None]
    s = tl.load(row + D // 2 + half)[:, None]
    a = ca * c + cb * s
    b = cb * c - ca * s
    if PREC == "fp16":  # one fp16 MMA per half: the coefficients times the program's power of two (folded into
        # ca, cb, undone by the caller), the table rows as fp16
        return tl.dot(tc, a.to(tl.float16)) + tl.dot(ts, b.to(tl.float16))
    else:
        return tl.dot(tc, a, input_precision=PREC) + tl.dot(ts, b, input_precision=PREC)


@triton.jit
def _tile_rope(ca, cb, rt_ptr, rl_ptr, p0, NQ: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr):
    """The term of a tile's four token residues (float32 ``[NQ, GP]`` each) whose first token sits at position
    ``p0``: residue ``j`` holds positions ``p0 + j + 4i``. ``rl_ptr``: the rows ``[cos θr | sin θr]``,
    ``r < 4·NQ``, as fp16 ``[4·NQ, D]`` (``PREC == "fp16"``: the coefficients are rotated once, by ``p0``, and
    residue ``j`` takes rows ``4i + j``; else they are rotated per residue and read rows ``4i`` of the table)."""
    half = tl.arange(0, D // 2)
    if PREC == "fp16":
        row = rt_ptr + p0.to(tl.int64) * D
        c = tl.load(row + half)[:, None]
        s = tl.load(row + D // 2 + half)[:, None]
        a = (ca * c + cb * s).to(tl.float16)
        b = (cb * c - ca * s).to(tl.float16)
        lrows = (4 * tl.arange(0, NQ))[:, None] * D + half[None, :]
        r0 = tl.dot(tl.load(rl_ptr + lrows), a) + tl.dot(tl.load(rl_ptr + lrows + D // 2), b)
        r1 = tl.dot(tl.load(rl_ptr + lrows + D), a) + tl.dot(tl.load(rl_ptr + lrows + D + D // 2), b)
        r2 = tl.dot(tl.load(rl_ptr + lrows + 2 * D), a) + tl.dot(tl.load(rl_ptr + lrows + 2 * D + D // 2), b)
        r3 = tl.dot(tl.load(rl_ptr + lrows + 3 * D), a) + tl.dot(tl.load(rl_ptr + lrows + 3 * D + D // 2), b)
    else:
        rows = (4 * tl.arange(0, NQ))[:, None] * D
        tc = tl.load(rt_ptr + rows + half[None, :])
        ts = tl.load(rt_ptr + rows + D // 2 + half[None, :])
        r0 = _rope_residue(ca, cb, tc, ts, rt_ptr, p0, D, PREC)
        r1 = _rope_residue(ca, cb, tc, ts, rt_ptr, p0 + 1, D, PREC)
        r2 = _rope_residue(ca, cb, tc, ts, rt_ptr, p0 + 2, D, PREC)
        r3 = _rope_residue(ca, cb, tc, ts, rt_ptr, p0 + 3, D, PREC)
    return r0, r1, r2, r3


@triton.jit
def _rope_coefficients(rq_ptr, stride_rqb, stride_rqh, rm_ptr, stride_rmh, b, h, rope_scale,
                       GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr):
    """``A``, ``B`` (float32 ``[D/2, GP]``, pad heads 0) of the ``g`` query heads of KV head ``h``:
    ``A_k = c·(q_k m_k + q_{k+D/2} m_{k+D/2})``, ``B_k = c·(q_{k+D/2} m_k - q_k m_{k+D/2})`` with ``c =
    rope_scale`` (the rotary embedding's attention scaling times the softmax scale times ``log2(e)``)."""
    heads = tl.arange(0, GP)
    half = tl.arange(0, D // 2)
    base = rq_ptr + b.to(tl.int64) * stride_rqb + (h * GROUP + heads)[None, :] * stride_rqh + half[:, None]
    ok = (heads < GROUP)[None, :]
    qa = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    qb = tl.load(base + D // 2, mask=ok, other=0.0).to(tl.float32)
    ma = tl.load(rm_ptr + h * stride_rmh + half)[:, None] * rope_scale
    mb = tl.load(rm_ptr + h * stride_rmh + D // 2 + half)[:, None] * rope_scale
    return qa * ma + qb * mb, qb * ma - qa * mb


@triton.jit
def _part_range(n, part, parts, BLOCK: tl.constexpr):
    """Rows ``[start, end)`` of range ``part`` when ``n`` rows are cut into ``parts`` ranges of whole ``BLOCK``-row
    tiles (the INT2 splits and the BF16 tier ranges; trailing ranges may be empty: ``start >= end``)."""
    chunk = tl.cdiv(tl.cdiv(n, parts), BLOCK) * BLOCK
    start = part * chunk
    return start, tl.minimum(start + chunk, n)


_ASM_PREFETCH_L2 = tl.constexpr("prefetch.global.L2 [$1];\nmov.u32 $0, 0;")


@triton.jit
def _prefetch_l2(ptrs):
    """A hint: fetch the cache lines holding ``ptrs`` (any shape) into L2; no result, no fault (CUDA only)."""
    tl.inline_asm_elementwise(_ASM_PREFETCH_L2, "=r,l", [ptrs.to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_first_tile(b, h, sp, num_splits, kc_ptr, stride_kp, stride_kh, vc_ptr, stride_vp, stride_vh,
                         ks_ptr, kz_ptr, vs_ptr, vz_ptr, stride_mp, stride_mh, bt_ptr, stride_btb,
                         hist_len_ptr, D: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
                         PAGE: tl.constexpr, VROW: tl.constexpr):
    """Start the DRAM -> L2 transfer of the first tile of INT2 split ``sp`` (K rows, V token-quad rows, the four
    metadata rows) before stage 1 waits for the q rotation (``PREFETCH``): at short contexts that tile is all the
    split reads, and its DRAM latency then overlaps the rotation kernel. Tokens past the split's end are clamped to
    its last token (no address outside the cache)."""
    length = tl.load(hist_len_ptr + b)
    start, end = _part_range(length, sp, num_splits, BLOCK_N)
    if start < end:
        NQ: tl.constexpr = BLOCK_N // 4
        quad = tl.minimum(4 * tl.arange(0, NQ), end - 1 - start)
        kb_j, mb_j, vbase, koff = _tile_addrs(start, end, b, h, quad, stride_kp, stride_kh, stride_vp, stride_vh,
                                              stride_mp, stride_mh, bt_ptr, stride_btb, D, BLOCK_N, PAGED, PAGE,
                                              VROW)
        _prefetch_l2(kc_ptr + kb_j + koff * (D // 4))  # one pointer per 4 rows of D/4 bytes
        # per V row, the first quad of each 16-token group (one page: pages are multiples of 16 tokens), groups past
        # the end replaced by the tile's first quad
        vgrp = tl.min(tl.reshape(vbase, [4, NQ // 4]), 1)
        vgrp = tl.where(start + (BLOCK_N // 4) * tl.arange(0, 4) < end, vgrp, tl.min(vbase, 0))
        _prefetch_l2(vc_ptr + tl.reshape(vgrp[None, :] + tl.arange(0, D)[:, None] * VROW, [4 * D]))
        _prefetch_l2(ks_ptr + mb_j + koff)
        _prefetch_l2(kz_ptr + mb_j + koff)
        _prefetch_l2(vs_ptr + mb_j + koff)
        _prefetch_l2(vz_ptr + mb_j + koff)


@triton.jit
def _prefetch_tier_rows(b, h, part, sk_ptr, sv_ptr, stride_sb, stride_sh, stride_st, sink_len_ptr,
                        rk2_ptr, rv2_ptr, stride_rb, stride_rh, stride_rt, recent_len_ptr,
                        D: tl.constexpr, BLOCK_NB: tl.constexpr, TIER_PARTS: tl.constexpr,
                        rows_ptr, ridx_ptr, stride_ib, DIRECT: tl.constexpr):
    """Start the DRAM -> L2 transfer of the BF16 rows (K and V) of tier range ``part`` (see :func:`_bf16_tiers`)
    before stage 1 waits for the q rotation (``PREFETCH``). ``DIRECT``: the rows where the backend keeps them, through
    ``rows[b]`` and ``ring_index[b]`` (the step's metadata, written before the layer's launches: safe to read before
    the wait; a ring row the previous launch is writing is only fetched early, L2 being where its writes land)."""
    n_sink = tl.load(sink_len_ptr + b)
    n_all = n_sink + tl.load(recent_len_ptr + b)
    start, end = _part_range(n_all, part, TIER_PARTS, BLOCK_NB)
    lines = tl.arange(0, (D * 2 + 127) // 128) * 64  # one pointer per 128-byte line of a row (2-byte elements)
    if DIRECT:
        row = tl.load(rows_ptr + b).to(tl.int64)
    else:
        row = b.to(tl.int64)
    for t0 in range(start, end, BLOCK_NB):
        t = tl.minimum(t0 + tl.arange(0, BLOCK_NB), end - 1)
        in_sink = t < n_sink
        srow = tl.where(in_sink, t, 0)
        rrow = tl.where(in_sink, 0, t - n_sink)
        if DIRECT:
            rrow = tl.load(ridx_ptr + b.to(tl.int64) * stride_ib + rrow)
        soff = row * stride_sb + h * stride_sh + srow * stride_st
        roff = row * stride_rb + h * stride_rh + rrow * stride_rt
        off = tl.where(in_sink, soff, roff)[:, None] + lines[None, :]
        kp = tl.where(in_sink[:, None], sk_ptr + off, rk2_ptr + off)
        vp = tl.where(in_sink[:, None], sv_ptr + off, rv2_ptr + off)
        _prefetch_l2(tl.reshape(kp, [BLOCK_NB * lines.shape[0]]))
        _prefetch_l2(tl.reshape(vp, [BLOCK_NB * lines.shape[0]]))


@triton.jit
def _vquad_cols(tile, D: tl.constexpr, BLOCK_N: tl.constexpr, VROW: tl.constexpr):
    """Byte offsets (in dim row 0 of a page or non-paged sequence) of the token quads of the tile that starts at token
    ``tile·BLOCK_N``: rows of ``R = 4·VROW`` tokens, row ``i·D + d`` at ``(i·D + d)·VROW`` (``[BLOCK_N/4]``)."""
    NQ: tl.constexpr = BLOCK_N // 4
    R: tl.constexpr = 4 * VROW
    if R % BLOCK_N == 0:  # the tile lies in one row: contiguous, NQ-aligned bytes (the compiler vectorises them)
        TPR: tl.constexpr = R // BLOCK_N
        return (tile // TPR) * (D * VROW) + (tile % TPR) * NQ + tl.arange(0, NQ)
    else:
        t = tile * BLOCK_N + 4 * tl.arange(0, NQ)
        return (t // R) * (D * VROW) + (t % R) // 4


@triton.jit
def _tile_addrs(n0, end, b, h, quad, stride_kp, stride_kh, stride_vp, stride_vh, stride_mp, stride_mh,
                bt_ptr, stride_btb, D: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
                VROW: tl.constexpr):
    """Element offsets of the tile of tokens ``[n0, n0 + BLOCK_N)`` of (batch ``b``, KV head ``h``): ``kb_j`` (K page
    + head), ``mb_j`` (metadata page + head), ``vbase`` (V token-quad byte of each quad in dim row 0, ``[NQ]``; dim
    ``d`` adds ``d·VROW``) and ``koff`` (row of each quad's first token in its page, ``[NQ]``); ``quad = 4 *
    arange(NQ)``. Paged with tiles inside a page: one block-table entry per tile; paged otherwise: one per quad
    (quads never straddle pages, ``P % 4 == 0``; such pages are one token-quad row; the loop itself takes one per page
    where pages divide the tile, :func:`_int2_tile`); non-paged: one "page" of T rows per sequence, token-quad rows
    of 64 tokens."""
    if PAGED and PAGE % BLOCK_N == 0:  # a tile never straddles a page (tiles start at multiples of BLOCK_N)
        page = tl.load(bt_ptr + b * stride_btb + n0 // PAGE).to(tl.int64)
        kb_j = page * stride_kp + h * stride_kh
        mb_j = page * stride_mp + h * stride_mh
        tile = (n0 % PAGE) // BLOCK_N
        vbase = page * stride_vp + h * stride_vh + _vquad_cols(tile, D, BLOCK_N, VROW)
        koff = tile * BLOCK_N + quad
    elif PAGED:
        qpage = tl.load(bt_ptr + b * stride_btb + (n0 + quad) // PAGE, mask=n0 + quad < end,
                        other=0).to(tl.int64)
        vbase = qpage * stride_vp + h * stride_vh + ((n0 + quad) % PAGE) // 4
        koff = (n0 + quad) % PAGE
        kb_j = qpage * stride_kp + h * stride_kh
        mb_j = qpage * stride_mp + h * stride_mh
    else:
        kb_j = b.to(tl.int64) * stride_kp + h * stride_kh
        mb_j = b.to(tl.int64) * stride_mp + h * stride_mh
        vbase = b.to(tl.int64) * stride_vp + h * stride_vh + _vquad_cols(n0 // BLOCK_N, D, BLOCK_N, VROW)
        koff = n0 + quad
    return kb_j, mb_j, vbase, koff


@triton.jit
def _small_page_v_tile(page, h, vc_ptr, stride_vp, stride_vh, D: tl.constexpr, BLOCK_N: tl.constexpr,
                       PAGE: tl.constexpr, valid, MASKED: tl.constexpr):
    """The ``[D, BLOCK_N/4]`` V token-quad tile over pages smaller than the tile (``page``: the tile's
    ``[BLOCK_N/P]`` block-table entries, ``valid``: which of them hold tokens): each page's contiguous ``[D, P/4]``
    block loaded as rows of 16 bytes (16-byte asynchronous copies; per-quad addresses were byte loads waited for in
    the loop, ``[D, pages, P/4]`` 4- or 8-byte copies), then rearranged to ``[D, pages·P/4]`` in registers; pages of
    64 tokens (under tiles of 128) need no rearranging: ``[D, pages, 16]``."""
    PPT: tl.constexpr = BLOCK_N // PAGE
    QPP: tl.constexpr = PAGE // 4
    base = page * stride_vp + h * stride_vh
    if QPP >= 16:  # pages of 64 tokens: every dim row of a page is 16 bytes already, loaded as [D, pages, 16]
        vptr = vc_ptr + base[None, :, None] + (tl.arange(0, D) * QPP)[:, None, None] + tl.arange(0, QPP)[None, None, :]
        ok = valid[None, :, None]
    else:  # a page's [D, P/4] block as rows of 16 bytes, rearranged below
        RW: tl.constexpr = D * QPP // 16
        vptr = vc_ptr + base[:, None, None] + (tl.arange(0, RW) * 16)[None, :, None] + tl.arange(0, 16)[None, None, :]
        ok = valid[:, None, None]
    if MASKED:
        vt = tl.load(vptr, mask=ok, other=0)
    else:
        vt = tl.load(vptr)
    if QPP < 16:
        vt = tl.permute(tl.reshape(vt, [PPT, D, QPP]), (1, 0, 2))
    return tl.reshape(vt, [D, BLOCK_N // 4])




@triton.jit
def _int2_tile(
    n0, end, b, h, q0, q1, q2, q3, qsum, kmul, m_i, l_i, acc, accm, fv,
    kc_ptr, stride_kp, stride_kh, vc_ptr, stride_vp, stride_vh,
    ks_ptr, kz_ptr, vs_ptr, vz_ptr, stride_mp, stride_mh, bt_ptr, stride_btb, bias_ptr, bbase, stride_bh,
    ca, cb, rinv, rt_ptr, rl_ptr, rpos, lo_ptr, lbase,
    GROUP: tl.constexpr, GP: tl.constexpr,
    D: tl.constexpr, BLOCK_N: tl.constexpr, PTX: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
    VROW: tl.constexpr, MASKED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ROPE: tl.constexpr,
    ROPE_PREC: tl.constexpr, HAS_LO: tl.constexpr, META8: tl.constexpr,
):
    """One tile of ``BLOCK_N`` history tokens ``[n0, n0 + BLOCK_N)`` as four residues (see :func:`_int2_split`);
    ``MASKED``: the tile may run past ``end`` (the last tile of a split), else every token is valid.

    ``acc`` holds ``fv * 2^-24`` times the value sum; ``fv`` is a power of two chosen per tile so that
    the fp16 operand ``p * s_v * fv * 4^-j`` stays below ``2^14`` (``p <= 1``)."""
    NQ: tl.constexpr = BLOCK_N // 4
    quad = 4 * tl.arange(0, NQ)  # first token of each quad, relative to the tile
    dims = tl.arange(0, D)
    ok0 = n0 + quad < end  # used only when MASKED
    ok1 = n0 + quad + 1 < end
    ok2 = n0 + quad + 2 < end
    ok3 = n0 + quad + 3 < end
    if PAGED and PAGE < BLOCK_N and BLOCK_N % PAGE == 0:  # other small pages (e.g. 48): per-quad addresses below
        # one block-table entry per page, shared by K, metadata and V (a per-quad [NQ] entry load, pipelined, was
        # copied to a misaligned shared-memory address at D = 64, pages of 64, tiles of 128 on the H200, Triton 3.6)
        PPT: tl.constexpr = BLOCK_N // PAGE
        pg = tl.arange(0, PPT)
        has = n0 + pg * PAGE < end  # pages holding tokens of the split
        pages = tl.load(bt_ptr + b * stride_btb + n0 // PAGE + pg, mask=has, other=0).to(tl.int64)
        qpage = tl.reshape(tl.broadcast_to(pages[:, None], [PPT, PAGE // 4]), [NQ])
        kb_j = qpage * stride_kp + h * stride_kh
        mb_j = qpage * stride_mp + h * stride_mh
        koff = quad % PAGE  # n0 is a multiple of the tile, so of the page
        vt = _small_page_v_tile(pages, h, vc_ptr, stride_vp, stride_vh, D, BLOCK_N, PAGE, has, MASKED)
    else:
        kb_j, mb_j, vbase, koff = _tile_addrs(n0, end, b, h, quad, stride_kp, stride_kh, stride_vp, stride_vh,
                                              stride_mp, stride_mh, bt_ptr, stride_btb, D, BLOCK_N, PAGED, PAGE, VROW)
        vptr = vc_ptr + vbase[None, :] + dims[:, None] * VROW  # [D, NQ] token-quad bytes (constexpr row stride)
        if MASKED:
            vt = tl.load(vptr, mask=ok0[None, :], other=0)
        else:
            vt = tl.load(vptr)
    # metadata as [NQ, 4] tiles (pipelined copies), split into the four residues
    ks0, ks1, ks2, ks3 = _tile_meta(ks_ptr, mb_j, koff, n0, quad, end, MASKED, META8)
    kz0, kz1, kz2, kz3 = _tile_meta(kz_ptr, mb_j, koff, n0, quad, end, MASKED, META8)
    vs0, vs1, vs2, vs3 = _tile_meta(vs_ptr, mb_j, koff, n0, quad, end, MASKED, META8)
    vz0, vz1, vz2, vz3 = _tile_meta(vz_ptr, mb_j, koff, n0, quad, end, MASKED, META8)
    if META8:  # formula 10: decode the bytes (exact; a masked token's bytes 0 decode to finite values)
        ks0, kz0 = meta8_decode(ks0, kz0)
        ks1, kz1 = meta8_decode(ks1, kz1)
        ks2, kz2 = meta8_decode(ks2, kz2)
        ks3, kz3 = meta8_decode(ks3, kz3)
        vs0, vz0 = meta8_decode(vs0, vz0)
        vs1, vz1 = meta8_decode(vs1, vz1)
        vs2, vz2 = meta8_decode(vs2, vz2)
        vs3, vz3 = meta8_decode(vs3, vz3)
    if HAS_LO == 2:  # paged low plane: the key rows' own offsets
        lrow = kb_j + koff * (D // 4)
    elif HAS_LO:  # the low plane's row of each quad's first token
        lrow = lbase + (n0 + quad).to(tl.int64) * (D // 4)
    else:
        lrow = quad
    s0 = _residue_scores(q0, q1, q2, q3, qsum, kmul, ks0, kz0, kc_ptr, kb_j, koff, ok0, lo_ptr, lrow,
                         D, PTX, MASKED, HAS_LO)
    s1 = _residue_scores(q0, q1, q2, q3, qsum, kmul, ks1, kz1, kc_ptr, kb_j, koff + 1, ok1, lo_ptr, lrow + D // 4,
                         D, PTX, MASKED, HAS_LO)
    s2 = _residue_scores(q0, q1, q2, q3, qsum, kmul, ks2, kz2, kc_ptr, kb_j, koff + 2, ok2, lo_ptr, lrow + D // 2,
                         D, PTX, MASKED, HAS_LO)
    s3 = _residue_scores(q0, q1, q2, q3, qsum, kmul, ks3, kz3, kc_ptr, kb_j, koff + 3, ok3, lo_ptr,
                         lrow + 3 * (D // 4), D, PTX, MASKED, HAS_LO)
    if HAS_BIAS:  # a per-key logit term (masked tokens stay -inf)
        b0, b1, b2, b3 = _tile_bias(bias_ptr, bbase, stride_bh, n0, quad, end, GROUP, GP, MASKED)
        s0 += b0
        s1 += b1
        s2 += b2
        s3 += b3
    if HAS_ROPE:  # the position-dependent key mean's term, from the position of the tile's first token
        t0, t1, t2, t3 = _tile_rope(ca, cb, rt_ptr, rl_ptr, rpos + n0, NQ, D, ROPE_PREC)
        s0 += t0 * rinv
        s1 += t1 * rinv
        s2 += t2 * rinv
        s3 += t3 * rinv
    # one cross-lane reduction per tile and quantity: the four residues are combined elementwise first
    m_new = tl.maximum(m_i, tl.max(tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3)), 0))
    alpha = tl.exp2(m_i - m_new)
    p0 = tl.exp2(s0 - m_new[None, :])
    p1 = tl.exp2(s1 - m_new[None, :])
    p2 = tl.exp2(s2 - m_new[None, :])
    p3 = tl.exp2(s3 - m_new[None, :])
    l_i = l_i * alpha + tl.sum((p0 + p1) + (p2 + p3), 0)
    f_new = _pow2_scale(tl.max(tl.maximum(tl.maximum(vs0, vs1), tl.maximum(vs2, vs3)), 0))
    accm = accm * alpha + tl.sum((p0 * vz0[:, None] + p1 * vz1[:, None])
                                 + (p2 * vz2[:, None] + p3 * vz3[:, None]), 0)
    acc = acc * (alpha * (f_new / fv))[None, :]
    w = _spread(vt, PTX)
    u3 = p3 * (vs3 * (f_new * 0.015625))[:, None]  # the whole byte's operand; residues 0..2 carry "- u3"
    acc = tl.dot(_field(w, 0, PTX), (p0 * (vs0 * f_new)[:, None] - u3).to(tl.float16), acc)
    acc = tl.dot(_field(w, 1, PTX), (p1 * (vs1 * (f_new * 0.25))[:, None] - u3).to(tl.float16), acc)
    acc = tl.dot(_field(w, 2, PTX), (p2 * (vs2 * (f_new * 0.0625))[:, None] - u3).to(tl.float16), acc)
    acc = tl.dot(_top_field(w), u3.to(tl.float16), acc)
    return m_new, l_i, acc, accm, f_new


@triton.jit
def _int2_split(
    b, h, sp, num_splits,
    q_ptr, stride_qb, stride_qh,  # q_rot [B, H_q, D] (scaled, log2 domain)
    kc_ptr, stride_kp, stride_kh,  # K codes [pages, H_kv, P, D/4] uint8 (quarter packing, rows contiguous)
    vc_ptr, stride_vp, stride_vh,  # V codes [pages, H_kv, P/R·D, R/4] uint8 (token quads, rows of VROW bytes)
    ks_ptr, kz_ptr, vs_ptr, vz_ptr, stride_mp, stride_mh,  # meta [pages, H_kv, P], contiguous along P
    bt_ptr, stride_btb, hist_len_ptr,  # block table [B, max_pages] int32, lengths [B] int32
    bias_ptr, stride_bb, stride_bh,  # per-key logit bias [B, H_q, L] float32 (natural units); unused without
    rq_ptr, stride_rqb, stride_rqh, rm_ptr, stride_rmh, rt_ptr, rl_ptr, rpos_ptr, rope_scale,  # HAS_ROPE (stage 1)
    lo_ptr, stride_lob, stride_loh, lo_first_ptr,  # HAS_LO: INT4 keys' low plane [B, H_kv, C, D/4], first slot [B]
    op_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,  # partials
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    PTX: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, VROW: tl.constexpr, HIST_STAGES: tl.constexpr,
    HOIST_Q: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ROPE: tl.constexpr, ROPE_PREC: tl.constexpr,
    HAS_LO: tl.constexpr, META8: tl.constexpr,
):
    """One split of the INT2 history for one (batch, KV head); writes partial ``sp``.

    Transposed form: the tokens are the MMA's M dimension and the ``g`` query heads its N (padded to ``GP``):
    ``Sᵀ = C_K·qᵀ`` and ``Oᵀ += C_Vᵀ·(P∘s_V)ᵀ``. A tile of ``BLOCK_N`` tokens is handled as four residues
    ``j`` (tokens ``n0 + 4i + j``): bits ``2j`` of the token-quad V bytes hold exactly residue ``j``, so every
    unpacked register pairs two consecutive reduction-axis elements of its MMA operand (dims for K, tokens for
    V) and no operand is transposed through shared memory.
    """
    q0 = _load_qt(q_ptr, b, h, stride_qb, stride_qh, 0, GROUP, GP, D)
    q1 = _load_qt(q_ptr, b, h, stride_qb, stride_qh, 1, GROUP, GP, D)
    q2 = _load_qt(q_ptr, b, h, stride_qb, stride_qh, 2, GROUP, GP, D)
    q3 = _load_qt(q_ptr, b, h, stride_qb, stride_qh, 3, GROUP, GP, D)
    qsum = (tl.sum(q0.to(tl.float32), 0) + tl.sum(q1.to(tl.float32), 0)
            + tl.sum(q2.to(tl.float32), 0) + tl.sum(q3.to(tl.float32), 0))
    # fp16 operands for the subnormal fields: x_J = q_J * 4^-J * qs with |q * qs| <= 2^14; the whole byte as the
    # top field takes x_3, fields 0..2 take x_J - x_3
    qmax = tl.maximum(tl.maximum(tl.max(tl.max(tl.abs(q0.to(tl.float32)), 1), 0),
                                 tl.max(tl.max(tl.abs(q1.to(tl.float32)), 1), 0)),
                      tl.maximum(tl.max(tl.max(tl.abs(q2.to(tl.float32)), 1), 0),
                                 tl.max(tl.max(tl.abs(q3.to(tl.float32)), 1), 0)))
    qs = _pow2_scale(qmax)
    kmul = 16777216.0 / qs
    x3 = q3.to(tl.float32) * (qs * 0.015625)
    q0 = (q0.to(tl.float32) * qs - x3).to(tl.float16)
    q1 = (q1.to(tl.float32) * (qs * 0.25) - x3).to(tl.float16)
    q2 = (q2.to(tl.float32) * (qs * 0.0625) - x3).to(tl.float16)
    q3 = x3.to(tl.float16)
    if HOIST_Q:
        # Triton re-lays out the loop-invariant q operands into the MMA operand layout inside the loop, every
        # tile (16 SHFL + 16 SEL). The same dots on a K tile loaded before the loop put that conversion outside
        # it, and the compiler then reuses it in the loop. The tile's mask is never true (sp < num_splits in an
        # INT2 program: no memory traffic, zeros), so the dots give exactly 0 and qsum is unchanged.
        rows = tl.arange(0, BLOCK_N // 4)
        kb0 = tl.load(kc_ptr + rows[:, None] * (D // 4) + tl.arange(0, D // 4)[None, :],
                      mask=(rows < sp - num_splits)[:, None], other=0)
        qsum += tl.max(_field_dots(kb0, q0, q1, q2, q3, PTX), 0)

    length = tl.load(hist_len_ptr + b)
    start, end = _part_range(length, sp, num_splits, BLOCK_N)
    bbase = b.to(tl.int64) * stride_bb + (h * GROUP) * stride_bh
    if HAS_ROPE:
        ca, cb = _rope_coefficients(rq_ptr, stride_rqb, stride_rqh, rm_ptr, stride_rmh, b, h, rope_scale, GROUP, GP, D)
        rpos = tl.load(rpos_ptr + b)
        if ROPE_PREC == "fp16":  # |A cos + B sin| <= |A| + |B| at every position: one power of two per program
            rf = _pow2_scale(tl.max(tl.max(tl.abs(ca) + tl.abs(cb), 1), 0))
            ca = ca * rf
            cb = cb * rf
            rinv = 1.0 / rf
        else:
            rinv = 1.0
    else:
        ca, cb, rpos, rinv = 0.0, 0.0, 0, 1.0
    if HAS_LO == 1:  # history token n of this row is low-plane slot first[b] + n
        lbase = (b.to(tl.int64) * stride_lob + h * stride_loh
                 + tl.load(lo_first_ptr + b).to(tl.int64) * (D // 4))
    else:
        lbase = 0
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    accm = tl.zeros([GP], tl.float32)
    acc = tl.zeros([D, GP], tl.float32)
    fv = 1.0  # acc is in units of fv * 2^-24 (see _int2_tile)
    full_end = start + ((end - start) // BLOCK_N) * BLOCK_N  # whole tiles: no masks; then one masked tail
    for n0 in tl.range(start, full_end, BLOCK_N, num_stages=HIST_STAGES):
        m_i, l_i, acc, accm, fv = _int2_tile(
            n0, end, b, h, q0, q1, q2, q3, qsum, kmul, m_i, l_i, acc, accm, fv, kc_ptr, stride_kp, stride_kh,
            vc_ptr, stride_vp, stride_vh, ks_ptr, kz_ptr, vs_ptr, vz_ptr, stride_mp, stride_mh,
            bt_ptr, stride_btb, bias_ptr, bbase, stride_bh, ca, cb, rinv, rt_ptr, rl_ptr, rpos, lo_ptr, lbase,
            GROUP, GP, D, BLOCK_N, PTX, PAGED, PAGE, VROW, False, HAS_BIAS, HAS_ROPE, ROPE_PREC, HAS_LO, META8)
    if full_end < end:
        m_i, l_i, acc, accm, fv = _int2_tile(
            full_end, end, b, h, q0, q1, q2, q3, qsum, kmul, m_i, l_i, acc, accm, fv, kc_ptr, stride_kp, stride_kh,
            vc_ptr, stride_vp, stride_vh, ks_ptr, kz_ptr, vs_ptr, vz_ptr, stride_mp, stride_mh,
            bt_ptr, stride_btb, bias_ptr, bbase, stride_bh, ca, cb, rinv, rt_ptr, rl_ptr, rpos, lo_ptr, lbase,
            GROUP, GP, D, BLOCK_N, PTX, PAGED, PAGE, VROW, True, HAS_BIAS, HAS_ROPE, ROPE_PREC, HAS_LO, META8)
    has = l_i > 0
    inv = 1.0 / tl.where(has, l_i, 1.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    acc = acc * (16777216.0 / fv)
    _store_partial_t((acc + accm[None, :]) * inv[None, :], lse, op_ptr, lse_ptr, b, h, sp, stride_ob, stride_oh,
                     stride_os, stride_lb, stride_lh, GROUP, GP, D)


@triton.jit
def _online_bf16_segment(qt, k_base, v_base, stride_t, n, m_i, l_i, acc, D: tl.constexpr,
                         BLOCK_NB: tl.constexpr, ACT: tl.constexpr):
    """Online-softmax update over ``n`` BF16/fp16 rows ``[n, D]`` of one tier (row stride ``stride_t``), in the
    transposed form of the INT2 splits: ``Sᵀ = K·qᵀ`` ``[BLOCK_NB, GP]``, ``Oᵀ += Vᵀ·Pᵀ`` ``[D, GP]``."""
    cols = tl.arange(0, D)
    for n0 in range(0, n, BLOCK_NB):
        tok = n0 + tl.arange(0, BLOCK_NB)
        valid = tok < n
        k = tl.load(k_base + tok[:, None] * stride_t + cols[None, :], mask=valid[:, None], other=0.0).to(ACT)
        p, alpha, m_i, l_i = _online_scores(k, qt, valid, m_i, l_i)
        vt = tl.load(v_base + tok[None, :] * stride_t + cols[:, None], mask=valid[None, :], other=0.0).to(ACT)
        acc = tl.dot(vt, p.to(ACT), acc * alpha[None, :])
    return m_i, l_i, acc


@triton.jit
def _online_scores(k, qt, valid, m_i, l_i):
    """The scores half of one BF16-tier tile's online-softmax update: ``p`` ``[BLOCK_NB, GP]`` (rows past ``valid``
    0), the rescale ``alpha`` of the running sums, the new running max and sum; the caller loads the V tile after
    this (the order the measured kernels have: the V tile is not live during the first dot)."""
    s = tl.dot(k, qt)
    s = tl.where(valid[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 0)


@triton.jit
def _online_tier_rows(qt, k_base, v_base, stride_t, slot_ptr, n, km, vm, m_i, l_i, acc, D: tl.constexpr,
                      BLOCK_NB: tl.constexpr, ACT: tl.constexpr, INDEXED: tl.constexpr):
    """:func:`_online_bf16_segment` over ``n`` rows of a tier where the vLLM backend keeps it (``DIRECT_TIERS``):
    row ``j`` at ``base + (slot_ptr[j] if INDEXED else j) · stride_t``, read as ``rn(float32(x) - mean)`` in ``ACT``
    (``km``/``vm`` ``[D]`` float32): the values and the order ``ops.tier_gather`` writes and the gathered segment
    reads, so the same bits without the copy."""
    cols = tl.arange(0, D)
    for n0 in range(0, n, BLOCK_NB):
        tok = n0 + tl.arange(0, BLOCK_NB)
        valid = tok < n
        if INDEXED:
            row = tl.load(slot_ptr + tok, mask=valid, other=0).to(tl.int64)
        else:
            row = tok.to(tl.int64)
        roff = row * stride_t
        k = tl.load(k_base + roff[:, None] + cols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        k = tl.where(valid[:, None], k - km[None, :], 0.0).to(ACT)
        p, alpha, m_i, l_i = _online_scores(k, qt, valid, m_i, l_i)
        vt = tl.load(v_base + roff[None, :] + cols[:, None], mask=valid[None, :], other=0.0).to(tl.float32)
        vt = tl.where(valid[None, :], vt - vm[:, None], 0.0).to(ACT)
        acc = tl.dot(vt, p.to(ACT), acc * alpha[None, :])
    return m_i, l_i, acc


@triton.jit
def _bf16_tiers(
    b, h, sp, part,
    q_ptr, stride_qb, stride_qh,
    sk_ptr, sv_ptr, stride_sb, stride_sh, stride_st, sink_len_ptr,  # sink [B, H_kv, T_s, D]
    rk2_ptr, rv2_ptr, stride_rb, stride_rh, stride_rt, recent_len_ptr,  # recent [B, H_kv, T_r, D]
    op_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_NB: tl.constexpr,
    ACT: tl.constexpr, TIER_PARTS: tl.constexpr,
    # DIRECT: the tiers are the backend's storage [rows + 1, H_kv, S or R, D] (uncentred), read through the
    # sequence's row rows[b] (int64 [B]) and, for the ring, its slot order ring_index[b, j] (int64 [B, R'], row
    # stride stride_ib), centred by the float32 means km / vm [H_kv or 1, D] (head strides stride_kmh / stride_vmh)
    rows_ptr, ridx_ptr, stride_ib, km_ptr, vm_ptr, stride_kmh, stride_vmh, DIRECT: tl.constexpr,
):
    """Range ``part`` of ``TIER_PARTS`` over [sink rows | recent rows] of one (batch, KV head) in one online
    softmax; writes partial ``sp``. Ranges are whole tiles of ``BLOCK_NB`` rows; an empty range writes
    ``lse = -inf, o = 0``. ``DIRECT``: the tiers read in place (the gather's work done here, the same bits)."""
    heads = tl.arange(0, GP)
    qt = tl.load(q_ptr + b * stride_qb + (h * GROUP + heads)[None, :] * stride_qh + tl.arange(0, D)[:, None],
                 mask=(heads < GROUP)[None, :], other=0.0)  # [D, GP]
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([D, GP], tl.float32)
    n_sink = tl.load(sink_len_ptr + b)
    n_all = n_sink + tl.load(recent_len_ptr + b)
    start, end = _part_range(n_all, part, TIER_PARTS, BLOCK_NB)
    s0 = tl.minimum(start, n_sink)  # sink rows [s0, s1) of this range
    s1 = tl.minimum(end, n_sink)
    r0 = tl.maximum(start - n_sink, 0)  # recent rows [r0, r1)
    r1 = tl.maximum(end - n_sink, 0)
    if DIRECT:
        row = tl.load(rows_ptr + b).to(tl.int64)
        km = tl.load(km_ptr + h * stride_kmh + tl.arange(0, D))
        vm = tl.load(vm_ptr + h * stride_vmh + tl.arange(0, D))
        sink_off = row * stride_sb + h * stride_sh + s0 * stride_st
        m_i, l_i, acc = _online_tier_rows(qt, sk_ptr + sink_off, sv_ptr + sink_off, stride_st, rows_ptr, s1 - s0,
                                          km, vm, m_i, l_i, acc, D, BLOCK_NB, ACT, False)
        recent_off = row * stride_rb + h * stride_rh
        m_i, l_i, acc = _online_tier_rows(qt, rk2_ptr + recent_off, rv2_ptr + recent_off, stride_rt,
                                          ridx_ptr + b.to(tl.int64) * stride_ib + r0, r1 - r0, km, vm, m_i, l_i,
                                          acc, D, BLOCK_NB, ACT, True)
    else:
        sink_off = b * stride_sb + h * stride_sh + s0 * stride_st
        m_i, l_i, acc = _online_bf16_segment(
            qt, sk_ptr + sink_off, sv_ptr + sink_off, stride_st, s1 - s0, m_i, l_i, acc, D, BLOCK_NB, ACT)
        recent_off = b * stride_rb + h * stride_rh + r0 * stride_rt
        m_i, l_i, acc = _online_bf16_segment(
            qt, rk2_ptr + recent_off, rv2_ptr + recent_off, stride_rt, r1 - r0, m_i, l_i, acc, D, BLOCK_NB, ACT)
    has = l_i > 0
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    _store_partial_t(acc / tl.where(has, l_i, 1.0)[None, :], lse, op_ptr, lse_ptr, b, h, sp, stride_ob, stride_oh,
                     stride_os, stride_lb, stride_lh, GROUP, GP, D)


@triton.jit
def _decode_stage1_kernel(
    q_ptr, stride_qb, stride_qh,  # q_rot [B, H_q, D] act dtype, from _rotate_q_kernel
    kc_ptr, stride_kp, stride_kh,  # K codes [pages, H_kv, P, D/4] uint8, quarter packing, rows contiguous
    vc_ptr, stride_vp, stride_vh,  # V codes [pages, H_kv, P/R·D, R/4] uint8, token quads in rows of VROW bytes
    ks_ptr, kz_ptr, vs_ptr, vz_ptr, stride_mp, stride_mh,  # scale / zero [pages, H_kv, P] md, P contiguous
    bt_ptr, stride_btb, hist_len_ptr,  # block table [B, max_pages] int32; hist_len [B] int32
    bias_ptr, stride_bb, stride_bh,  # per-key logit bias of the INT2 history [B, H_q, L] float32 (HAS_BIAS)
    # HAS_ROPE: raw (unrotated) q [B, H_q, D], m_pre [H_kv, D] float32, position table [P, D] float32 (contiguous
    # rows [cos θp | sin θp]), first history position per row pos0 [B] int32, a·sm_scale·log2(e)
    rq_ptr, stride_rqb, stride_rqh, rm_ptr, stride_rmh, rt_ptr, rl_ptr, rpos_ptr, rope_scale,
    # HAS_LO 1: INT4 keys' low plane [B, H_kv, C, D/4] uint8 (quarter packed, slot-indexed), first slot per row [B]
    # int32; HAS_LO 2: the low plane paged like the key codes (same strides; lo_first_ptr unused)
    lo_ptr, stride_lob, stride_loh, lo_first_ptr,
    sk_ptr, sv_ptr, stride_sb, stride_sh, stride_st, sink_len_ptr,  # sink tier [B, H_kv, T_s, D]
    rck_ptr, rcv_ptr, stride_rb, stride_rh, stride_rt, recent_len_ptr,  # recent tier [B, H_kv, T_r, D]
    # DIRECT_TIERS: the two tiers above are the backend's storage [rows + 1, H_kv, T, D] (see _bf16_tiers)
    tier_rows_ptr, ring_idx_ptr, stride_ib, tkm_ptr, tvm_ptr, stride_tkm, stride_tvm,
    op_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,  # o [B,H_q,S+TP,D], lse [B,H_q,S+TP]
    num_splits,  # S
    H_KV: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_NB: tl.constexpr, PTX: tl.constexpr, ACT: tl.constexpr, PAGED: tl.constexpr,
    PAGE: tl.constexpr, TIER_PARTS: tl.constexpr, PDL: tl.constexpr,
    HIST_STAGES: tl.constexpr = 2, HOIST_Q: tl.constexpr = False, PREFETCH: tl.constexpr = False,
    VROW: tl.constexpr = 16, HAS_BIAS: tl.constexpr = False, HAS_ROPE: tl.constexpr = False,
    ROPE_PREC: tl.constexpr = "tf32x3", HAS_LO: tl.constexpr = 0, META8: tl.constexpr = False,
    DIRECT_TIERS: tl.constexpr = False, TIER_PREFETCH: tl.constexpr = True,
):
    """Stage 1: partial attention per (batch, KV head, split); splits ``S..S+TIER_PARTS-1`` are the BF16 tiers
    (``DIRECT_TIERS``: read in the backend's storage through row and ring indices, centred here).

    Grid: ``(B * H_kv, S + TIER_PARTS)``. ``PDL``: launched as a programmatic dependent launch of the q rotation:
    wait for it (``griddepcontrol.wait``) before reading ``q_rot``; let the merge launch once every program has
    written its partial.
    """
    pid = tl.program_id(0)
    b = pid // H_KV
    h = pid % H_KV
    sp = tl.program_id(1)
    if PREFETCH:  # nothing below the wait but q depends on the rotation: start this program's first DRAM reads
        if sp < num_splits:
            _prefetch_first_tile(b, h, sp, num_splits, kc_ptr, stride_kp, stride_kh, vc_ptr, stride_vp, stride_vh,
                                 ks_ptr, kz_ptr, vs_ptr, vz_ptr, stride_mp, stride_mh, bt_ptr, stride_btb,
                                 hist_len_ptr, D, BLOCK_N, PAGED, PAGE, VROW)
        elif TIER_PREFETCH:
            _prefetch_tier_rows(b, h, sp - num_splits, sk_ptr, sv_ptr, stride_sb, stride_sh, stride_st, sink_len_ptr,
                                rck_ptr, rcv_ptr, stride_rb, stride_rh, stride_rt, recent_len_ptr, D, BLOCK_NB,
                                TIER_PARTS, tier_rows_ptr, ring_idx_ptr, stride_ib, DIRECT_TIERS)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if sp < num_splits:
        _int2_split(b, h, sp, num_splits, q_ptr, stride_qb, stride_qh,
                    kc_ptr, stride_kp, stride_kh, vc_ptr, stride_vp, stride_vh,
                    ks_ptr, kz_ptr, vs_ptr, vz_ptr, stride_mp, stride_mh,
                    bt_ptr, stride_btb, hist_len_ptr, bias_ptr, stride_bb, stride_bh,
                    rq_ptr, stride_rqb, stride_rqh, rm_ptr, stride_rmh, rt_ptr, rl_ptr, rpos_ptr, rope_scale,
                    lo_ptr, stride_lob, stride_loh, lo_first_ptr,
                    op_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                    GROUP, GP, D, BLOCK_N, PTX, PAGED, PAGE, VROW, HIST_STAGES, HOIST_Q, HAS_BIAS, HAS_ROPE,
                    ROPE_PREC, HAS_LO, META8)
    else:
        _bf16_tiers(b, h, sp, sp - num_splits, q_ptr, stride_qb, stride_qh,
                    sk_ptr, sv_ptr, stride_sb, stride_sh, stride_st, sink_len_ptr,
                    rck_ptr, rcv_ptr, stride_rb, stride_rh, stride_rt, recent_len_ptr,
                    op_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                    GROUP, GP, D, BLOCK_NB, ACT, TIER_PARTS, tier_rows_ptr, ring_idx_ptr, stride_ib, tkm_ptr,
                    tvm_ptr, stride_tkm, stride_tvm, DIRECT_TIERS)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _merge_heads(op_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, mu_ptr, stride_muh, rv_ptr,
                 stride_rvh, out_ptr, stride_outb, stride_outh, n_parts, pid, e_base, H_Q: tl.constexpr,
                 GROUP: tl.constexpr, D: tl.constexpr, SP: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
                 HAS_MU: tl.constexpr, HAS_R: tl.constexpr, E_PROG: tl.constexpr, HEADS: tl.constexpr):
    """:func:`_merge_rotate_kernel` for ``HEADS`` consecutive query heads of one KV head (``HEADS`` divides
    ``GROUP``): the partials as ``[HEADS, BLOCK_P / HEADS, D]`` tiles and ``R_V`` in ``[BLOCK_E / HEADS, D]`` chunks,
    each loaded once for all the heads (the register footprint of one head's ``[BLOCK_P, D]`` / ``[BLOCK_E, D]``
    tiles). The same sums per head in another reduction layout: within float32 rounding of the one-head path."""
    b = pid // (H_Q // HEADS)
    hq0 = (pid % (H_Q // HEADS)) * HEADS
    hkv = hq0 // GROUP
    heads = hq0 + tl.arange(0, HEADS)
    parts = tl.arange(0, SP)
    lse_rows = lse_ptr + b * stride_lb + heads[:, None] * stride_lh
    lse = tl.load(lse_rows + parts[None, :], mask=(parts < n_parts)[None, :], other=float("-inf"))
    mx = tl.max(lse, 1)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    den = tl.sum(tl.exp2(lse - mx[:, None]), 1)
    pbase = op_ptr + b * stride_ob + heads[:, None, None] * stride_oh
    if HAS_R:
        cols = tl.arange(0, D)
    else:
        cols = e_base + tl.arange(0, E_PROG)
    BP: tl.constexpr = BLOCK_P // HEADS if BLOCK_P // HEADS >= 2 else 2
    o = tl.zeros([HEADS, cols.shape[0]], tl.float32)
    for p0 in range(0, n_parts, BP):
        pp = p0 + tl.arange(0, BP)
        pm = pp < n_parts
        w = tl.exp2(tl.load(lse_rows + pp[None, :], mask=pm[None, :], other=float("-inf")) - mx[:, None])
        tile = tl.load(pbase + pp[None, :, None] * stride_os + cols[None, None, :], mask=pm[None, :, None], other=0.0)
        o += tl.sum(w[:, :, None] * tile, 1)
    o = o / tl.where(den > 0, den, 1.0)[:, None]
    if HAS_MU:
        o += tl.load(mu_ptr + hkv * stride_muh + cols)[None, :]
    obase = out_ptr + b * stride_outb + heads[:, None] * stride_outh
    if HAS_R:
        BE: tl.constexpr = BLOCK_E // HEADS if BLOCK_E // HEADS >= 8 else 8
        for c in tl.static_range(E_PROG // BE):
            e = e_base + c * BE + tl.arange(0, BE)
            r = tl.load(rv_ptr + hkv * stride_rvh + e[:, None] * D + cols[None, :])  # R_V[e, :]
            tl.store(obase + e[None, :], tl.sum(r[None, :, :] * o[:, None, :], 2).to(out_ptr.dtype.element_ty))
    else:
        tl.store(obase + cols[None, :], o.to(out_ptr.dtype.element_ty))


@triton.jit
def _merge_rotate_kernel(
    op_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,  # partials (see stage 1)
    mu_ptr, stride_muh,  # mu_V [H_r, D] float32 (rotated space)
    rv_ptr, stride_rvh,  # R_V [H_r, D, D] float32
    out_ptr, stride_outb, stride_outh,  # out [B, H_q, D] act dtype
    n_parts,  # S + TIER_PARTS
    H_Q: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, SP: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr, HAS_MU: tl.constexpr, HAS_R: tl.constexpr, E_PROG: tl.constexpr, PDL: tl.constexpr,
    HEADS: tl.constexpr = 1,
):
    """Stage 2: LSE merge over the partials, ``+ mu_V``, ``@ R_Vᵀ``, cast; output dims ``[e0, e0 + E_PROG)`` of
    ``HEADS`` query heads of one KV head per program, in chunks of ``BLOCK_E`` (each program merges what its dims
    need: all of ``o`` when rotating back, so ``E_PROG < D`` re-reads the partials ``D / E_PROG`` times for more
    programs).

    Grid: ``(B * H_q / HEADS, D / E_PROG)``: small batches get more programs (the merge is latency there), large
    batches read every partial once (``E_PROG = D``; bytes there). ``HEADS > 1`` (:func:`_merge_heads`): each
    ``R_V`` chunk is loaded once for the program's heads instead of once per head. ``PDL``: wait for stage 1 with
    ``griddepcontrol`` (launched as a programmatic dependent launch, the program starts while stage 1 drains).
    """
    if PDL:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    e_base = tl.program_id(1) * E_PROG
    if HEADS > 1:
        _merge_heads(op_ptr, lse_ptr, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, mu_ptr, stride_muh,
                     rv_ptr, stride_rvh, out_ptr, stride_outb, stride_outh, n_parts, pid, e_base, H_Q=H_Q,
                     GROUP=GROUP, D=D, SP=SP, BLOCK_E=BLOCK_E, BLOCK_P=BLOCK_P, HAS_MU=HAS_MU, HAS_R=HAS_R,
                     E_PROG=E_PROG, HEADS=HEADS)
        return
    b = pid // H_Q
    hq = pid % H_Q
    hkv = hq // GROUP
    parts = tl.arange(0, SP)
    lse_base = lse_ptr + b * stride_lb + hq * stride_lh
    lse = tl.load(lse_base + parts, mask=parts < n_parts, other=float("-inf"))
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    den = tl.sum(tl.exp2(lse - mx), 0)
    obase = out_ptr + b * stride_outb + hq * stride_outh
    pbase = op_ptr + b * stride_ob + hq * stride_oh
    if HAS_R:
        cols = tl.arange(0, D)
    else:
        cols = e_base + tl.arange(0, E_PROG)
    o = tl.zeros([cols.shape[0]], tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):  # partials in chunks: [BLOCK_P, D] tiles, never [S, D] in registers
        pp = p0 + tl.arange(0, BLOCK_P)
        pm = pp < n_parts
        w = tl.exp2(tl.load(lse_base + pp, mask=pm, other=float("-inf")) - mx)
        o += tl.sum(w[:, None] * tl.load(pbase + pp[:, None] * stride_os + cols[None, :], mask=pm[:, None],
                                         other=0.0), 0)
    o = o / tl.where(den > 0, den, 1.0)
    if HAS_MU:
        o += tl.load(mu_ptr + hkv * stride_muh + cols)
    if HAS_R:
        for c in tl.static_range(E_PROG // BLOCK_E):
            e = e_base + c * BLOCK_E + tl.arange(0, BLOCK_E)
            r = tl.load(rv_ptr + hkv * stride_rvh + e[:, None] * D + cols[None, :])  # R_V[e, :]
            tl.store(obase + e, tl.sum(r * o[None, :], 1).to(out_ptr.dtype.element_ty))
    else:
        tl.store(obase + cols, o.to(out_ptr.dtype.element_ty))
