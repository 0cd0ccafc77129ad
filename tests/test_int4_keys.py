"""INT4 keys on chosen layers (recipe ``quant.int4_keys``): reference formula 9 (two INT2 planes), the cache layer
that stores and reads them, the recipe and manifest knobs, the bits they cost, calibration's choice and the
refusals of the paths that read 2-bit keys only."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers.calib import RESOLVED, copy_chosen_pair, random_transform, serve_model_to_cli, tiny_recipe
from helpers.layers import feed
from helpers.tiny import tiny_causal_lm
from typer.testing import CliRunner

from oscar_cli.artifact.card import bpe_table
from oscar_cli.calibration.run import calibrate_model
from oscar_cli.errors import OscarError, RecipeError
from oscar_cli.method_registry import build_method
from oscar_cli.quant import oscar_method, use_method
from oscar_cli.quant.bits import storage_bits
from oscar_cli.quant.generation import cache_kwarg
from oscar_cli.quant.int2_layer import Int2Layer
from oscar_cli.recipe import recipe_from_dict
from oscar_kernels.reference import (
    dequantize_codes,
    dequantize_int4_planes,
    quantize_int2,
    quantize_int4_planes,
    quantize_rows_int4,
    rotate,
    unpack_int2,
)

pytestmark = pytest.mark.unit

H, D = 2, 16


@pytest.mark.parametrize(("d", "g"), [(4, None), (16, 4), (64, None), (128, 32)])
@pytest.mark.parametrize("meta", [torch.bfloat16, torch.float16, torch.float32])
def test_formula_9_codes_bounds_and_the_coarse_plane(d: int, g: int | None, meta: torch.dtype) -> None:
    """Codes 0..15 split into planes 0..3; with float32 metadata every value is within half a fine step; the group
    minimum decodes exactly; the high plane alone is a valid INT2 row (formula 7 with the stored scale)."""
    gen = torch.Generator().manual_seed(d + (g or 0))
    y = torch.randn(5, 3, d, generator=gen) * torch.logspace(-2, 1, d)
    hi, lo, scale, zero = quantize_int4_planes(y, g, meta)
    assert hi.dtype == lo.dtype == torch.uint8 and int(hi.max()) <= 3 and int(lo.max()) <= 3
    assert scale.dtype == zero.dtype == meta and scale.shape == (5, 3, d // (g or d))
    x = dequantize_int4_planes(hi, lo, scale, zero)
    fine = (scale.float() / 4).repeat_interleave(g or d, -1)
    if meta == torch.float32:
        assert bool(((x - y).abs() <= fine / 2 * (1 + 1e-5) + 1e-6).all())
    groups = y.reshape(5, 3, -1, g or d)
    at_min = groups == groups.amin(-1, keepdim=True)
    assert torch.equal(x.reshape(groups.shape)[at_min],
                       zero.float().unsqueeze(-1).expand(groups.shape)[at_min])
    assert torch.equal(dequantize_codes(hi, scale, zero), zero.float().repeat_interleave(g or d, -1)
                       + hi.float() * scale.float().repeat_interleave(g or d, -1))


def test_formula_9_is_four_times_finer_than_int2_and_refuses_mismatched_planes() -> None:
    y = torch.randn(4000, 64, generator=torch.Generator().manual_seed(3))
    hi, lo, scale, zero = quantize_int4_planes(y)
    err4 = (dequantize_int4_planes(hi, lo, scale, zero) - y).square().mean()
    c, s, z = quantize_int2(y)
    err2 = (dequantize_codes(c, s, z) - y).square().mean()
    assert float(err2 / err4) > 16  # steps 15 vs 3 levels apart: (5)^2 = 25 in theory
    with pytest.raises(ValueError, match="same shape"):
        dequantize_int4_planes(hi, lo[..., :-4], scale, zero)


@pytest.mark.parametrize(("chunks", "decode", "pads"), [([60, 40], 21, [0, 0]), ([7], 50, [0, 5]), ([90], 0, [3, 0])])
@pytest.mark.parametrize("n_rot", [1, H])
def test_an_int4_key_layer_stores_formula_9_and_values_stay_int2(chunks: list[int], decode: int, pads: list[int],
                                                                 n_rot: int) -> None:
    """What attention reads from the history: keys are formula 9 of the rotated, centred rows (no clip), bitwise;
    values exactly as an INT2 layer stores them; left padding and decode demotion across pages included."""
    t = random_transform(5, n_rot)
    meth = replace(oscar_method([t], sink=8, recent=16), key_bits=4)
    four, two = Int2Layer(meth, t, page_size=16), Int2Layer(replace(meth, key_bits=2), t, page_size=16)
    total = sum(chunks) + decode
    gen = torch.Generator().manual_seed(7)
    k, v = torch.randn(2, H, total, D, generator=gen).bfloat16(), torch.randn(2, H, total, D, generator=gen).bfloat16()
    for layer in (four, two):
        layer.pads = list(pads)  # what Int2Cache.set_padding hands each layer
        feed(layer, k, v, chunks, decode)
    s, n_hist, _ = four.tier_sizes()
    assert four.tier_sizes() == two.tier_sizes() and n_hist > 0
    (k4, v4), (k2, v2) = four.stored(), two.stored()
    r_k = t.k_rotation[0] if n_rot == 1 else t.k_rotation
    rows = rotate(k, r_k).to(torch.bfloat16)[..., s : s + n_hist, :]
    q, lo = quantize_rows_int4(rows, None, t.k_mean)
    want = (dequantize_int4_planes(unpack_int2(q.packed), unpack_int2(lo), q.scale, q.zero)
            + t.k_mean.unsqueeze(-2)).to(torch.bfloat16)
    for b, pad in enumerate(pads):  # pad slots are never read; the real rows' history must match bitwise
        first = max(0, pad - s)
        assert torch.equal(k4[b, :, s + first : s + n_hist], want[b, :, first:])
    assert torch.equal(v4, v2)
    assert torch.equal(k4[..., :s, :], k2[..., :s, :]) and torch.equal(k4[..., s + n_hist :, :], k2[..., s + n_hist :, :])
    err = [float((x[..., s : s + n_hist, :].float() - rows.float() - 0).square().mean()) for x in (k4, k2)]
    assert err[0] < err[1] / 4
    lengths = sum(four.pool.lengths)  # type: ignore[union-attr]
    assert four.storage_bytes() - two.storage_bytes() == H * lengths * D // 4


def test_an_int4_key_layer_survives_batch_selection() -> None:
    t = random_transform(9)
    meth = replace(oscar_method([t], sink=8, recent=16), key_bits=4)
    layer = Int2Layer(meth, t, page_size=16)
    k = torch.randn(3, H, 120, D)
    feed(layer, k, k, [100], 20)
    before = layer.stored()[0]
    layer.batch_select_indices(torch.tensor([2, 0]))
    assert torch.equal(layer.stored()[0], before[[2, 0]])


def test_int4_keys_refuse_the_knobs_they_do_not_combine_with() -> None:
    t = random_transform(2)
    with pytest.raises(OscarError, match="do not combine"):
        Int2Layer(replace(oscar_method([t], sink=8, recent=16), key_bits=4, logit_correction="scale"), t)


def test_recipe_knob_and_its_refusals() -> None:
    from oscar_cli.recipe import Recipe

    assert "int4_keys" not in Recipe().to_dict()["quant"]
    on = Recipe().replace({"quant": {"int4_keys": 3, "key_mean": "rope"}})
    assert on.to_dict()["quant"]["int4_keys"] == 3 and recipe_from_dict(on.to_dict()) == on
    for clash, name in (({"bf16_keys": 1}, "quant.bf16_keys"), ({"keep": {"fraction": 0.01}}, "quant.keep.fraction"),
                        ({"key_subspace": 2}, "quant.key_subspace"), ({"levels": 0.3}, "quant.levels"),
                        ({"logit_correction": "scale"}, "quant.logit_correction")):
        with pytest.raises(RecipeError, match=name):
            recipe_from_dict({"quant": {"int4_keys": 2, **clash}})
    with pytest.raises(RecipeError, match="method oscar"):
        recipe_from_dict({"method": "identity", "quant": {"int4_keys": 2}})


@pytest.mark.parametrize(("ctx", "sink", "recent"), [(32768, 64, 256), (300, 64, 256), (200, 64, 256), (4096, 0, 0)])
def test_int4_keys_cost_two_bits_per_history_key(ctx: int, sink: int, recent: int) -> None:
    base = dict(group_size=None, meta_bits=16, sink=sink, recent=recent)
    two, four = storage_bits("int2", ctx, 128, **base), storage_bits("int2", ctx, 128, key_bits=4, **base)  # type: ignore[arg-type]
    assert four - two == pytest.approx(max(0, ctx - sink - recent) / ctx)
    meth = replace(oscar_method([random_transform(1, d=128)] * 4), int4_key_layers=(1, 3))
    per = [meth.for_layer(i).bits_per_element(ctx, 128) for i in range(4)]
    assert [meth.for_layer(i).key_bits for i in range(4)] == [2, 4, 2, 4]
    assert meth.bits_per_element(ctx, 128) == pytest.approx(sum(per) / 4)


def test_calibration_stores_the_chosen_layers_keys_in_int4(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``quant.int4_keys: 2``: the two layers of largest copy score are recorded (``quant.int4_keys`` and
    ``calibration.int4_keys``), served with INT4 keys, and counted in the artifact's and the card's bits."""
    model, plain, res, manifest, want = copy_chosen_pair(tmp_path, monkeypatch, {"int4_keys": 2}, 2)
    assert len(want) == 2 and manifest["quant"]["int4_keys"] == want
    assert manifest["calibration"]["int4_keys"] == want and res.to_dict()["int4_keys"] == want
    meth = build_method("oscar", model.config, artifact=str(tmp_path / "a"))
    assert meth.int4_key_layers == tuple(want)
    assert res.schemes is not None and plain.schemes is not None
    assert res.schemes.bits_per_element["artifact"] > plain.schemes.bits_per_element["artifact"]
    assert bpe_table(manifest)["32k"] == pytest.approx(meth.bits_per_element(32768, model.config.head_dim), abs=1e-4)
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    with use_method(model, meth) as session:
        cache = session.new_cache()
        model(ids, **{cache_kwarg(model): cache}, use_cache=True)
        assert [lay.key4 for lay in cache.oscar_layers] == [i in want for i in range(4)]
        assert [lay.k_lo is not None for lay in cache.oscar_layers] == [i in want for i in range(4)]


