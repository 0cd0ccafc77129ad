"""The INT2 cache: tiers, demotion, bitwise history, BPE, chunked-prefill semantics, rotation folding."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.calib import random_transform
from helpers.layers import decode_logits, feed, kernel_model_and_method
from helpers.tiny import tiny_causal_lm

from oscar_cli.errors import EvalError
from oscar_cli.method_registry import METHOD_NAMES
from oscar_cli.quant import LayerTransform, build_method, greedy_generate, oscar_method, parse_methods, use_method
from oscar_cli.quant.cache import Int2Cache
from oscar_cli.quant.generation import cache_kwarg, prefill
from oscar_cli.quant.int2_layer import Int2Layer
from oscar_cli.quant.kivi import KiviLayer, dequantize_channels, quantize_channels
from oscar_cli.quant.methods import bf16_method, kivi2_method, naive_int2_method
from oscar_kernels.reference import dequantize_rows, quantize_rows, rotate

pytestmark = pytest.mark.unit

H, D = 2, 16


@pytest.mark.parametrize("n_rot", [1, H], ids=["shared-R", "per-head-R"])
def test_history_equals_reference_bitwise(n_rot: int) -> None:
    torch.manual_seed(1)
    t = random_transform(3, n_rot)
    meth = oscar_method([t], sink=8, recent=16)
    layer = Int2Layer(meth, t, rotate_values=True)
    total = 100 + 21
    k = torch.randn(2, H, total, D).bfloat16()
    v = torch.randn(2, H, total, D).bfloat16()
    feed(layer, k, v, [60, 40], 21)
    r_k = t.k_rotation[0] if n_rot == 1 else t.k_rotation
    r_v = t.v_rotation[0] if n_rot == 1 else t.v_rotation
    kr = rotate(k, r_k).to(torch.bfloat16)
    vr = rotate(v, r_v).to(torch.bfloat16)
    n_sink, n_hist, n_recent = layer.tier_sizes()
    assert n_sink == 8 and n_sink + n_hist + n_recent == total
    for which, rows, mean, view in (("k", kr, t.k_mean, layer.stored()[0]), ("v", vr, t.v_mean, layer.stored()[1])):
        hist = layer.history(which)
        assert hist is not None
        ref = quantize_rows(rows[..., 8 : 8 + n_hist, :], None, mean, t.k_clip, None, torch.bfloat16)
        assert torch.equal(hist[0], ref.packed) and torch.equal(hist[1], ref.scale) and torch.equal(hist[2], ref.zero)
        deq = (dequantize_rows(ref) + mean.unsqueeze(-2)).to(torch.bfloat16)
        assert torch.equal(view[..., 8 : 8 + n_hist, :], deq)
        assert torch.equal(view[..., :8, :], rows[..., :8, :])  # sink stays BF16 (rotated)
        assert torch.equal(view[..., 8 + n_hist :, :], rows[..., 8 + n_hist :, :])  # recent stays BF16


def test_demotion_in_blocks_of_8_recent_between_w_and_w_plus_7() -> None:
    meth = oscar_method([LayerTransform()], sink=8, recent=16)
    layer = Int2Layer(meth, LayerTransform())
    k = torch.randn(1, H, 200, D)
    layer.update(k[..., :50, :], k[..., :50, :])
    assert layer.tier_sizes() == (8, 26, 16)  # docs/METHOD.md §11.10: [0,S0) sink, [S0,L-W) INT2, [L-W,L) recent
    seen = []
    for i in range(50, 90):
        before = layer.tier_sizes()[1]
        layer.update(k[..., i : i + 1, :], k[..., i : i + 1, :])
        sink, hist, recent = layer.tier_sizes()
        assert 16 <= recent <= 16 + 7 and hist - before in (0, 8)
        seen.append(recent)
    assert min(seen) == 16 and max(seen) == 23


def assert_value_pages_match_history(layer: Int2Layer) -> None:
    """Every value page (token quads) holds its row's history codes, packed by the reference (keys == values)."""
    from oscar_kernels.reference import pack_token_quads, unpack_int2

    pool = layer.pool
    assert pool is not None and pool.v is not None
    hist = layer.history("k")
    assert hist is not None
    codes, p = unpack_int2(hist[0]), pool.page
    for b in range(pool.batch):
        n = pool.lengths[b]
        row = codes[b, :, codes.shape[2] - n :]
        for i in range(pool.n_pages[b]):
            want = pack_token_quads(row[:, i * p : min(n, (i + 1) * p)], min(p, 64))
            assert torch.equal(pool.v.packed[int(pool.table[b, i])], want), f"row {b} page {i}"


