"""Triton quantize-on-write: BF16/fp16 K or V rows -> rotated, centred, clipped INT2 rows in a paged cache.

Only ``@triton.jit`` code lives here; launchers, checks and allocation are in :mod:`oscar_kernels.ops`.
The arithmetic follows :mod:`oscar_kernels.reference` step by step (float32 throughout, ``div_rn`` for every
division) so that codes, scale, zero and packed bytes are bitwise equal to the reference fed the same float32
rotated rows. The clip threshold ``sort(|y|)[clip_idx]`` comes from ``tl.sort`` (``CLIP_SORT=True``, the
launcher's default) or from a bitwise select on the int32 bit patterns of ``|y|`` (``CLIP_SORT=False``:
non-negative float32 patterns order like the values; 31 steps of compare + row count over ``[BLOCK_T, D]``,
:func:`_clip_select`), both exactly the sorted element, ties included. On an H200 the sort is the faster one
(one K row: 2.9 µs vs 5.4 µs per launch; docs/results/write-bench-h200.json).

Paged cache layouts (what the decode kernel reads): keys ``codes uint8 [num_pages, H_kv, P, D/4]`` (quarter
packing, ``TQ=False``); values ``codes uint8 [num_pages, H_kv, P/R·D, R/4]`` (token quads in rows of
``R = min(P, 64)`` tokens, ``TQ=True``). ``scale`` and ``zero`` ``md [num_pages, H_kv, P, D/G]`` for both.
A token's slot is ``page * P + offset``; a negative slot is skipped (padding rows, CUDA-graph safe).

Token-quad updates. A token owns 2 bits of each of ``D`` bytes that it shares with the 3 other tokens of its quad;
the kernel updates the 32-bit words holding them (16 tokens' bits of one channel), keeping the other 30 bits.
Precondition of every variant: no slot appears twice among the non-negative slots of one launch (the 2 bits of a
token have one writer per launch); launches on one stream are ordered, so an earlier launch's bits are visible.

- ``TQ_XOR=False``: ``atomic_and(~m)`` then ``atomic_or(c << s)`` (``m = 3 << s``): two atomics per word.
- ``TQ_XOR=True`` (the default): ``w = load(word)`` then ``atomic_xor(((w >> s & 3) ^ c) << s)``. Correct under
  concurrent writers of the word's other bits: those writers change only their own bits (by atomics) and nobody
  else writes bits ``m`` in this launch, so bits ``m`` hold the same value ``o`` in every value the word takes
  during the launch, whichever of them the load returns; the load is ``volatile`` (PTX ``ld.relaxed.sys``: not a
  data race with the atomics, it returns one of the word's values, not a torn or undefined one). The xor's
  operand is zero outside ``m``, so it leaves the other bits as the atomic finds them, and turns ``o`` into
  ``o ^ (o ^ c) = c`` inside ``m``. Atomicity is all it needs (one atomic per address per thread; nothing is
  published through it): ``sem="relaxed"``.
- ``EXCLUSIVE_WORDS=True``: ``load``, clear ``m``, or ``c << s``, ``store``; only when the caller guarantees that
  no two rows of the launch share a 32-bit word (e.g. a decode-only step: one token per sequence and sequences on
  distinct pages), as two rows in one word would lose one's update.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _quantize_write_kernel(x_ptr, stride_xn, stride_xh, r_ptr, stride_rh, mu_ptr, stride_mun, stride_muh, slot_ptr,
                           codes_ptr, stride_cp, stride_ch, stride_cr, scale_ptr, zero_ptr, stride_mp, stride_mh,
                           stride_mr, n_rows, page_size, row_tokens, clip_idx, D: tl.constexpr, G: tl.constexpr,
                           BLOCK_T: tl.constexpr, HAS_R: tl.constexpr, HAS_MU: tl.constexpr, DO_CLIP: tl.constexpr,
                           TQ: tl.constexpr, CLIP_SORT: tl.constexpr = True, TQ_XOR: tl.constexpr = True,
                           EXCLUSIVE_WORDS: tl.constexpr = False, lo_ptr=None, INT4: tl.constexpr = False):
    """One launch of :func:`quantize_write_tile`. Grid: ``(cdiv(N, BLOCK_T), H_kv)``."""
    quantize_write_tile(tl.program_id(0), tl.program_id(1), x_ptr, stride_xn, stride_xh, r_ptr, stride_rh, mu_ptr,
                        stride_mun, stride_muh, slot_ptr, codes_ptr, stride_cp, stride_ch, stride_cr, scale_ptr,
                        zero_ptr, stride_mp, stride_mh, stride_mr, n_rows, page_size, row_tokens, clip_idx, lo_ptr,
                        D=D, G=G, BLOCK_T=BLOCK_T, HAS_R=HAS_R, HAS_MU=HAS_MU, DO_CLIP=DO_CLIP, TQ=TQ,
                        CLIP_SORT=CLIP_SORT, TQ_XOR=TQ_XOR, EXCLUSIVE_WORDS=EXCLUSIVE_WORDS, INT4=INT4)


@triton.jit
def quantize_write_tile(
    pid_t,  # the tile of BLOCK_T rows
    h,  # the KV head
    x_ptr,  # [N, H_kv, D] activations (bf16 / fp16 / fp32)
    stride_xn,
    stride_xh,
    r_ptr,  # [H_r, D, D] float32 rotation (H_r = 1 shared: stride_rh = 0); unused when not HAS_R
    stride_rh,
    mu_ptr,  # [H_r, D] float32 mean in rotated space, or per row [N, H_kv, D]; unused when not HAS_MU
    stride_mun,  # row stride of the mean (0: one mean for every row)
    stride_muh,
    slot_ptr,  # [N] int64 destination slots (page * P + offset); < 0 = skip
    codes_ptr,  # rows: [num_pages, H_kv, P, D/4] uint8; token quads: the int32 view of [num_pages, H_kv, P/R·D, R/4]
    stride_cp,  # byte strides (page, head, and row (rows) or token-quad row (token quads; R/4 bytes))
    stride_ch,
    stride_cr,
    scale_ptr,  # [num_pages, H_kv, P, D/G] md
    zero_ptr,  # [num_pages, H_kv, P, D/G] md (same strides as scale)
    stride_mp,
    stride_mh,
    stride_mr,
    n_rows,  # N
    page_size,  # P
    row_tokens,  # token quads: tokens per row R (P up to 64, else 64)
    clip_idx,  # min(int(ratio * D), D - 1); < 0 = no clipping
    lo_ptr,  # INT4: the low plane, laid out as codes (rows layout, the codes' strides); else any pointer, unused
    D: tl.constexpr,
    G: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_R: tl.constexpr,
    HAS_MU: tl.constexpr,
    DO_CLIP: tl.constexpr,
    TQ: tl.constexpr,
    CLIP_SORT: tl.constexpr,
    TQ_XOR: tl.constexpr,
    EXCLUSIVE_WORDS: tl.constexpr,
    INT4: tl.constexpr,
):
    """Quantize ``BLOCK_T`` rows (tile ``pid_t``) of KV head ``h`` and scatter them into the paged cache: the body of
    ``_quantize_write_kernel`` and of the fused decode-step write (:mod:`oscar_kernels.write_step`).

    Token quads (``TQ``) update a row's 2 bits of each of its ``D`` 32-bit
    words in one of three ways (bitwise the same result under their preconditions; see the module docstring):
    ``EXCLUSIVE_WORDS`` a plain load / clear / or / store, ``TQ_XOR`` a relaxed load and one ``atomic_xor``,
    else ``atomic_and`` + ``atomic_or``. ``INT4`` (rows layout, no clip): formula 9's 16 levels, the high plane
    into ``codes`` with its scale and zero, the low plane into ``lo_ptr`` at the same offsets.
    """
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, D)
    row_ok = rows < n_rows
    x = tl.load(
        x_ptr + rows[:, None].to(tl.int64) * stride_xn + h * stride_xh + cols[None, :],
        mask=row_ok[:, None],
        other=0.0,
    ).to(tl.float32)
    if HAS_R:
        r = tl.load(r_ptr + h * stride_rh + cols[:, None] * D + cols[None, :])
        y = tl.dot(x, r, input_precision="ieee")
    else:
        y = x
    if HAS_MU:
        y = y - tl.load(mu_ptr + rows[:, None].to(tl.int64) * stride_mun + h * stride_muh + cols[None, :],
                        mask=row_ok[:, None], other=0.0)
    if DO_CLIP:
        if CLIP_SORT:
            srt = tl.sort(tl.abs(y), dim=1)
            tau = tl.sum(tl.where(cols[None, :] == clip_idx, srt, 0.0), axis=1)
        else:
            tau = _clip_select(y, clip_idx, BLOCK_T)
        y = tl.minimum(tl.maximum(y, -tau[:, None]), tau[:, None])
    codes, scale, zero = _quantize_groups(y, BLOCK_T, D, G, scale_ptr.dtype.element_ty, INT4)

    slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
    ok = row_ok & (slot >= 0)
    slot = tl.where(ok, slot, 0)
    page = slot // page_size
    off = slot % page_size
    if TQ:  # token quads: this row owns bits 2·(off % 4) of byte (off // R · D + d, off % R // 4); others are kept
        blk = off // row_tokens
        byte = (page * stride_cp + h * stride_ch + blk * (D * stride_cr) + (off % row_tokens) // 4)[:, None] \
            + cols[None, :].to(tl.int64) * stride_cr
        shift = ((byte % 4) * 8 + (off % 4)[:, None] * 2).to(tl.int32)
        word = codes_ptr + byte // 4
        wok = ok[:, None]
        if EXCLUSIVE_WORDS:  # no other row of this launch touches these words: a plain read-modify-write
            w = tl.load(word, mask=wok, other=0)
            tl.store(word, (w & ~(3 << shift)) | (codes << shift), mask=wok)
        elif TQ_XOR:  # only this row writes these 2 bits: flip exactly the bits that change, one atomic
            w = tl.load(word, mask=wok, other=0, volatile=True)
            tl.atomic_xor(word, (((w >> shift) & 3) ^ codes) << shift, mask=wok, sem="relaxed")
        else:
            tl.atomic_and(word, ~(3 << shift), mask=wok)
            tl.atomic_or(word, codes << shift, mask=wok)
    else:
        cbase = page * stride_cp + h * stride_ch + off * stride_cr
        qcols = tl.arange(0, D // 4)
        if INT4:  # codes 0..15: the high plane (4·hi + lo) to the pages, the low plane beside them
            tl.store(lo_ptr + cbase[:, None] + qcols[None, :], _pack_quarters(codes & 3, BLOCK_T, D), mask=ok[:, None])
            codes = codes >> 2
        packed = _pack_quarters(codes, BLOCK_T, D)
        tl.store(codes_ptr + cbase[:, None] + qcols[None, :], packed, mask=ok[:, None])
    mbase = page * stride_mp + h * stride_mh + off * stride_mr
    gcols = tl.arange(0, D // G)
    tl.store(scale_ptr + mbase[:, None] + gcols[None, :], scale, mask=ok[:, None])
    tl.store(zero_ptr + mbase[:, None] + gcols[None, :], zero, mask=ok[:, None])


@triton.jit
def _clip_select(y, clip_idx, BLOCK_T: tl.constexpr):
    """Per-row ``sort(|y|)[clip_idx]`` of float32 ``y [BLOCK_T, D]`` without sorting -> float32 ``[BLOCK_T]``.

    ``bits`` = the int32 pattern of ``|y|`` (sign bit cleared, so -0.0 is +0.0); for non-negative floats the
    patterns order like the values. The answer is the smallest pattern ``T`` with ``count(bits <= T) > clip_idx``,
    built from bit 30 down: bit ``b`` of ``T`` is 0 iff the count at ``prefix | (2^b - 1)`` already exceeds
    ``clip_idx``. ``T`` is always one of the row's patterns, so its bitcast is exactly the sorted element.
    """
    bits = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    t = tl.zeros([BLOCK_T], dtype=tl.int32)
    for i in tl.static_range(31):
        low = (1 << (30 - i)) - 1
        cnt = tl.sum((bits <= (t | low)[:, None]).to(tl.int32), axis=1)
        t = tl.where(cnt > clip_idx, t, t | (1 << (30 - i)))
    return t.to(tl.float32, bitcast=True)


@triton.jit
def _quantize_groups(y, BLOCK_T: tl.constexpr, D: tl.constexpr, G: tl.constexpr, META: tl.constexpr,
                     INT4: tl.constexpr = False):
    """Min-max INT2 per group of ``G`` channels, exactly as ``reference.quantize_int2``; ``INT4``: formula 9's 16
    levels as ``reference.quantize_int4_planes`` (codes 0..15 = ``4·hi + lo``; the stored scale is the high
    plane's step, 4 fine steps).

    ``y`` float32 ``[BLOCK_T, D]`` -> codes int32 ``[BLOCK_T, D]``, scale and zero ``META [BLOCK_T, D/G]``.
    """
    yg = tl.reshape(y, [BLOCK_T, D // G, G])
    mn = tl.min(yg, axis=2)
    mx = tl.max(yg, axis=2)
    if INT4:  # the reference's clamp(mx - mn)·4 / 15 (the product exact, one rounded division)
        s = tl.math.div_rn(tl.maximum(mx - mn, 1e-8) * 4.0, tl.full(mn.shape, 15.0, tl.float32))
        half = 1.875  # the grid's half width in stored steps: 15/4 / 2
    else:
        s = tl.math.div_rn(tl.maximum(mx - mn, 1e-8), tl.full(mn.shape, 3.0, tl.float32))
        half = 1.5
    if META == tl.uint8:  # formula 10: e5m3 scale byte, zero byte z + 128 with zero = z·scale/16, grid centred
        mid = (mn + mx) * 0.5
        wide = tl.maximum(s, tl.math.div_rn(tl.abs(mid), tl.full(mid.shape, 5.5, tl.float32)))
        r = (wide.to(tl.int32, bitcast=True) + (1 << 19)) >> 20
        e = (r >> 3) - 127 + E5M3_BIAS
        byte = tl.where(e < 0, 0, tl.where(e > 31, 255, (e << 3) | (r & 7)))
        sf = meta8_scale(byte)
        z = tl.floor(tl.math.div_rn(mid - sf * half, sf * 0.0625) + 0.5)
        z = tl.minimum(tl.maximum(z, -128.0), 127.0)
        zf = z * (sf * 0.0625)
        scale = byte.to(tl.uint8)
        zero = (z.to(tl.int32) + 128).to(tl.uint8)
    else:
        scale = _round_to(s, META)
        zero = _round_to(mn, META)
        sf = scale.to(tl.float32)
        zf = zero.to(tl.float32)
    if INT4:
        q = tl.math.div_rn(yg - zf[:, :, None], tl.broadcast_to(sf[:, :, None] * 0.25, yg.shape))
        c = tl.minimum(tl.maximum(tl.floor(q + 0.5), 0.0), 15.0).to(tl.int32)
    else:
        q = tl.math.div_rn(yg - zf[:, :, None], tl.broadcast_to(sf[:, :, None], yg.shape))
        c = tl.minimum(tl.maximum(tl.floor(q + 0.5), 0.0), 3.0).to(tl.int32)
    return tl.reshape(c, [BLOCK_T, D]), scale, zero


E5M3_BIAS: tl.constexpr = tl.constexpr(16)  # reference formula 10 (``oscar_kernels.reference._E5M3_BIAS``)


@triton.jit
def meta8_scale(byte):
    """Formula 10's scale byte (int32 ``e << 3 | m``) as float32 ``2^(e - 16)·(1 + m/8)``, built from its bits."""
    return ((((byte >> 3) - E5M3_BIAS + 127) << 23) | ((byte & 7) << 20)).to(tl.float32, bitcast=True)


@triton.jit
def meta8_decode(sb, zb):
    """Formula 10's scale and zero bytes (int32) as float32 ``(sf, zf)``, ``zf = (zb - 128)·sf/16`` (exact)."""
    sf = meta8_scale(sb)
    return sf, (zb - 128).to(tl.float32) * (sf * 0.0625)


@triton.jit
def _round_to(v, META: tl.constexpr):
    """float32 -> ``META`` rounding to nearest even (explicit bit arithmetic for bfloat16, so every
    backend, the CPU interpreter included, rounds like ``torch.Tensor.to``; finite inputs)."""
    if META == tl.bfloat16:
        u = v.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(META)


@triton.jit
def _pack_quarters(codes, BLOCK_T: tl.constexpr, D: tl.constexpr):
    """Quarter packing: int32 codes ``[BLOCK_T, D]`` -> uint8 ``[BLOCK_T, D/4]``.

    Byte ``i`` = ``c[i] | c[i + D/4] << 2 | c[i + D/2] << 4 | c[i + 3D/4] << 6``.
    """
    c3 = tl.reshape(codes, [BLOCK_T, 4, D // 4])
    shifts = (tl.arange(0, 4) * 2)[None, :, None]
    return tl.sum(c3 << shifts, axis=1).to(tl.uint8)