def test_a_manifest_naming_a_layer_beyond_the_model_is_refused(tmp_path: Path) -> None:
    from oscar_cli.artifact.schema import ManifestSchema

    model = tiny_causal_lm("llama", layers=2)
    calibrate_model(model, None, tiny_recipe(quant={"int4_keys": 1}), reference="t", resolved=RESOLVED,
                    out=tmp_path / "a")
    doc = json.loads((tmp_path / "a" / "manifest.json").read_text())
    doc["quant"]["int4_keys"] = [0, 2]
    with pytest.raises(ValueError, match="quant.int4_keys names layer 2; the model has 2 layers"):
        ManifestSchema.model_validate(doc)


def test_vllm_serves_int4_keys_with_the_low_plane_in_those_layers_pages() -> None:
    """The vLLM backend takes an artifact with INT4 keys: its settings name the layers, whose pages are a low
    plane (``D/4`` bytes per token and KV head) larger."""
    from oscar_cli.vllm import layout, spec

    meth = replace(oscar_method([random_transform(1, d=128)] * 3, sink=64, recent=256), int4_key_layers=(0, 2))
    s = layout.check_method(meth, head_dim=128, block_size=16)
    assert s.int4_layers == (0, 2) and [s.key_bits(i) for i in range(3)] == [4, 2, 4]
    assert spec.slot_bytes(128, s.meta_bytes, 4) - spec.slot_bytes(128, s.meta_bytes, 2) == 32