def test_value_pages_follow_the_history_incrementally() -> None:
    """The kernel's value layout (token quads in pages) tracks the history through odd prefill lengths,
    demotions, page boundaries, pool growth and reorders."""
    meth = oscar_method([LayerTransform()], sink=8, recent=16)
    layer = Int2Layer(meth, LayerTransform(), page_size=16)
    k = torch.randn(2, H, 120, D, generator=torch.Generator().manual_seed(4))
    layer.update(k[..., :47, :], k[..., :47, :])  # 23 history rows: the last quad is partial
    assert_value_pages_match_history(layer)
    for i in range(47, 120):  # the history crosses several 16-token pages
        layer.update(k[..., i : i + 1, :], k[..., i : i + 1, :])
        assert_value_pages_match_history(layer)
    assert layer.tier_sizes()[1] > 64 and layer.pool is not None and layer.pool.grows > 0
    before = layer.history("k")
    layer.reorder_cache(torch.tensor([1, 0]))
    assert_value_pages_match_history(layer)
    after = layer.history("k")
    assert before is not None and after is not None and torch.equal(after[0], before[0][[1, 0]])


def test_new_tokens_attend_unquantized_and_nonfinal_chunk_has_no_recent() -> None:
    """docs/METHOD.md §11.13 at the cache level: chunk B sees [sink | INT2(A) | B unquantized]."""
    t = random_transform(5)
    meth = oscar_method([t], sink=8, recent=16)
    layer = Int2Layer(meth, t, rotate_values=True)
    k, v = torch.randn(1, H, 90, D), torch.randn(1, H, 90, D)
    (ka, va), (kb, vb) = feed(layer, k, v, [40, 50], 0)
    kr = rotate(k, t.k_rotation[0])
    assert torch.equal(ka, kr[..., :40, :])  # a lone chunk attends to itself unquantized
    hist_a = quantize_rows(kr[..., 8:40, :], None, t.k_mean, t.k_clip, None, torch.bfloat16)
    deq_a = dequantize_rows(hist_a) + t.k_mean.unsqueeze(-2)
    assert torch.equal(kb[..., :8, :], kr[..., :8, :])
    assert torch.equal(kb[..., 8:40, :], deq_a)  # the non-final chunk A went to INT2 entirely after the sink
    assert torch.equal(kb[..., 40:, :], kr[..., 40:90, :])  # B itself unquantized
    assert layer.tier_sizes() == (8, 90 - 8 - 16, 16)


def _bpe_case(method_name: str, length: int) -> tuple[float, float]:
    if method_name == "oscar":
        meth = oscar_method([LayerTransform()], sink=64, recent=256)
    elif method_name == "kivi-2":
        meth = kivi2_method()
    elif method_name == "bf16":
        meth = bf16_method()
    else:
        meth = naive_int2_method()
    cache = Int2Cache(meth, 1)
    x = torch.randn(1, H, length, D).bfloat16()
    cache.update(x, x, 0)
    return cache.measured_bits_per_element(), meth.bits_per_element(length, D)


@pytest.mark.parametrize("name", ["oscar", "naive-int2", "kivi-2", "bf16"])
@pytest.mark.parametrize("length", [100, 320, 1000, 1500])
def test_measured_bytes_equal_bpe_formula(name: str, length: int) -> None:
    measured, formula = _bpe_case(name, length)
    assert math.isclose(measured, formula, rel_tol=1e-12), (measured, formula)


