"""Pure-torch CPU reference of oscar's INT2 KV format: the specification every fast path answers to.

This module imports no Triton and runs anywhere torch runs. Kernels, the transformers cache and the
evaluation all call it (or are tested against it), so accuracy results and kernels cannot drift apart.

Shape alphabet: ``B`` batch, ``H_q`` query heads, ``H_kv`` KV heads, ``g = H_q / H_kv``, ``T`` tokens,
``D`` head_dim, ``G`` quantization group size along D (``D % G == 0``; default ``G = D``).

Formulas (per row ``x``: one token of one KV head, ``D`` values; all arithmetic in float32)
-------------------------------------------------------------------------------------------
1. Rotate: ``y = x @ R`` with ``R`` float32 ``[D, D]`` orthogonal (omitted: identity).
2. Center: ``y = y - mu`` with ``mu`` float32 ``[D]`` in the rotated space (omitted: zeros).
3. Clip (symmetric about 0, per row, over the whole row even when ``G < D``):
   ``idx = min(int(ratio * D), D - 1)``; ``tau = sort(|y|)[idx]`` (ascending); ``y = clamp(y, -tau, tau)``.
   ``ratio <= 0`` disables clipping (output identical to the unclipped path). Ratio 0.96 at D = 128 gives
   idx 122 (the 5 largest distinct magnitudes are clipped), 0.92 gives idx 117 (10 clipped).
4. Per group of ``G`` consecutive channels: ``mn = min(y)``, ``mx = max(y)``,
   ``s = max(mx - mn, 1e-8) / 3``. Metadata is stored in ``meta_dtype`` (bfloat16 | float16 | float32),
   rounded to nearest: ``scale = s.to(meta_dtype)``, ``zero = mn.to(meta_dtype)``.
   **``zero`` is the group minimum (offset form)**, so ``x_hat = zero + code * scale``. The published
   float zero-point ``z = -min / s`` carries the same information; the offset form is what a decode kernel
   consumes (``scores = s·(q·c) + m·Σq``).
5. Codes, from the *stored* metadata so that encoder and decoder agree:
   ``code = clamp(floor((y - float(zero)) / float(scale) + 0.5), 0, 3)`` — round half up, IEEE float32
   division (Triton: ``tl.math.div_rn``; plain ``/`` is approximate on GPUs), then ``floor``.
6. Quarter packing: byte ``i`` (``0 <= i < D/4``) holds
   ``c[i] | c[i + D/4] << 2 | c[i + D/2] << 4 | c[i + 3D/4] << 6`` — the first quarter of the row sits in
   bits 0-1 (lowest), the last quarter in bits 6-7.
   **Value layout of the decode kernels** (the same codes, arranged for the consumer): token-quad packing,
   :func:`pack_token_quads` — byte ``(d, i)`` of a ``[D, R/4]`` row block holds tokens ``4i .. 4i+3`` of the
   block's ``R`` tokens (64, or a whole page of at most 64) of channel ``d``, the earliest in bits 0-1. Keys always use quarter packing (their MMA reduction axis is D).
7. Dequantize: ``x_hat = float(zero) + code * float(scale)`` in float32 (``code`` as float32; one multiply,
   one add, no fma), then cast to the requested dtype.
8. Non-uniform levels (optional, reference path only; recipe ``quant.levels``): with ``inner`` ``a`` in
   ``(0, 0.5)`` the four levels of a group are ``zero + scale·L[code]``, ``L = (0, 3a, 3 - 3a, 3)`` (float64
   arithmetic, then float32; uniform is ``a = 1/3``, ``L = (0, 1, 2, 3)`` exactly). Scale and zero are those of
   step 4 (the extreme levels stay the group's min and max). Codes: ``v = (y - float(zero)) / float(scale) + 0.5``
   in float32 exactly as in step 5, ``code = #{k : v >= theta_k}`` with ``theta_k = float32((L[k-1] + L[k]) / 2
   + 0.5)``, ``k = 1..3``: the nearest level, a value exactly halfway going up (round half up, as step 5); at
   ``a = 1/3`` the thresholds are 1, 2, 3 and the codes are step 5's bitwise. Dequantize:
   ``float(zero) + L[code] * float(scale)`` in float32 (step 7 with ``L[code]`` for ``code``).
9. INT4 keys as two INT2 bit planes (optional, written by this quantizer on both cache paths; recipe
   ``quant.int4_keys``): per group
   ``scale = (max(mx - mn, 1e-8) · 4 / 15).to(meta_dtype)``, ``zero = mn.to(meta_dtype)`` (no clip); the fine
   step is ``f = float(scale) / 4`` (exact); ``code = clamp(floor((y - float(zero)) / f + 0.5), 0, 15)`` (IEEE
   division, round half up as step 5); the **high plane** ``code >> 2`` is stored exactly like an INT2 row
   (quarter packing, this ``scale`` and ``zero``: read alone by step 7 it is a valid coarse INT2 row), the **low
   plane** ``code & 3`` quarter-packed beside it (no metadata of its own). Dequantize: ``float(zero) + code · f``
   in float32 with ``code = 4·hi + lo``. Storage: 4 bits per element plus the one ``scale``/``zero`` pair.
10. 8-bit metadata (optional; recipe ``quant.meta_dtype: uint8``; also written and read by the Triton kernels): ``scale`` and ``zero`` are
   one byte each, so a row of ``D = 64`` costs 2.25 bits per element instead of 2.5 (``D = 128``: 2.125, not 2.25).
   Per group, from formula 4's (or 9's) ``mn``, ``mx`` and step ``s`` (``s = max(mx - mn, 1e-8) / 3``; INT4:
   ``· 4 / 15``), with ``n = 3`` grid steps (INT4: ``15/4`` coarse steps): ``mid = (mn + mx) · 0.5``,
   ``s' = max(s, |mid| / 5.5)`` (IEEE division; only rows far off centre widen their step, so ``zero`` fits).
   **Scale byte** ``e << 3 | m`` (unsigned e5m3, exponent bias 16): ``s'``'s float32 bits rounded half up to 3
   mantissa bits, ``r = (bits + 2^19) >> 20``, ``e = (r >> 3) - 127 + 16``, ``m = r & 7``; ``e < 0`` stores byte 0,
   ``e > 31`` byte 255. Decoded ``sf = 2^(e - 16) · (1 + m/8)`` (built from its bits: exact; range
   ``2^-16 … 61440``: a smaller step is stored as ``2^-16``, a larger one saturates and clips). **Zero byte** ``z + 128``: ``z = clamp(floor((mid - n·sf/2) / (sf/16) + 0.5), -128, 127)``
   (float32, IEEE division), decoded ``zf = z · (sf / 16)`` (exact). So the grid ``zf + code·sf`` is centred on
   the group's range (error of the centre ≤ ``sf/32``) and its step is ``s`` to within ``±1/16``. Codes and
   dequantization are formulas 5 / 7 / 8 / 9 with ``sf`` and ``zf`` for ``float(scale)`` and ``float(zero)``.

Attention over the three tiers (sink: absolute positions ``[0, S0)``; history: INT2; recent: the last
tokens) computes one partial ``(o_t, lse_t)`` per tier — softmax attention restricted to that tier, with
``lse = m + log(Σ exp(s - m))`` in the natural-log domain — and merges them:
``o = Σ_t exp(lse_t - M) · o_t / Σ_t exp(lse_t - M)``, ``M = max_t lse_t``. An empty tier has
``lse = -inf`` and contributes nothing; a row with no keys at all yields zeros, never NaN. The merge equals
single-pass softmax attention over the concatenated (dequantized) keys and values.

Bits per element (per stored K or V element, all tiers, docs/METHOD.md §9):
``BPE(L) = [(L - S0 - W)·(2 + 2·b_meta/G) + (S0 + W)·16] / L`` (for ``L <= S0 + W`` everything is 16-bit;
``b_meta`` = 16, or 8 with formula 10).

What can be asserted
--------------------
- **Bitwise** (``atol = rtol = 0``): codes, ``scale``, ``zero`` and packed bytes (either layout) of any fast
  quantizer fed the same float32 rotated rows; ``unpack_int2(pack_int2(c)) == c``,
  ``unpack_token_quads(pack_token_quads(c), T) == c``; codes lie in ``{0, 1, 2, 3}``.
- **Exact by construction**: a group's minimum decodes to ``float(zero)`` exactly (code 0); with float32
  metadata its maximum decodes to ``mn + 3·s`` which equals ``mx`` up to float32 rounding of ``s`` (≤ 2 ulp of
  ``mx``); with 16-bit metadata the extremes are reproduced to the metadata's rounding.
- **Bounded**: for clipped rows, ``|x_hat - y| <= scale/2 + |zero - mn| + 3·|scale - s| + tiny`` elementwise;
  with float32 metadata that is ``scale/2`` up to float32 rounding.
- **Formula 10** (8-bit metadata): ``decode_meta`` is exact (every byte pair decodes to a float32 without rounding);
  for a group whose centre is within ``5.5·s`` of 0, ``|float(scale) - s| <= s/16`` and
  ``|x_hat - y| <= sf/2 + 1.5·|sf - s| + sf/32``; otherwise the step widens to ``|mid|/5.5`` and the grid still
  covers the group (``tests/test_meta8.py``).
- **Tolerance only**: attention outputs. Fast paths follow the flash-attention error budget
  ``|fast - ref64| <= 2·|ref_same_dtype - ref64| + floor`` where both references dequantize the same codes.
- ``merge_partials`` over any split of the keys equals ``attention_partial`` over all of them (float64:
  ≤ 1e-12 relative).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from oscar_kernels.layout import DEFAULT_RECENT, DEFAULT_SINK, UNIFORM_INNER

__all__ = [
    "QuantizedRows",
    "attention_partial",
    "UNIFORM_INNER",
    "bits_per_element",
    "clip_rows",
    "clip_threshold",
    "decode_attention_reference",
    "dequantize_codes",
    "dequantize_int4_planes",
    "dequantize_int2",
    "dequantize_rows",
    "fake_quantize_rows",
    "hadamard",
    "decode_meta",
    "encode_meta",
    "level_codes",
    "level_table",
    "merge_partials",
    "META8",
    "meta_bits",
    "pack_int2",
    "pack_token_quads",
    "quantize_int2",
    "quantize_int4_planes",
    "quantize_rows",
    "quantize_rows_int4",
    "rotate",
    "rows_to_token_quads",
    "token_quad_row",
    "TOKEN_QUAD_ROW",
    "unpack_int2",
    "unpack_token_quads",
]

_META_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.uint8)
META8 = torch.uint8  # formula 10: one byte of scale and one of zero per group
_E5M3_BIAS = 16


def meta_bits(meta_dtype: torch.dtype) -> int:
    """Stored bits of one ``scale`` (or ``zero``): 16 / 32 for the float dtypes, 8 for formula 10."""
    if meta_dtype not in _META_DTYPES:
        raise ValueError(f"meta_dtype: expected one of {_META_DTYPES}, got {meta_dtype}")
    return 8 if meta_dtype == META8 else torch.finfo(meta_dtype).bits


def decode_meta(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored ``scale`` and ``zero`` as float32 (formula 10's bytes decoded, other dtypes widened)."""
    if scale.dtype != META8:
        return scale.float(), zero.float()
    b = scale.to(torch.int32)
    sf = ((((b >> 3) - _E5M3_BIAS + 127) << 23) | ((b & 7) << 20)).view(torch.float32)
    zf = (zero.to(torch.int32) - 128).float() * (sf / 16)
    return sf, zf