def test_cli_prints_the_layers_whose_keys_are_int4(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from oscar_cli.calibration import copy_score
    from oscar_cli.main import app

    monkeypatch.setattr(copy_score, "SHARP", 0.0)
    recipe = serve_model_to_cli(monkeypatch, tiny_causal_lm("llama", layers=4), "tiny", tmp_path)
    result = CliRunner().invoke(app, ["calibrate", "tiny", "--recipe", str(recipe), "--int4-keys", "1",
                                      "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert "keys in INT4 (quant.int4_keys, transformers and vLLM): layers " in result.stdout
    assert "copy score 0." in result.stdout.split("keys in INT4")[1]
    assert len(json.loads((tmp_path / "a" / "manifest.json").read_text())["quant"]["int4_keys"]) == 1
    bad = CliRunner().invoke(app, ["calibrate", "tiny", "--recipe", str(recipe), "--int4-keys", "-1"])
    assert bad.exit_code == 2 and "--int4-keys" in bad.output
    clash = CliRunner().invoke(app, ["calibrate", "tiny", "--recipe", str(recipe), "--int4-keys", "1", "--key-mean",
                                     "rope", "--out", str(tmp_path / "b")])
    assert clash.exit_code == 0, clash.output  # the rope mean combines with INT4 keys


@pytest.mark.parametrize("pad", [0, 5], ids=["no-pad", "left-pad"])
@pytest.mark.parametrize("key_mean", ["constant", "rope"])
def test_triton_decode_with_int4_keys_matches_the_reference_path(pad: int, key_mean: str) -> None:
    """The Triton path (CPU: TRITON_INTERPRET=1, fp16) on an INT4-key layer: the history written bitwise as the
    reference path writes it (both planes), and decode through the kernel reading both planes (the low plane as
    ``low_plane``) gives the reference path's logits; without the low plane the logits move (it matters)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case")
    from helpers.layers import decode_logits, kernel_model_and_method

    from oscar_kernels import ops

    model, meth = kernel_model_and_method(key_mean_pre=3.0 if key_mean == "rope" else 0.0)
    meth = replace(meth, int4_key_layers=(0,))
    caches: list = []
    ref = decode_logits(model, meth, "reference", "cpu", 3, caches, pad=pad, length=90)
    calls: list[bool] = []
    real = ops.decode_attention

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs.get("low_plane") is not None and kwargs.get("logit_bias") is None)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "decode_attention", spy)
        fast = decode_logits(model, meth, "triton", "cpu", 3, caches, pad=pad, length=90)
    assert calls == [True, True, True]
    a, b = caches[0].oscar_layers[0], caches[1].oscar_layers[0]
    assert a.key4 and b.path == "triton"
    for which in ("k", "v"):
        assert all(torch.equal(x, y) for x, y in zip(a.history(which), b.history(which), strict=True)), which
    assert torch.equal(a.k_lo, b.k_lo)
    assert (ref - fast).abs().max().item() < 2e-3 * max(1.0, ref.abs().max().item())
    def high_plane_only(*args, **kwargs):  # type: ignore[no-untyped-def]
        return real(*args, **{**kwargs, "low_plane": None})

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "decode_attention", high_plane_only)
        coarse = decode_logits(model, meth, "triton", "cpu", 3, pad=pad, length=90)
    err, coarse_err = (fast - ref).abs().max().item(), (coarse - ref).abs().max().item()
    assert coarse_err > 4 * err, (coarse_err, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
@pytest.mark.parametrize("key_mean", ["constant", "rope"])
def test_triton_decode_with_int4_keys_on_cuda(key_mean: str) -> None:
    """The same check on CUDA (compiled kernel reading both planes): logits within the decode budget of the
    reference path's; the low plane bitwise (both paths write it with the reference quantizer)."""
    from helpers.layers import decode_logits, kernel_model_and_method

    model, meth = kernel_model_and_method(key_mean_pre=3.0 if key_mean == "rope" else 0.0)
    meth = replace(meth, int4_key_layers=(0,))
    model = model.cuda()
    caches: list = []
    ref = decode_logits(model, meth, "reference", "cuda", 8, caches, pad=5, length=300)
    fast = decode_logits(model, meth, "triton", "cuda", 8, caches, pad=5, length=300)
    assert caches[1].oscar_layers[0].path == "triton"
    assert torch.equal(caches[0].oscar_layers[0].k_lo, caches[1].oscar_layers[0].k_lo)
    assert (ref - fast).abs().max().item() < 2e-3 * max(1.0, ref.abs().max().item())