def test_bpe_formula_values() -> None:
    """docs/METHOD.md §9 / §11.11 (G = D = 128, 16-bit metadata)."""
    meth = oscar_method([LayerTransform()])
    assert round(meth.bits_per_element(131072, 128), 4) == 2.2836
    assert round(meth.bits_per_element(32768, 128), 4) == 2.3843


def test_kivi_layer_rules_and_pad_exclusion() -> None:
    layer = KiviLayer(kivi2_method())
    layer.set_padding([0, 5])
    k, v = torch.randn(2, H, 310, D), torch.randn(2, H, 310, D)
    k[1, :, :5, :] = 1e4  # pad slots with absurd keys must not widen the per-channel ranges
    feed(layer, k, v, [300], 10)
    assert layer.nk_q == 256 and layer.nv_q == 310 - 128
    packed, scale, zero = quantize_channels(
        k[..., :128, :], torch.arange(128)[None, :] >= torch.tensor([0, 5])[:, None], torch.bfloat16
    )
    assert torch.equal(layer.k_blocks[0][:, :, 0], packed)
    assert float(scale[1].float().max()) < 100.0
    deq = dequantize_channels(packed, scale, zero)
    assert torch.equal(layer.keys[..., :128, :], deq)
    assert torch.equal(layer.keys[..., 256:, :], k[..., 256:310, :])  # key residual: L mod 128, unquantized


def test_bf16_through_cache_generates_like_plain_transformers() -> None:
    model = tiny_causal_lm()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    with use_method(model, bf16_method()) as session:
        via_generate = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=24,
            do_sample=False,
            **{cache_kwarg(model): session.new_cache()},
        )
        ours = greedy_generate(model, session.new_cache(), ids, torch.ones_like(ids), 24, [])
    assert torch.equal(plain, via_generate)
    assert ours[0] == plain[0, 40:].tolist()


def test_rotations_without_quantization_leave_the_model_unchanged() -> None:
    """docs/METHOD.md §11.9 + §11.13: one prefill chunk with random R_K/R_V (folded V) = the plain model."""
    model = tiny_causal_lm()
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(ids).logits
    w_before = model.model.layers[0].self_attn.v_proj.weight.clone()
    meth = oscar_method([random_transform(7, 2), random_transform(9, 1)], sink=8, recent=16)
    for fold in (True, False):
        with use_method(model, meth, fold_values=fold) as session:
            cache = session.new_cache()
            logits = prefill(model, cache, ids, torch.ones_like(ids), chunk_size=4096, all_logits=True)
        assert torch.allclose(logits, plain, atol=2e-5, rtol=1e-4)
    assert torch.equal(model.model.layers[0].self_attn.v_proj.weight, w_before)  # fold undone on exit
    assert model.config._attn_implementation != "oscar_int2"
    with use_method(model, meth) as session:  # a second chunk sees the first one quantized
        cache = session.new_cache()
        chunked = prefill(model, cache, ids, torch.ones_like(ids), chunk_size=32, all_logits=True)
    assert torch.allclose(chunked[:, :32], plain[:, :32], atol=2e-5, rtol=1e-4)
    assert not torch.allclose(chunked[:, 32:], plain[:, 32:], atol=1e-3)


@pytest.mark.parametrize("name", ["naive-int2", "quarot-int2", "kivi-2"])
def test_every_method_runs_through_the_model(name: str) -> None:
    model = tiny_causal_lm()
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    with use_method(model, build_method(name, model.config)) as session:
        cache = session.new_cache()
        out = greedy_generate(model, cache, ids, mask, 5, [], chunk_size=16)
    assert len(out) == 2 and all(len(o) == 5 for o in out)
    assert cache.get_seq_length() == 30 + 4


