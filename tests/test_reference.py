"""The INT2 reference (oscar_kernels.reference): format vectors, bounds, merge, BPE."""

from __future__ import annotations

import math

import pytest
import torch

from oscar_kernels import reference as ref

pytestmark = pytest.mark.unit

META = [torch.bfloat16, torch.float16, torch.float32]
META_IDS = ["bf16", "fp16", "fp32"]
# (D, G) with lengths straddling groups; rows of random scale, incl. outlier channels
SHAPES = [(64, 64), (64, 32), (64, 16), (128, 128), (128, 64), (128, 32)]
SHAPE_IDS = [f"D{d}-G{g}" for d, g in SHAPES]


def _rows(seed: int, n: int, d: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen) * torch.rand(n, 1, generator=gen).mul(10).add(0.01)
    x[::7, 3] *= 40.0  # outlier channel on some rows
    return x


def test_spec_vector_arange_quantizer() -> None:
    """docs/METHOD.md §11.6: x = 0..127 → s = 42.333, code counts [22, 42, 42, 22], packed bytes."""
    x = torch.arange(128, dtype=torch.float32)
    codes, scale, zero = ref.quantize_int2(x, meta_dtype=torch.float32)
    assert scale.item() == pytest.approx(127 / 3, rel=1e-6)
    assert zero.item() == 0.0
    assert torch.bincount(codes.long(), minlength=4).tolist() == [22, 42, 42, 22]
    changes = (codes[1:] != codes[:-1]).nonzero().flatten().add(1).tolist()
    assert changes == [22, 64, 106]
    packed = ref.pack_int2(codes)
    assert packed[:4].tolist() == [164] * 4
    assert packed[28:32].tolist() == [229] * 4
    xh = ref.dequantize_int2(packed, scale, zero)
    assert xh[0].item() == 0.0
    assert xh[127].item() == pytest.approx(127.0, abs=1e-4)
    assert (xh - x).abs().max().item() == pytest.approx(21.0, abs=0.2)


@pytest.mark.parametrize("ratio,idx,n_clipped", [(0.96, 122, 5), (0.92, 117, 10)], ids=["K0.96", "V0.92"])
def test_clip_index_matches_spec(ratio: float, idx: int, n_clipped: int) -> None:
    gen = torch.Generator().manual_seed(7)
    y = torch.randperm(128, generator=gen).float().add(1.0) * torch.where(torch.rand(128, generator=gen) > 0.5, 1.0, -1.0)
    tau = ref.clip_threshold(y, ratio)
    assert tau.item() == float(idx + 1)  # |y| is a permutation of 1..128
    clipped = ref.clip_rows(y, ratio)
    assert int((clipped != y).sum()) == n_clipped


def test_clip_ratio_zero_is_identity() -> None:
    x = _rows(3, 17, 128)
    assert torch.equal(ref.clip_rows(x, 0.0), x)
    a = ref.quantize_rows(x, clip_ratio=0.0)
    codes, s, z = ref.quantize_int2(x)
    assert torch.equal(a.packed, ref.pack_int2(codes)) and torch.equal(a.scale, s) and torch.equal(a.zero, z)


