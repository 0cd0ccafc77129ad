"""Triton dequantization of a range of one sequence's paged INT2 history into activation-dtype K and V rows (the
vLLM backend's prefill, ``oscar_cli.vllm.core.PagedInt2Layer.history``: the keys and values a chunk attends to).

Only ``@triton.jit`` code lives here; the launcher and its checks are in :mod:`oscar_kernels.history_ops`.

Token ``t`` of the range (``0 <= t < T``, position ``start + t``, ``start`` page-aligned) lives in page
``blocks[start / P + t // P]`` at offset ``o = t % P``. Its channel ``i`` is, per KV head ``h``:

- keys (quarter-packed rows ``[pages, H_kv, P, D/4]``): bits ``2·(i // (D/4))`` of byte ``i % (D/4)`` of row ``o``;
- values (token quads ``[pages, H_kv, P/R·D, R/4]``, ``R = min(P, 64)``): bits ``2·(o % 4)`` of byte
  ``(o % R) // 4`` of row ``(o // R)·D + i``;

and ``out[t, h, i] = rn(float32(zero) + float32(code)·float32(scale) + mean[h, i])`` with the token's group
``i // G`` of scale and zero: the product and the two sums rounded separately, in that order (the launcher turns
off Triton's FMA contraction), then rounded once to the output dtype (round to nearest even: bit arithmetic for
bfloat16, whose cast truncates in the CPU interpreter), bitwise the torch expressions of ``history``. ``META8``: formula 10's one-byte scale and zero, decoded exactly to
float32 (``int2_pack.meta8_decode``) before the same expression. ``HAS_LO`` (INT4 keys, formula 9): the keys' low
plane, laid out as the key codes, read at the same offsets; the key code is ``4·hi + lo`` and its step
``float32(scale)/4`` (exact), as ``reference.dequantize_int4_planes``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from oscar_kernels.int2_pack import meta8_decode
from oscar_kernels.rotate_kv import _cast_rn


@triton.jit
def _dequant_tile(codes, scale_ptr, zero_ptr, meta_off, cols, stride_mg, mean, okt, ok, out_ptr, out_off,
                  G: tl.constexpr, NG: tl.constexpr, META8: tl.constexpr = False, FINE: tl.constexpr = False):
    """``out[out_off] = rn((zero + code·scale) + mean)`` for a ``[BLOCK_T, BLOCK_D]`` tile of codes (int32 0..3);
    ``meta_off`` ``[BLOCK_T]``: each token's scale/zero row; ``okt`` ``[BLOCK_T]``, ``ok`` the tile's mask;
    ``META8``: the scale and zero are formula 10's bytes; ``FINE``: INT4 codes (0..15), a quarter of the scale each."""
    if NG == 1:
        s = tl.load(scale_ptr + meta_off, mask=okt, other=0)
        z = tl.load(zero_ptr + meta_off, mask=okt, other=0)
        if META8:
            s, z = meta8_decode(s.to(tl.int32), z.to(tl.int32))
        s = s.to(tl.float32)[:, None]
        z = z.to(tl.float32)[:, None]
    else:
        goff = meta_off[:, None] + (cols // G)[None, :] * stride_mg
        s = tl.load(scale_ptr + goff, mask=ok, other=0)
        z = tl.load(zero_ptr + goff, mask=ok, other=0)
        if META8:
            s, z = meta8_decode(s.to(tl.int32), z.to(tl.int32))
        s = s.to(tl.float32)
        z = z.to(tl.float32)
    if FINE:
        s = s * 0.25
    x = z + codes.to(tl.float32) * s
    y = x + mean[None, :]
    tl.store(out_ptr + out_off, _cast_rn(y, out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _history_kernel(
    kc_ptr,  # uint8 [pages, H_kv, P, D/4] key codes (quarter-packed rows)
    stride_kcp,
    stride_kch,
    stride_kct,
    ks_ptr,  # [pages, H_kv, P, D/G] key scales (bf16 / fp16 / fp32)
    kz_ptr,  # key zeros, ks's strides
    stride_ksp,
    stride_ksh,
    stride_kst,
    stride_ksg,
    vc_ptr,  # uint8 [pages, H_kv, P/R·D, R/4] value codes (token quads)
    stride_vcp,
    stride_vch,
    stride_vcr,
    vs_ptr,  # [pages, H_kv, P, D/G_V] value scales
    vz_ptr,  # value zeros, vs's strides
    stride_vsp,
    stride_vsh,
    stride_vst,
    stride_vsg,
    blocks_ptr,  # int32 / int64: the sequence's block-table row
    first_page,  # start / P
    k_mean_ptr,  # float32 [H_kv, D] (stride 0: one [D] mean for all heads)
    stride_kmh,
    v_mean_ptr,
    stride_vmh,
    k_out_ptr,  # [T, H_kv, D] (activation dtype)
    stride_kon,
    stride_koh,
    v_out_ptr,  # [T, H_kv, D] (k_out's dtype)
    stride_von,
    stride_voh,
    n_tokens,  # T
    P: tl.constexpr,
    R: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    G_K: tl.constexpr,
    NG_K: tl.constexpr,
    G_V: tl.constexpr,
    NG_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    META8: tl.constexpr = False,
    lo_ptr=None,  # HAS_LO: uint8 low plane of the keys, the key codes' layout and strides
    HAS_LO: tl.constexpr = False,
):
    """``BLOCK_T`` tokens of one KV head, K and V. Grid: ``(cdiv(T, BLOCK_T), H_kv)``."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    tok = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    cm = cols < D
    okt = tok < n_tokens
    ok = okt[:, None] & cm[None, :]
    page = tl.load(blocks_ptr + first_page + tok // P, mask=okt, other=0).to(tl.int64)
    o = tok % P
    t64 = tok.to(tl.int64)[:, None]

    # keys: channel i is quarter i // (D/4) of byte i % (D/4)
    kb = tl.load(kc_ptr + (page * stride_kcp + h * stride_kch + o * stride_kct)[:, None] + (cols % (D // 4))[None, :],
                 mask=ok, other=0).to(tl.int32)
    kc = (kb >> (2 * (cols // (D // 4)))[None, :]) & 3
    if HAS_LO:  # formula 9: the low plane's 2 bits under the high plane's
        lb = tl.load(lo_ptr + (page * stride_kcp + h * stride_kch + o * stride_kct)[:, None]
                     + (cols % (D // 4))[None, :], mask=ok, other=0).to(tl.int32)
        kc = kc * 4 + ((lb >> (2 * (cols // (D // 4)))[None, :]) & 3)
    k_mean = tl.load(k_mean_ptr + h * stride_kmh + cols, mask=cm, other=0.0)
    _dequant_tile(kc, ks_ptr, kz_ptr, page * stride_ksp + h * stride_ksh + o * stride_kst, cols, stride_ksg, k_mean,
                  okt, ok, k_out_ptr, t64 * stride_kon + h * stride_koh + cols[None, :], G_K, NG_K, META8, HAS_LO)

    # values: channel i of token o is residue o % 4 of byte (o % R) // 4 of row (o // R)·D + i
    vrow = (o // R) * D
    vb = tl.load(vc_ptr + (page * stride_vcp + h * stride_vch + ((o % R) // 4))[:, None]
                 + (vrow[:, None] + cols[None, :]).to(tl.int64) * stride_vcr, mask=ok, other=0).to(tl.int32)
    vc = (vb >> (2 * (o % 4))[:, None]) & 3
    v_mean = tl.load(v_mean_ptr + h * stride_vmh + cols, mask=cm, other=0.0)
    _dequant_tile(vc, vs_ptr, vz_ptr, page * stride_vsp + h * stride_vsh + o * stride_vst, cols, stride_vsg, v_mean,
                  okt, ok, v_out_ptr, t64 * stride_von + h * stride_voh + cols[None, :], G_V, NG_V, META8)