def test_method_names_and_errors() -> None:
    assert parse_methods("bf16, oscar,bf16") == ["bf16", "oscar"]
    with pytest.raises(EvalError, match="valid methods: bf16, naive-int2"):
        parse_methods("bf16,fp8")
    with pytest.raises(EvalError, match="--artifact"):
        build_method("oscar", tiny_causal_lm().config)
    assert set(METHOD_NAMES) == {"bf16", "naive-int2", "quarot-int2", "kivi-2", "oscar"}


def _write_tiny_artifact(path, cfg, seed: int = 11):
    from oscar_cli.artifact import Manifest, write_artifact
    from oscar_cli.model import architecture_fingerprint

    layers = []
    for i in range(cfg.num_hidden_layers):
        t = random_transform(seed + i)
        layers.append(
            LayerTransform(
                t.k_rotation, t.v_rotation, t.k_mean, t.v_mean, torch.zeros(1, D), torch.zeros(1, D), 0.9, 0.9
            )
        )
    manifest = Manifest(
        oscar_version="0.1.0",
        model={"reference": "tiny", "resolved": "sha256:" + "0" * 64},
        architecture=architecture_fingerprint(cfg),
        method="oscar",
        recipe={},
        quant={"group_size": None, "meta_dtype": "bfloat16", "sink": 8, "recent": 16},
        data={},
        seed=0,
    )
    return write_artifact(path, manifest, layers, "{}\n"), layers


def test_oscar_method_from_artifact_and_refusal_for_another_model(tmp_path) -> None:
    from oscar_cli.errors import ArtifactError

    cfg = tiny_causal_lm().config
    path, layers = _write_tiny_artifact(tmp_path / "art", cfg)
    meth = build_method("oscar", cfg, artifact=str(path))
    assert (meth.sink, meth.recent, meth.kind) == (8, 16, "int2")
    assert torch.equal(meth.layers[1].k_rotation, layers[1].k_rotation) and meth.layers[0].v_clip == pytest.approx(0.9)
    other = tiny_causal_lm().config
    other.num_hidden_layers = 3
    with pytest.raises(ArtifactError, match="another model"):
        build_method("oscar", other, artifact=str(path))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")


@pytest.mark.gpu
@needs_cuda
def test_cuda_cache_matches_cpu_reference_bitwise() -> None:
    """The same rows quantized by the cache on CUDA and on CPU: identical codes, scales, zeros and views."""
    t = random_transform(21)
    meth = oscar_method([t], sink=8, recent=16)
    k, v = torch.randn(3, H, 140, D).bfloat16(), torch.randn(3, H, 140, D).bfloat16()
    layers = {}
    for dev in ("cpu", "cuda"):
        # rotate on CPU once, so both devices quantize the very same bf16 rows (GPU matmul order differs)
        layer = Int2Layer(meth, LayerTransform(k_mean=t.k_mean, v_mean=t.v_mean, k_clip=0.9, v_clip=0.9))
        feed(layer, k.to(dev), v.to(dev), [100, 20], 20)
        layers[dev] = layer
    for which in ("k", "v"):
        cpu, gpu = layers["cpu"].history(which), layers["cuda"].history(which)
        assert cpu is not None and gpu is not None
        for a, b in zip(cpu, gpu, strict=True):
            assert torch.equal(a, b.cpu())
    assert torch.equal(layers["cpu"].keys, layers["cuda"].keys.cpu())


@pytest.mark.gpu
@needs_cuda
def test_cuda_bf16_method_generates_like_plain_model() -> None:
    model = tiny_causal_lm(dtype=torch.bfloat16).cuda()
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(5)).cuda()
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    with use_method(model, bf16_method()) as session:
        ours = greedy_generate(model, session.new_cache(), ids, torch.ones_like(ids), 16, [])
    assert ours == plain[:, 48:].tolist()
    with use_method(model, build_method("quarot-int2", model.config)) as session:
        out = greedy_generate(model, session.new_cache(), ids, torch.ones_like(ids), 4, [], chunk_size=16)
    assert len(out[0]) == 4