@pytest.mark.parametrize("d,g", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("meta", META, ids=META_IDS)
def test_pack_roundtrip_and_code_range(d: int, g: int, meta: torch.dtype) -> None:
    x = _rows(d * 31 + g, 97, d)
    codes, scale, zero = ref.quantize_int2(x, g, meta)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 3
    assert scale.dtype == meta and zero.dtype == meta and scale.shape == (97, d // g)
    packed = ref.pack_int2(codes)
    assert packed.shape == (97, d // 4)
    assert torch.equal(ref.unpack_int2(packed), codes)
    # every byte pattern round-trips
    allbytes = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    assert torch.equal(ref.pack_int2(ref.unpack_int2(allbytes)), allbytes)


def test_bit_order_first_quarter_lowest() -> None:
    codes = torch.zeros(16, dtype=torch.uint8)
    codes[0] = 1  # quarter 0 -> bits 0-1 of byte 0
    codes[4] = 2  # quarter 1 -> bits 2-3 of byte 0
    codes[8] = 3  # quarter 2 -> bits 4-5
    codes[15] = 1  # quarter 3, position 3 -> bits 6-7 of byte 3
    assert ref.pack_int2(codes).tolist() == [1 | (2 << 2) | (3 << 4), 0, 0, 1 << 6]


@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 64, 65, 97, 200])
@pytest.mark.parametrize("row", [16, 64])
def test_token_quads_roundtrip_and_layout(tokens: int, row: int) -> None:
    codes = torch.randint(0, 4, (2, 3, tokens, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(tokens))
    packed = ref.pack_token_quads(codes, row)
    blocks = -(-tokens // row)
    assert packed.shape == (2, 3, blocks * 16, row // 4)
    assert torch.equal(ref.unpack_token_quads(packed, tokens, 16), codes)
    assert torch.equal(ref.rows_to_token_quads(ref.pack_int2(codes), row), packed)
    # row block i is the one-block packing of tokens [row·i, row·i + row)
    for i in range(blocks):
        want = ref.pack_token_quads(codes[..., row * i : row * (i + 1), :], row)
        assert torch.equal(packed[..., 16 * i : 16 * (i + 1), :], want)
    allbytes = torch.arange(256, dtype=torch.uint8).reshape(1, 8, 32)  # [.., D=8, R/4=32]: every byte round-trips
    assert torch.equal(ref.pack_token_quads(ref.unpack_token_quads(allbytes), 128), allbytes)


def test_token_quads_refuse_bad_rows() -> None:
    with pytest.raises(ValueError, match="row_tokens"):
        ref.pack_token_quads(torch.zeros(8, 4, dtype=torch.uint8), 6)
    with pytest.raises(ValueError, match="whole blocks of head_dim 5"):
        ref.unpack_token_quads(torch.zeros(16, 4, dtype=torch.uint8), head_dim=5)
    assert ref.token_quad_row(16) == 16 and ref.token_quad_row(64) == 64 and ref.token_quad_row(256) == 64


def test_token_quads_bit_order_earliest_token_lowest() -> None:
    codes = torch.zeros(6, 2, dtype=torch.uint8)  # [T, D]
    codes[0, 0], codes[1, 0], codes[3, 0] = 1, 2, 3  # tokens 0, 1, 3 of channel 0 -> bits 0-1, 2-3, 6-7
    codes[4, 1], codes[5, 1] = 3, 1  # tokens 4, 5 of channel 1 -> byte (1, 1), bits 0-1 and 2-3; tail pads 0
    assert ref.pack_token_quads(codes, 8).tolist() == [[1 | (2 << 2) | (3 << 6), 0], [0, 3 | (1 << 2)]]
    assert ref.pack_token_quads(codes)[:, :2].tolist() == [[1 | (2 << 2) | (3 << 6), 0], [0, 3 | (1 << 2)]]
    assert ref.pack_token_quads(codes).shape == (2, 16)  # a 64-token row, zero-padded


@pytest.mark.parametrize("d,g", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("meta", META, ids=META_IDS)
def test_min_max_and_error_bound(d: int, g: int, meta: torch.dtype) -> None:
    x = _rows(d + g + len(str(meta)), 129, d)
    y = ref.clip_rows(x, 0.95)
    codes, scale, zero = ref.quantize_int2(y, g, meta)
    xh = ref.dequantize_int2(ref.pack_int2(codes), scale, zero)
    yg = y.reshape(129, d // g, g)
    xg = xh.reshape(129, d // g, g)
    mn, mx = yg.amin(-1), yg.amax(-1)
    s_true = torch.clamp(mx - mn, min=1e-8) / 3
    # the group minimum decodes exactly to the stored zero; the maximum to zero + 3*scale
    cg = codes.reshape(129, d // g, g)
    assert torch.equal(xg.amin(-1), zero.float())
    assert (cg == 0).any(-1).all()
    assert torch.allclose(xg.amax(-1), zero.float() + 3 * scale.float(), rtol=1e-6, atol=0)
    # error bound: s/2 plus the metadata rounding terms (zero for fp32 up to float32 rounding)
    sf, zf = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
    meta_err = (zf - mn.unsqueeze(-1)).abs() + 3 * (sf - s_true.unsqueeze(-1)).abs()
    bound = sf / 2 + meta_err + 1e-5 * yg.abs().amax(-1, keepdim=True)
    assert ((xg - yg).abs() <= bound).all()
    if meta == torch.float32:
        assert torch.allclose(xg.amax(-1), mx, rtol=1e-5, atol=1e-6)
        assert ((xg - yg).abs() <= sf / 2 * (1 + 1e-5) + 1e-6).all()


def test_constant_row_is_exact() -> None:
    x = torch.full((3, 64), 2.5)
    q = ref.quantize_rows(x, meta_dtype=torch.float32)
    assert torch.equal(ref.dequantize_rows(q), x)


def test_rotation_and_mean_are_applied() -> None:
    x = _rows(11, 40, 64).reshape(2, 2, 10, 64)
    r = ref.hadamard(64, torch.float32)
    mu = torch.randn(64)
    want = ref.quantize_int2(x.float() @ r - mu)
    got = ref.quantize_rows(x, rotation=r, mean=mu)
    assert torch.equal(got.packed, ref.pack_int2(want[0]))
    # per-KV-head rotations [H_kv, D, D] and means [H_kv, D]
    r2 = torch.stack([r, torch.eye(64)])
    mu2 = torch.stack([mu, torch.zeros(64)])
    got2 = ref.quantize_rows(x, rotation=r2, mean=mu2)
    assert torch.equal(got2.packed[:, 0], got.packed[:, 0])
    assert torch.equal(got2.packed[:, 1], ref.quantize_rows(x[:, 1]).packed)


def test_hadamard_is_orthogonal_symmetric() -> None:
    h = ref.hadamard(128)
    assert torch.allclose(h @ h.T, torch.eye(128, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)
    assert torch.allclose(h[0], torch.full((128,), 128**-0.5, dtype=torch.float64))
    with pytest.raises(ValueError, match="power of two"):
        ref.hadamard(96)


@pytest.mark.parametrize(
    "hq,hkv,t_sink,t_hist,t_recent,tq",
    [(4, 2, 0, 31, 5, 1), (9, 3, 64, 97, 256, 1), (8, 8, 3, 0, 0, 2), (4, 1, 0, 0, 0, 1), (6, 2, 5, 130, 7, 3)],
    ids=["nosink", "smollm-gqa", "mha-nohist", "empty", "multi-q"],
)
@pytest.mark.parametrize("d", [64, 128], ids=["D64", "D128"])
def test_lse_merge_equals_single_pass(hq: int, hkv: int, t_sink: int, t_hist: int, t_recent: int, tq: int, d: int) -> None:
    gen = torch.Generator().manual_seed(hq * 1000 + t_hist + d)
    b = 2
    q = torch.randn(b, hq, tq, d, generator=gen, dtype=torch.float64)
    hk = ref.quantize_rows(torch.randn(b, hkv, t_hist, d, generator=gen))
    hv = ref.quantize_rows(torch.randn(b, hkv, t_hist, d, generator=gen))
    sk, sv = (torch.randn(b, hkv, t_sink, d, generator=gen, dtype=torch.float64) for _ in range(2))
    rk, rv = (torch.randn(b, hkv, t_recent, d, generator=gen, dtype=torch.float64) for _ in range(2))
    scale = d**-0.5
    out = ref.decode_attention_reference(q, sk, sv, hk, hv, rk, rv, scale, compute_dtype=torch.float64)
    k_all = torch.cat([sk, ref.dequantize_rows(hk, torch.float64), rk], dim=2)
    v_all = torch.cat([sv, ref.dequantize_rows(hv, torch.float64), rv], dim=2)
    if k_all.shape[2] == 0:
        assert torch.equal(out, torch.zeros_like(out))
        return
    g = hq // hkv
    s = (q @ k_all.repeat_interleave(g, 1).transpose(-1, -2)) * scale
    want = torch.softmax(s, dim=-1) @ v_all.repeat_interleave(g, 1)
    assert torch.isfinite(out).all()
    assert (out - want).abs().max().item() <= 1e-12 * max(1.0, want.abs().max().item())


def test_merge_many_splits_some_empty() -> None:
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 1, 64, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, 50, 64, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 2, 50, 64, generator=gen, dtype=torch.float64)
    whole, lse_whole = ref.attention_partial(q, k, v, 0.125)
    cuts = [0, 0, 7, 7, 30, 50, 50]
    parts = [ref.attention_partial(q, k[:, :, a:b], v[:, :, a:b], 0.125) for a, b in zip(cuts, cuts[1:], strict=False)]
    out, lse = ref.merge_partials(parts)
    assert torch.allclose(out, whole, rtol=1e-12, atol=1e-13)
    assert torch.allclose(lse, lse_whole, rtol=1e-12)
    # no keys at all: zeros, not NaN
    empty, lse_e = ref.merge_partials([ref.attention_partial(q, k[:, :, :0], v[:, :, :0], 0.125)])
    assert torch.equal(empty, torch.zeros_like(empty)) and torch.isinf(lse_e).all()


@pytest.mark.parametrize(
    "length,group,meta_bits,want",
    [(131072, None, 16, 2.2836), (32768, None, 16, 2.3843), (131072, None, 32, 2.5330), (131072, 64, 8, 2.2836)],
    ids=["128k-16b", "32k-16b", "128k-fp32", "128k-G64-8b"],
)
def test_bits_per_element_spec_values(length: int, group: int | None, meta_bits: int, want: float) -> None:
    got = ref.bits_per_element(length, head_dim=128, group_size=group, meta_bits=meta_bits)
    assert got == pytest.approx(want, abs=5e-5)


def test_bits_per_element_short_context_all_bf16() -> None:
    assert ref.bits_per_element(300) == 16.0
    assert ref.bits_per_element(320) == 16.0
    assert ref.bits_per_element(321) < 16.0
    assert math.isclose(ref.bits_per_element(10**9), 2.25, rel_tol=1e-5)


@pytest.mark.parametrize("bad", [torch.zeros(5, 6), torch.zeros(0)], ids=["D6", "empty"])
def test_bad_shapes_name_the_tensor(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=r"y: expected \[\.\.\., D\]"):
        ref.quantize_int2(bad)
    with pytest.raises(ValueError, match="group_size"):
        ref.quantize_int2(torch.zeros(2, 64), group_size=48)