def encode_meta(
    s: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, steps: float, meta_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored ``(scale, zero)`` for a grid ``zero + k·scale`` of ``steps`` steps over ``[mn, mx]`` (float32
    ``[..., D/G]``; ``s`` the step formula 4 / 9 chose): rounded to ``meta_dtype`` (formula 4), or formula 10."""
    if meta_dtype != META8:
        return s.to(meta_dtype), mn.to(meta_dtype)
    mid = (mn + mx) * 0.5
    wide = torch.maximum(s, mid.abs() / torch.full_like(mid, 5.5))
    r = (wide.contiguous().view(torch.int32) + (1 << 19)) >> 20
    e = (r >> 3) - 127 + _E5M3_BIAS
    byte = torch.where(e < 0, 0, torch.where(e > 31, 255, (e << 3) | (r & 7)))
    scale = byte.to(torch.uint8)
    sf, _ = decode_meta(scale, scale)
    z = torch.floor((mid - sf * (steps / 2)) / (sf / 16) + 0.5).clamp_(-128, 127)
    return scale, (z.to(torch.int32) + 128).to(torch.uint8)


def level_table(inner: float = UNIFORM_INNER) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(levels, thresholds)`` of formula 8: ``L = (0, 3a, 3 - 3a, 3)`` and ``theta_k = (L[k-1] + L[k])/2 + 0.5``
    as float32 values (Python floats). ``a = 1/3`` gives ``(0, 1, 2, 3)`` and ``(1, 2, 3)``."""
    a = float(inner)
    if not 0.0 < a < 0.5:
        raise ValueError(f"inner level: expected a value in (0, 0.5) (uniform: 1/3), got {inner!r}")
    lv = (0.0, 3.0 * a, 3.0 - 3.0 * a, 3.0)
    th = tuple((lv[k - 1] + lv[k]) / 2 + 0.5 for k in (1, 2, 3))

    def f32(xs: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(float(x) for x in torch.tensor(xs, dtype=torch.float64).float().tolist())

    return f32(lv), f32(th)


@dataclass(frozen=True)
class QuantizedRows:
    """INT2 rows as stored: ``packed`` uint8 ``[..., D/4]``, ``scale`` and ``zero`` ``[..., D/G]``.

    ``zero`` is the group minimum (offset form): ``x_hat = zero + code * scale``.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def head_dim(self) -> int:
        return int(self.packed.shape[-1]) * 4

    @property
    def group_size(self) -> int:
        return self.head_dim // int(self.scale.shape[-1])


def _check_rows(name: str, x: torch.Tensor) -> int:
    if x.dim() < 1 or x.shape[-1] % 4 != 0 or x.shape[-1] == 0:
        raise ValueError(
            f"{name}: expected [..., D] with D a positive multiple of 4, got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    return int(x.shape[-1])


def hadamard(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix of size ``d`` (a power of two), natural order, symmetric.

    ``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]] / sqrt(2)``.
    """
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard: size must be a power of two, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(dtype)


def rotate(x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """``x @ R`` in float32. ``x [..., D]``; ``R`` ``[D, D]`` or per KV head ``[H_kv, D, D]``.

    With a per-head ``R``, ``x`` must be ``[B, H_kv, T, D]`` (head axis at -3).
    """
    x32 = x.float()
    if rotation is None:
        return x32
    r = rotation.float()
    if r.dim() == 2:
        return x32 @ r
    if r.dim() == 3 and x32.dim() >= 3 and x32.shape[-3] == r.shape[0]:
        return torch.einsum("...htd,hde->...hte", x32, r)
    raise ValueError(
        f"rotation: expected [D, D] or [H_kv, D, D] matching x {tuple(x.shape)}, got {tuple(rotation.shape)}"
    )


def clip_threshold(y: torch.Tensor, ratio: float) -> torch.Tensor:
    """Per-row clip threshold ``tau = sort(|y|)[min(int(ratio * D), D - 1)]``, shape ``[..., 1]``."""
    d = _check_rows("y", y)
    idx = min(int(ratio * d), d - 1)
    return torch.kthvalue(y.float().abs(), idx + 1, dim=-1, keepdim=True).values


def clip_rows(y: torch.Tensor, ratio: float) -> torch.Tensor:
    """Clip each row symmetrically to ``[-tau, tau]`` (float32). ``ratio <= 0`` returns ``y`` unchanged."""
    y32 = y.float()
    if ratio <= 0:
        return y32
    tau = clip_threshold(y32, ratio)
    return torch.minimum(torch.maximum(y32, -tau), tau)


def _group_ranges(
    y: torch.Tensor, group_size: int | None, meta_dtype: torch.dtype
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked ``D``, rows as float32 groups ``[..., D/G, G]`` and each group's min and max ``[..., D/G]``."""
    d = _check_rows("y", y)
    g = d if group_size is None else int(group_size)
    if g <= 0 or d % g:
        raise ValueError(f"group_size: must divide D={d}, got {group_size}")
    if meta_dtype not in _META_DTYPES:
        raise ValueError(f"meta_dtype: expected one of {_META_DTYPES}, got {meta_dtype}")
    y32 = y.float().reshape(*y.shape[:-1], d // g, g)
    return d, y32, y32.amin(dim=-1), y32.amax(dim=-1)


def quantize_int2(
    y: torch.Tensor, group_size: int | None = None, meta_dtype: torch.dtype = torch.bfloat16,
    inner: float = UNIFORM_INNER,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max INT2 per group of ``G`` channels.

    Args:
        y: ``[..., D]`` rows (already rotated, centred and clipped), any float dtype; computed in float32.
        group_size: ``G`` dividing ``D`` (default ``D``).
        meta_dtype: storage dtype of scale and zero.
        inner: the inner level of formula 8 (default uniform: formula 5, computed as before).

    Returns:
        ``codes`` uint8 ``[..., D]`` in ``{0..3}``, ``scale`` and ``zero`` ``meta_dtype [..., D/G]``.
    """
    d, y32, mn, mx = _group_ranges(y, group_size, meta_dtype)
    # Divide by a same-device tensor, not a Python scalar: torch on CUDA turns `x / 3.0` into `x * (1/3)`,
    # which is not IEEE division and would break bitwise agreement with the kernels (div_rn).
    s = torch.clamp(mx - mn, min=1e-8) / torch.full_like(mx, 3.0)
    scale, zero = encode_meta(s, mn, mx, 3.0, meta_dtype)
    sf, zf = (t.unsqueeze(-1) for t in decode_meta(scale, zero))
    if inner == UNIFORM_INNER:
        codes = torch.floor((y32 - zf) / sf + 0.5).clamp_(0, 3).to(torch.uint8)
    else:
        codes = level_codes((y32 - zf) / sf + 0.5, inner)
    return codes.reshape(*y.shape[:-1], d), scale, zero


def quantize_int4_planes(
    y: torch.Tensor, group_size: int | None = None, meta_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Formula 9: asymmetric min-max INT4 per group of ``G`` channels, split into two INT2 planes.

    Args:
        y: ``[..., D]`` rows (already rotated and centred; not clipped), any float dtype; computed in float32.
        group_size: ``G`` dividing ``D`` (default ``D``).
        meta_dtype: storage dtype of scale and zero.

    Returns:
        ``hi``, ``lo`` uint8 ``[..., D]`` in ``{0..3}`` (the 4-bit code is ``4·hi + lo``), ``scale`` (the high
        plane's step, 4 fine steps) and ``zero`` ``meta_dtype [..., D/G]``.
    """
    d, y32, mn, mx = _group_ranges(y, group_size, meta_dtype)
    s = torch.clamp(mx - mn, min=1e-8) * torch.full_like(mx, 4.0) / torch.full_like(mx, 15.0)
    scale, zero = encode_meta(s, mn, mx, 15 / 4, meta_dtype)
    sf, zf = decode_meta(scale, zero)
    fine = (sf / torch.full_like(mx, 4.0)).unsqueeze(-1)
    codes = torch.floor((y32 - zf.unsqueeze(-1)) / fine + 0.5).clamp_(0, 15).to(torch.uint8)
    codes = codes.reshape(*y.shape[:-1], d)
    return codes >> 2, codes & 3, scale, zero


def dequantize_int4_planes(
    hi: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Formula 9's decode: ``float(zero) + (4·hi + lo) · (float(scale) / 4)`` per group, from unpacked planes
    ``uint8 [..., D]``; returns ``out_dtype [..., D]``."""
    if hi.shape != lo.shape:
        raise ValueError(f"hi/lo: expected the same shape, got {tuple(hi.shape)} and {tuple(lo.shape)}")
    code = (hi.to(torch.int32) * 4 + lo.to(torch.int32)).to(torch.uint8)
    sf, zf = decode_meta(scale, zero)
    return dequantize_codes(code, sf / 4, zf, out_dtype)


def level_codes(v: torch.Tensor, inner: float) -> torch.Tensor:
    """Formula 8's codes from ``v = (y - zero) / scale + 0.5`` (float32): ``#{k : v >= theta_k}`` as uint8."""
    _, th = level_table(inner)
    codes = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for t in th:
        codes += (v >= t).to(torch.uint8)
    return codes


def pack_int2(codes: torch.Tensor) -> torch.Tensor:
    """Quarter packing: ``uint8 [..., D] -> uint8 [..., D/4]``; first quarter in the lowest bits."""
    d = _check_rows("codes", codes)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes: expected uint8, got {codes.dtype} {tuple(codes.shape)} on {codes.device}")
    q = d // 4
    c = codes.to(torch.int32)
    out = c[..., :q] | (c[..., q : 2 * q] << 2) | (c[..., 2 * q : 3 * q] << 4) | (c[..., 3 * q :] << 6)
    return out.to(torch.uint8)


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int2`: ``uint8 [..., D/4] -> uint8 [..., D]``."""
    if packed.dtype != torch.uint8 or packed.dim() < 1:
        raise ValueError(f"packed: expected uint8 [..., D/4], got {packed.dtype} {tuple(packed.shape)} on {packed.device}")
    p = packed.to(torch.int32)
    parts = [(p >> shift) & 3 for shift in (0, 2, 4, 6)]
    return torch.cat(parts, dim=-1).to(torch.uint8)


TOKEN_QUAD_ROW = 64  # tokens per token-quad row: a 64-token decode tile reads D rows of 16 contiguous bytes


def token_quad_row(page_size: int) -> int:
    """Tokens per token-quad row of a page of ``page_size`` tokens: the page itself up to 64 tokens, else 64 (pages
    larger than 64 tokens must be multiples of 64; a non-paged sequence uses 64)."""
    return page_size if page_size <= TOKEN_QUAD_ROW else TOKEN_QUAD_ROW


def pack_token_quads(codes: torch.Tensor, row_tokens: int = TOKEN_QUAD_ROW) -> torch.Tensor:
    """Token-quad packing (the decode kernel's value layout): codes ``uint8 [..., T, D] -> uint8 [..., n·D, R/4]``
    with ``R = row_tokens`` tokens per row and ``n = ⌈T/R⌉`` row blocks.

    Row ``i·D + d`` holds tokens ``R·i .. R·i + R - 1`` of channel ``d``; its byte ``j`` holds
    ``c[t, d] | c[t+1, d] << 2 | c[t+2, d] << 4 | c[t+3, d] << 6`` (``t = R·i + 4j``): four consecutive tokens of
    one channel, the earliest in the lowest bits; tokens past ``T`` pack as 0. Dims-major within a row block, so the
    ``V^T`` tile a decode kernel multiplies (``[D, tokens]``, tokens along the MMA reduction axis) unpacks straight
    into operand registers, and a 64-token tile of a row block is ``D`` rows of 16 contiguous bytes (one 2 KB block
    at ``D = 128``). A page of ``P <= 64`` tokens is one row block ``[D, P/4]`` (``row_tokens = P``); larger pages and
    non-paged sequences use rows of 64 tokens. Scale and zero stay per token, exactly as in the row layout.
    """
    if codes.dtype != torch.uint8 or codes.dim() < 2:
        raise ValueError(f"codes: expected uint8 [..., T, D], got {codes.dtype} {tuple(codes.shape)} on {codes.device}")
    if row_tokens <= 0 or row_tokens % 4:
        raise ValueError(f"row_tokens: expected a positive multiple of 4, got {row_tokens}")
    t, d = codes.shape[-2], codes.shape[-1]
    n = max(1, -(-t // row_tokens))
    c = torch.nn.functional.pad(codes.to(torch.int32), (0, 0, 0, n * row_tokens - t))  # [..., n·R, D]
    c = c.reshape(*c.shape[:-2], n, row_tokens // 4, 4, d).permute(*range(c.dim() - 2), -4, -1, -3, -2)
    packed = c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)  # [..., n, D, R/4]
    return packed.reshape(*packed.shape[:-3], n * d, row_tokens // 4).to(torch.uint8).contiguous()


def unpack_token_quads(packed: torch.Tensor, tokens: int | None = None, head_dim: int | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_token_quads`: ``uint8 [..., n·D, R/4] -> uint8 [..., T, D]`` (first ``tokens`` rows);
    ``head_dim`` D (default: the row count, one row block)."""
    if packed.dtype != torch.uint8 or packed.dim() < 2:
        raise ValueError(f"packed: expected uint8 [..., n·D, R/4], got {packed.dtype} {tuple(packed.shape)} on "
                         f"{packed.device}")
    rows, rl = packed.shape[-2], packed.shape[-1]
    d = rows if head_dim is None else head_dim
    if d <= 0 or rows % d:
        raise ValueError(f"packed: {rows} rows are not whole blocks of head_dim {d} ({tuple(packed.shape)})")
    p = packed.to(torch.int32).reshape(*packed.shape[:-2], rows // d, d, rl)
    c = torch.stack([(p >> shift) & 3 for shift in (0, 2, 4, 6)], -1)  # [..., n, D, R/4, 4]
    c = c.reshape(*c.shape[:-2], 4 * rl).transpose(-1, -2)  # [..., n, R, D]
    c = c.reshape(*c.shape[:-3], -1, d)
    return c[..., : (c.shape[-2] if tokens is None else tokens), :].to(torch.uint8).contiguous()


def rows_to_token_quads(packed_rows: torch.Tensor, row_tokens: int = TOKEN_QUAD_ROW) -> torch.Tensor:
    """Quarter-packed rows ``[..., T, D/4]`` -> token quads ``[..., ⌈T/R⌉·D, R/4]`` (same codes, other layout)."""
    return pack_token_quads(unpack_int2(packed_rows), row_tokens)


def dequantize_int2(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out_dtype: torch.dtype = torch.float32,
    inner: float = UNIFORM_INNER,
) -> torch.Tensor:
    """``x_hat = float(zero) + code * float(scale)`` per group (``L[code]`` for ``code`` with a non-uniform
    ``inner``, formula 8); returns ``out_dtype [..., D]``."""
    return dequantize_codes(unpack_int2(packed), scale, zero, out_dtype, inner)


def dequantize_codes(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out_dtype: torch.dtype = torch.float32,
    inner: float = UNIFORM_INNER,
) -> torch.Tensor:
    """:func:`dequantize_int2` from unpacked codes ``uint8 [..., D]`` (either packing, once unpacked)."""
    if inner == UNIFORM_INNER:
        codes = codes.float()
    else:
        lv, _ = level_table(inner)
        codes = torch.tensor(lv, dtype=torch.float32, device=codes.device)[codes.long()]
    d = codes.shape[-1]
    n_groups = scale.shape[-1]
    if d % n_groups or zero.shape != scale.shape:
        raise ValueError(
            f"scale/zero: expected [..., D/G] with G dividing D={d}, got scale {tuple(scale.shape)} zero {tuple(zero.shape)}"
        )
    g = d // n_groups
    c = codes.reshape(*codes.shape[:-1], n_groups, g)
    sf, zf = decode_meta(scale, zero)
    x = zf.unsqueeze(-1) + c * sf.unsqueeze(-1)
    return x.reshape(*codes.shape[:-1], d).to(out_dtype)


def _transform(
    x: torch.Tensor, rotation: torch.Tensor | None, mean: torch.Tensor | None, clip_ratio: float
) -> torch.Tensor:
    y = rotate(x, rotation)
    if mean is not None:
        m = mean.float()
        if m.dim() == 2 and y.dim() >= 3:  # per KV head [H_kv, D]
            m = m.unsqueeze(-2)
        y = y - m
    return clip_rows(y, clip_ratio)


def quantize_rows(
    x: torch.Tensor,
    rotation: torch.Tensor | None = None,
    mean: torch.Tensor | None = None,
    clip_ratio: float = 0.0,
    group_size: int | None = None,
    meta_dtype: torch.dtype = torch.bfloat16,
    inner: float = UNIFORM_INNER,
) -> QuantizedRows:
    """The whole write path: rotate → center → clip → quantize → pack.

    Args:
        x: ``[..., D]`` rows (e.g. post-RoPE keys ``[B, H_kv, T, D]``), any float dtype.
        rotation: ``[D, D]`` or ``[H_kv, D, D]`` float32 (None: identity).
        mean: ``[D]`` or ``[H_kv, D]`` in the rotated space (None: no centering).
        clip_ratio: see :func:`clip_rows`.
        inner: the inner level (formula 8; default uniform).
    """
    y = _transform(x, rotation, mean, clip_ratio)
    codes, scale, zero = quantize_int2(y, group_size, meta_dtype, inner)
    return QuantizedRows(pack_int2(codes), scale, zero)


def quantize_rows_int4(
    x: torch.Tensor,
    rotation: torch.Tensor | None = None,
    mean: torch.Tensor | None = None,
    group_size: int | None = None,
    meta_dtype: torch.dtype = torch.bfloat16,
) -> tuple[QuantizedRows, torch.Tensor]:
    """Formula 9's write path: rotate → center → INT4 (no clip) → the high plane as stored INT2 rows (quarter
    packed, with the scale and zero) and the low plane quarter packed ``uint8 [..., D/4]``."""
    hi, lo, scale, zero = quantize_int4_planes(_transform(x, rotation, mean, 0.0), group_size, meta_dtype)
    return QuantizedRows(pack_int2(hi), scale, zero), pack_int2(lo)


def dequantize_rows(
    q: QuantizedRows, out_dtype: torch.dtype = torch.float32, inner: float = UNIFORM_INNER
) -> torch.Tensor:
    """Dequantize stored rows back to the rotated, centred space (no inverse rotation)."""
    return dequantize_int2(q.packed, q.scale, q.zero, out_dtype, inner)


def fake_quantize_rows(
    x: torch.Tensor,
    rotation: torch.Tensor | None = None,
    mean: torch.Tensor | None = None,
    clip_ratio: float = 0.0,
    group_size: int | None = None,
    meta_dtype: torch.dtype = torch.bfloat16,
    inner: float = UNIFORM_INNER,
) -> torch.Tensor:
    """``dequantize_rows(quantize_rows(...))`` in float32: rotated, centred space, like the cache stores it."""
    return dequantize_rows(quantize_rows(x, rotation, mean, clip_ratio, group_size, meta_dtype, inner), inner=inner)


def attention_partial(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention restricted to one set of keys, returning the partial output and its LSE.

    Args:
        q: ``[B, H_q, Tq, D]``; k, v: ``[B, H_kv, T, D]`` with ``H_q % H_kv == 0`` (GQA, contiguous groups).
        scale: softmax scale (usually ``D ** -0.5``).
        mask: optional bool ``[Tq, T]`` or broadcastable to ``[B, H_q, Tq, T]``; True = attend.
        bias: optional per-key logit term broadcastable to ``[B, H_q, Tq, T]``, added to the scaled logits.

    Returns:
        ``out [B, H_q, Tq, D]`` (zeros where a query sees no key) and ``lse [B, H_q, Tq]`` (``-inf`` there).
        Computed in float64 if any input is float64, else float32.
    """
    dt = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype) else torch.float32
    b, hq, tq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    if hq % max(hkv, 1) or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"attention_partial: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} incompatible")
    if t == 0:
        return q.new_zeros(b, hq, tq, v.shape[-1], dtype=dt), q.new_full((b, hq, tq), -math.inf, dtype=dt)
    g = hq // hkv
    kk = k.to(dt).repeat_interleave(g, dim=1)
    vv = v.to(dt).repeat_interleave(g, dim=1)
    s = (q.to(dt) @ kk.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.to(dt)
    if mask is not None:
        s = s.masked_fill(~mask.to(torch.bool), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    finite = torch.isfinite(lse)
    p = torch.exp(s - torch.where(finite, lse, torch.zeros_like(lse)).unsqueeze(-1))
    p = torch.where(finite.unsqueeze(-1), p, torch.zeros_like(p))
    return p @ vv, lse


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of partial attentions ``[(out [..., D], lse [...]), ...]``.

    Empty partials (``lse = -inf``) are skipped; a row where every partial is empty yields zeros and -inf.
    """
    if not parts:
        raise ValueError("merge_partials: need at least one partial")
    lses = torch.stack([lse for _, lse in parts], dim=0)
    outs = torch.stack([o for o, _ in parts], dim=0)
    m = lses.amax(dim=0)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m_safe.unsqueeze(0))  # exp(-inf) = 0 for empty partials
    denom = w.sum(dim=0)
    out = (w.unsqueeze(-1) * outs).sum(dim=0) / torch.where(denom > 0, denom, torch.ones_like(denom)).unsqueeze(-1)
    lse = m_safe + torch.log(denom)  # log(0) = -inf for fully empty rows
    return out, torch.where(denom > 0, lse, torch.full_like(lse, -math.inf))


def decode_attention_reference(
    q: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    hist_k: QuantizedRows,
    hist_v: QuantizedRows,
    recent_k: torch.Tensor,
    recent_v: torch.Tensor,
    scale: float,
    compute_dtype: torch.dtype = torch.float32,
    hist_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over sink (BF16) + history (INT2) + recent (BF16), merged by log-sum-exp.

    Everything is in the rotated (and centred) space: ``q`` must already be ``q @ R_K``; the output is in
    the rotated value space (the caller adds ``mu_V`` and multiplies by ``R_Vᵀ``).

    Args:
        q: ``[B, H_q, Tq, D]``.
        sink_k, sink_v, recent_k, recent_v: ``[B, H_kv, T_tier, D]`` (``T_tier`` may be 0).
        hist_k, hist_v: :class:`QuantizedRows` with ``packed [B, H_kv, T_hist, D/4]``.
        scale: softmax scale.
        compute_dtype: float32 or float64 (the float64 oracle of the kernel error budget).
        hist_bias: optional per-key logit term of the history ``[B, H_q, T_hist]`` (natural units, added to the
            scaled logits; e.g. :func:`rope_mean_logits`), the BF16 tiers take none.

    Returns:
        ``[B, H_q, Tq, D]`` in ``compute_dtype``.
    """
    kh = dequantize_rows(hist_k, compute_dtype)
    vh = dequantize_rows(hist_v, compute_dtype)
    qc = q.to(compute_dtype)
    parts = [
        attention_partial(qc, sink_k.to(compute_dtype), sink_v.to(compute_dtype), scale),
        attention_partial(qc, kh, vh, scale, bias=None if hist_bias is None else hist_bias[:, :, None, :]),
        attention_partial(qc, recent_k.to(compute_dtype), recent_v.to(compute_dtype), scale),
    ]
    out, _ = merge_partials(parts)
    return out


def bits_per_element(
    context_len: int,
    head_dim: int = 128,
    group_size: int | None = None,
    meta_bits: int = 16,
    sink: int = DEFAULT_SINK,
    recent: int = DEFAULT_RECENT,
    hp_bits: int = 16,
) -> float:
    """Average stored bits per K (or V) element at context length ``L`` (docs/METHOD.md §9).

    ``BPE(L) = [(L - S0 - W)·(2 + 2·b_meta/G) + (S0 + W)·16] / L``; tokens that fit in sink + recent are
    all 16-bit. Example: L = 131072, D = G = 128, 16-bit metadata, S0 = 64, W = 256 → 2.2836.
    """
    if context_len <= 0:
        raise ValueError(f"context_len must be positive, got {context_len}")
    g = head_dim if group_size is None else group_size
    if g <= 0 or head_dim % g:
        raise ValueError(f"group_size must divide head_dim={head_dim}, got {group_size}")
    hp = min(context_len, sink + recent)
    hist = context_len - hp
    return (hist * (2 + 2 * meta_bits / g) + hp * hp_bits) / context_len


def rope_angles(inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE angles ``θ_k·p`` in float64 (exact for integer positions below 2^32): ``[..., D/2]`` for
    ``positions [...]`` (integers) and ``inv_freq [D/2]`` (the model's frequencies, as stored)."""
    return positions.to(torch.float64)[..., None] * inv_freq.to(positions.device, torch.float64)


def rope_cos_sin(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` float32 ``[..., D]`` of the ``rotate_half`` RoPE at integer ``positions``: ``scaling·cos(θ_k p)``
    repeated over both halves, from float64 angles (the position-dependent key mean's definition: the model's own
    float32 angles differ by at most half an ulp of ``θ_k p``, the same for every key at ``p``)."""
    ang = rope_angles(inv_freq, positions)
    cos, sin = torch.cos(ang) * scaling, torch.sin(ang) * scaling
    return torch.cat((cos, cos), -1).float(), torch.cat((sin, sin), -1).float()


def rope_mean_logits(
    q: torch.Tensor, mean_pre: torch.Tensor, inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """The logit term of the position-dependent key mean, in float64: ``sm_scale·q·RoPE_p(m_pre)`` per query head and
    position (the part of ``q·k`` that the INT2 history leaves out when it stores keys centred by their position's
    mean; with an orthogonal ``R_K`` it is the same in the rotated space).

    Args:
        q: ``[B, H_q, D]`` post-RoPE queries (unrotated).
        mean_pre: ``[H_kv, D]`` pre-RoPE key means (``H_q % H_kv == 0``, contiguous groups).
        inv_freq: ``[D/2]`` RoPE frequencies; scaling: the rotary embedding's attention scaling (YaRN's mscale, else 1).
        positions: int ``[B, T]`` RoPE positions of the history tokens.

    Returns:
        ``float64 [B, H_q, T]``.
    """
    h_q, h_kv = int(q.shape[1]), int(mean_pre.shape[0])
    ang = rope_angles(inv_freq, positions)  # [B, T, D/2]
    cos, sin = torch.cos(ang) * scaling, torch.sin(ang) * scaling
    m = mean_pre.double().repeat_interleave(h_q // h_kv, dim=0)  # [H_q, D]
    qq = q.double()
    half = int(q.shape[-1]) // 2
    a = qq[..., :half] * m[:, :half] + qq[..., half:] * m[:, half:]  # [B, H_q, D/2]: times cos(θ p)
    bb = qq[..., half:] * m[:, :half] - qq[..., :half] * m[:, half:]  # times sin(θ p)
    return sm_scale * (torch.einsum("bhk,btk->bht", a, cos) + torch.einsum("bhk,btk->bht", bb, sin))