@pytest.mark.parametrize("meta", [torch.bfloat16, torch.uint8], ids=["meta16", "meta8"])
def test_triton_decode_path_matches_reference_in_interpreter(monkeypatch: pytest.MonkeyPatch, meta: torch.dtype) -> None:
    """The Triton decode kernel behind the same attention function (CPU: TRITON_INTERPRET=1, fp16; conftest), with
    16-bit metadata and with formula 10's bytes (written by the Triton quantizer, read in the decode tile)."""
    if torch.cuda.is_available():
        pytest.skip("covered by the gpu variant on CUDA machines")
    from dataclasses import replace

    import oscar_kernels.ops as ops

    calls = []
    real = ops.decode_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "decode_attention", counting)
    model, meth = kernel_model_and_method()
    meth = replace(meth, meta_dtype=meta)
    caches: list = []
    ref = decode_logits(model, meth, "reference", "cpu", 2, caches)
    fast = decode_logits(model, meth, "triton", "cpu", 2, caches)
    assert len(calls) == 2  # one layer x two decode steps went through the kernel
    for which in ("k", "v"):  # the prefill's INT2 rows, written by the Triton quantizer: bitwise the reference's
        a, b = caches[0].oscar_layers[0].history(which), caches[1].oscar_layers[0].history(which)
        assert a[1].dtype == meta and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert (ref - fast).abs().max().item() < 2e-3 * max(1.0, ref.abs().max().item())
    calls.clear()
    ref_pad = decode_logits(model, meth, "reference", "cpu", 1, pad=5)  # left-padded row: sink gathered
    fast_pad = decode_logits(model, meth, "triton", "cpu", 1, pad=5)
    assert len(calls) == 1
    assert (ref_pad - fast_pad).abs().max().item() < 2e-3 * max(1.0, ref_pad.abs().max().item())


@pytest.mark.parametrize("name", ["naive-int2", "quarot-int2"])
def test_triton_decode_without_recent_window_matches_reference(name: str) -> None:
    """W = 0: the new token is the recent tier, K after RoPE (a fresh tensor) and V a view of the projection, so
    their size-1 token dims have different strides; the kernel must take them (it failed eval-kl on the H200)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case")
    model = tiny_causal_lm(dtype=torch.float16, head_dim=64, layers=1, hidden_size=128)
    meth = build_method(name, model.config)
    assert meth.recent == 0
    ref = decode_logits(model, meth, "reference", "cpu", 2)
    fast = decode_logits(model, meth, "triton", "cpu", 2)
    assert (ref - fast).abs().max().item() < 2e-3 * max(1.0, ref.abs().max().item())


@pytest.mark.gpu
@needs_cuda
def test_triton_decode_path_matches_reference_on_cuda() -> None:
    model, meth = kernel_model_and_method()
    model = model.cuda()
    ref = decode_logits(model, meth, "reference", "cuda", 8)
    fast = decode_logits(model, meth, "triton", "cuda", 8)
    assert (ref - fast).abs().max().item() < 2e-3 * max(1.0, ref.abs().max().item())


def test_equal_window_override_applies_to_per_token_int2_methods() -> None:
    from oscar_cli.method_registry import parse_windows

    cfg = tiny_causal_lm().config
    naive = build_method("naive-int2", cfg, windows=(8, 16))
    assert (naive.sink, naive.recent) == (8, 16) and "+windows S0=8 W=16" in naive.source
    assert build_method("kivi-2", cfg, windows=(8, 16)).recent == 128  # KIVI keeps its own residual
    assert parse_windows("64,256") == (64, 256) and parse_windows(None) is None
    with pytest.raises(EvalError, match="multiples of 8"):
        build_method("quarot-int2", cfg, windows=(5, 16))
    with pytest.raises(EvalError, match="SINK,RECENT"):
        parse_windows("64")
