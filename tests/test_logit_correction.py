"""The logit-variance correction (recipe ``quant.logit_correction: scale``): the bias formula on a hand-made case,
zero on BF16 slots and the stored scales' formula on INT2 slots through the cache (prefill chunks and decode
steps), attention with the bias added, the recipe/artifact field, and the Triton/vLLM refusals."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers.calib import random_transform
from helpers.layers import assert_kernels_refuse

from oscar_cli.errors import RecipeError, UnsupportedModelError
from oscar_cli.quant import LayerTransform, oscar_method
from oscar_cli.quant.attention import logit_bias, oscar_attention
from oscar_cli.quant.int2_layer import Int2Layer, take_key_scale2
from oscar_cli.recipe import Recipe, recipe_from_dict
from oscar_kernels import reference as ref

pytestmark = pytest.mark.unit


def test_bias_formula_on_a_hand_made_case() -> None:
    """D = 4, G = 2, scaling 1/2: query (1, 2, 0, 1) has group energies (5, 1); a key with scales (0.5, 1) has
    σ² = (1/4)·(5·0.25 + 1·1)/12 = 0.046875, bias −σ²/2; a BF16 key (scale 0) gets 0. Query heads of one KV head
    share its keys' scales."""
    q = torch.tensor([[1.0, 2.0, 0.0, 1.0], [0.0, 0.0, 3.0, 0.0]]).view(1, 2, 1, 4)  # two query heads, one KV head
    s2 = torch.tensor([[0.25, 1.0], [0.0, 0.0], [4.0, 0.0]]).view(1, 1, 3, 2)
    got = logit_bias(q, s2, 0.5)
    want = torch.tensor([[-0.0234375, 0.0, -0.25 * 5 * 4 / 24], [-0.25 * 9 / 24, 0.0, 0.0]]).view(1, 2, 1, 3)
    assert got.shape == (1, 2, 1, 3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


def _meth(correction: str = "scale", sink: int = 8, recent: int = 16, t: LayerTransform | None = None):
    base = oscar_method([t or LayerTransform()], sink=sink, recent=recent)
    return replace(base, logit_correction=correction)


@pytest.mark.parametrize("chunks", [[200], [96, 64, 40]], ids=["one-chunk", "three-chunks"])
def test_cache_hands_zero_for_bf16_slots_and_squared_scales_for_int2(chunks: list[int]) -> None:
    """After every update (prefill chunks, then decode steps demoting blocks of 8) the squared scales handed to
    attention are 0 on sink, recent and new slots, and the stored scale² of each token's own round trip on the
    INT2 history; nothing is handed without INT2 slots or without the knob."""
    h, d, decode = 2, 16, 20  # _meth: sink 8, recent 16
    t = random_transform(3, 1, clip=0.9, d=d)
    meth = _meth(t=t)
    g = torch.Generator().manual_seed(0)
    total = sum(chunks) + decode
    k = torch.randn(1, h, total, d, generator=g).bfloat16()
    v = torch.randn(1, h, total, d, generator=g).bfloat16()
    kr = ref.rotate(k, t.k_rotation[0]).to(k.dtype)
    want_s2 = ref.quantize_rows(kr, None, t.k_mean, t.k_clip).scale.float().square()  # [1, H, T, 1]
    layer = Int2Layer(meth, t, rotate_values=True)
    steps = [(c, i == len(chunks) - 1) for i, c in enumerate(chunks)] + [(1, True)] * decode
    pos, seen_int2 = 0, 0
    for n, final in steps:
        layer.final_chunk = final
        out_k, _ = layer.update(k[..., pos : pos + n, :], v[..., pos : pos + n, :])
        prior, pos = pos, pos + n
        s, hist, _ = layer.tier_sizes()
        s2 = take_key_scale2(out_k)
        stored_hist = min(hist, prior - s)  # INT2 slots among the earlier tokens (this update's demotions included)
        if prior <= s or stored_hist <= 0:
            assert s2 is None
            continue
        assert s2 is not None and s2.shape == (1, h, pos, 1)
        assert take_key_scale2(out_k) is None  # handed once
        int2 = torch.zeros(pos, dtype=torch.bool)
        int2[s : s + stored_hist] = True
        assert torch.equal(s2[:, :, ~int2], torch.zeros_like(s2[:, :, ~int2]))
        assert torch.equal(s2[:, :, int2], want_s2[:, :, :pos][:, :, int2])
        assert bool((s2[:, :, int2] > 0).all())
        seen_int2 += 1
    assert seen_int2 >= decode
    off = Int2Layer(_meth("none", t=t), t, rotate_values=True)
    out_k, _ = off.update(k[..., :200, :], v[..., :200, :])
    out_k, _ = off.update(k[..., 200:201, :], v[..., 200:201, :])
    assert take_key_scale2(out_k) is None


class _Attn(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True


def _manual(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scaling: float) -> torch.Tensor:
    kk, vv = k.repeat_interleave(2, dim=1).float(), v.repeat_interleave(2, dim=1).float()
    s = scaling * q.float() @ kk.transpose(-1, -2) + bias
    tq, tk = s.shape[-2:]
    allow = torch.arange(tk)[None, :] <= torch.arange(tk - tq, tk)[:, None]
    s = s.masked_fill(~allow, float("-inf"))
    return (torch.softmax(s, -1) @ vv).transpose(1, 2)


@pytest.mark.parametrize("mask_kind", ["none", "bool"])
def test_attention_adds_the_bias_for_decode_and_prefill_chunks(mask_kind: str) -> None:
    """``oscar_attention`` over the cache's keys equals softmax(scaling·q·kᵀ + logit_bias + causal)·v for a
    prefill chunk after an INT2 history and for a decode step, and differs from the uncorrected output."""
    h, d = 2, 16
    meth = _meth()
    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, h, 121, d, generator=g)
    v = torch.randn(1, h, 121, d, generator=g)
    layer = Int2Layer(meth, LayerTransform(), rotate_values=False)
    layer.final_chunk = False
    layer.update(k[..., :80, :], v[..., :80, :])  # sink 8 + 72 INT2
    layer.final_chunk = True
    for a, e in ((80, 120), (120, 121)):
        ks, vs = layer.update(k[..., a:e, :], v[..., a:e, :])
        q = torch.randn(1, 2 * h, e - a, d, generator=g)
        s2 = layer.key_scale2
        assert s2 is not None
        bias = logit_bias(q, s2, 0.25)
        tq, tk = e - a, ks.shape[-2]
        mask = None
        if mask_kind == "bool":
            mask = (torch.arange(tk)[None, :] <= torch.arange(tk - tq, tk)[:, None]).view(1, 1, tq, tk)
        got, _ = oscar_attention(_Attn(), q, ks, vs, mask, scaling=0.25)
        torch.testing.assert_close(got, _manual(q, ks, vs, bias, 0.25), rtol=1e-5, atol=1e-5)
        plain = _manual(q, ks, vs, torch.zeros_like(bias), 0.25)
        assert (got - plain).abs().max() > 1e-3
        hist = 8 + min(layer.tier_sizes()[1], a - 8)  # INT2 slots [8, hist) of the earlier tokens
        assert hist == (80 if e == 120 else 104)
        assert bool((bias[..., :8] == 0).all()) and bool((bias[..., hist:] == 0).all())
        assert bool((bias[..., 8:hist] < 0).all())


def test_method_default_and_non_int2_layers_drop_it() -> None:
    meth = oscar_method([LayerTransform()], sink=8, recent=16)
    assert meth.logit_correction == "none"
    on = replace(meth, logit_correction="scale")
    assert on.for_layer(0).logit_correction == "scale"
    assert replace(on, layer_kinds=("kivi",)).for_layer(0).logit_correction == "none"
    assert replace(on, layer_kinds=("dense",)).for_layer(0).logit_correction == "none"
    assert on.bits_per_element(4096, 64) == meth.bits_per_element(4096, 64)  # nothing stored


def test_kernels_and_vllm_refuse_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from oscar_cli.vllm import layout

    assert_kernels_refuse(_meth(), "adds no per-key logit bias", "quant.logit_correction scale", monkeypatch)
    s = layout.Int2Settings(sink=64, recent=256)
    layout.check_geometry(head_dim=128, block_size=16, settings=s, group_size=None, logit_correction="none")
    with pytest.raises(UnsupportedModelError, match="logit correction") as e:
        layout.check_geometry(head_dim=128, block_size=16, settings=s, group_size=None, logit_correction="scale")
    assert "\n" not in str(e.value) and "quant.logit_correction scale" in str(e.value)


def test_recipe_and_artifact_round_trip(tmp_path: Path) -> None:
    """``quant.logit_correction`` is ``none`` | ``scale``, left out of recipe and manifest dicts while ``none``;
    a manifest carrying it serves a method with it; an unknown value is refused."""
    from helpers.fakehub.artifacts import _layers, make_manifest
    from helpers.tiny import tiny_config

    from oscar_cli.artifact import write_artifact
    from oscar_cli.artifact.build import build_manifest
    from oscar_cli.errors import ArtifactError
    from oscar_cli.quant.methods import oscar_from_artifact

    assert "logit_correction" not in Recipe().to_dict()["quant"]
    assert Recipe().full_dict()["quant"]["logit_correction"] == "none"
    on = Recipe().replace({"quant": {"logit_correction": "scale"}})
    assert on.to_dict()["quant"]["logit_correction"] == "scale" and recipe_from_dict(on.to_dict()) == on
    assert recipe_from_dict({"quant": {"logit_correction": "none"}}).to_dict() == Recipe().to_dict()
    with pytest.raises(RecipeError, match="logit_correction"):
        recipe_from_dict({"quant": {"logit_correction": "exact"}})

    def built(recipe: Recipe) -> dict:
        return build_manifest(recipe, reference="tiny", resolved="sha256:" + "0" * 64,
                              architecture=make_manifest(0).architecture, data={"source": "x"}, clip_layers=[],
                              orthogonality_error=0.0, statistics_tokens=1, holdout_tokens=0, timings={},
                              device="cpu", dtype="torch.float32").quant

    assert "logit_correction" not in built(Recipe()) and built(on)["logit_correction"] == "scale"
    plain = make_manifest(0)
    m = replace(plain, quant={**plain.quant, "logit_correction": "scale"})
    art = write_artifact(tmp_path / "art", m, _layers(0), recipe_yaml="name: tiny\n")
    assert oscar_from_artifact(str(art), tiny_config()).logit_correction == "scale"
    art = write_artifact(tmp_path / "plain", plain, _layers(0), recipe_yaml="name: tiny\n")
    assert oscar_from_artifact(str(art), tiny_config()).logit_correction == "none"
    with pytest.raises(ArtifactError, match="logit_correction"):
        write_artifact(tmp_path / "bad", replace(plain, quant={**plain.quant, "logit_correction": "x"}), _layers(0),
                       recipe_yaml="name: tiny\n")


def test_kept_tokens_get_no_bias() -> None:
    """With a BF16 keep budget attention reads kept tokens' BF16 rows: their squared scales are 0, the other INT2
    slots keep theirs."""
    h, d = 2, 16
    meth = replace(_meth(), keep_fraction=0.25)
    g = torch.Generator().manual_seed(2)
    k = torch.randn(1, h, 201, d, generator=g).bfloat16()
    layer = Int2Layer(meth, LayerTransform(), rotate_values=False)
    layer.update(k[..., :200, :], k[..., :200, :])
    out_k, _ = layer.update(k[..., 200:, :], k[..., 200:, :])
    s2 = take_key_scale2(out_k)
    assert s2 is not None and layer.keep is not None and layer.keep.pos is not None
    kept = torch.zeros(1, h, s2.shape[2], dtype=torch.bool)
    for hi in range(h):
        kept[0, hi, layer.keep.pos[0, hi].long()] = True
    hist = torch.zeros_like(kept)
    hist[..., 8 : 8 + layer.tier_sizes()[1]] = True
    assert int(kept.sum()) == h * (layer.tier_sizes()[1] // 4) > 0
    assert bool((s2[..., 0][kept] == 0).all()) and bool((s2[..., 0][hist & ~kept] > 0).all())
