"""The BF16 keep tier (recipe ``quant.keep``): what attention reads, how many tokens are kept, what it costs, where
it is refused; the recipe and artifact fields."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers.calib import random_transform
from helpers.layers import assert_kernels_refuse, chunked, dense_reference, run_layer

from oscar_cli.errors import RecipeError
from oscar_cli.quant import LayerTransform, oscar_method
from oscar_cli.quant.int2_layer import Int2Layer
from oscar_cli.quant.keep import keep_bits, keep_count, token_scores
from oscar_cli.recipe import Recipe, recipe_from_dict
from oscar_kernels.reference import dequantize_rows, quantize_rows, rotate

pytestmark = pytest.mark.unit

CASES = [
    # id, row lengths (left-padded to the longest), sink, recent, prefill chunk, H_kv, rotations per head
    ("single-one-chunk", [300], 16, 32, 512, 2, 1),
    ("single-chunked", [1000], 64, 256, 300, 2, 2),
    ("batch-ragged", [600, 257, 65], 16, 32, 256, 2, 1),
    ("no-windows", [400, 63], 0, 0, 128, 1, 1),
]


def _recording_feed(layer: Int2Layer, k: torch.Tensor, v: torch.Tensor, pads: list[int], chunks: list[int],
                    decode: int) -> tuple[list, list[tuple[torch.Tensor, int]]]:
    """``run_layer``, also returning the kept positions and the history slots after every update."""
    kept: list[tuple[torch.Tensor, int]] = []
    update = layer.update

    def spy(*a: object, **kw: object):  # type: ignore[no-untyped-def]
        out = update(*a, **kw)  # type: ignore[arg-type]
        assert layer.keep is not None
        b, h, _ = layer.dims
        pos = torch.empty(b, h, 0, dtype=torch.long) if layer.keep.pos is None else layer.keep.pos.long().clone()
        kept.append((pos, layer.hist_slots))
        return out

    layer.update = spy  # type: ignore[method-assign]
    return run_layer(layer, k, v, pads, chunks, decode), kept


@pytest.mark.parametrize(("score", "side"), [("qerr", "both"), ("knorm", "both"), ("qerr", "keys"),
                                             ("qerr", "values")])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kept_tokens_are_read_in_bf16_and_their_number_follows_the_budget(case: tuple, score: str,
                                                                          side: str) -> None:
    """Every update returns the no-keep cache's view except at the kept slots, which hold the token's exact
    (rotated) activation-dtype rows (of the kept side only: a one-sided tier leaves the other side's INT2 rows);
    per sequence and head the tier holds ⌊f·n⌋ history slots, n the history so far, over prefill chunks and
    decode demotions (budget 3 %: several blocks of 8 pass between two new rows)."""
    _, lengths, sink, recent, chunk, h, n_rot = case
    d, b, total, decode, frac = 16, len(lengths), max(lengths), 70, 0.03
    t = random_transform(total + h, n_rot, clip=0.9, d=d)
    base = oscar_method([t], sink=sink, recent=recent)
    meth = replace(base, keep_fraction=frac, keep_score=score, keep_side=side)
    g = torch.Generator().manual_seed(total)
    k = torch.randn(b, h, total + decode, d, generator=g).bfloat16()
    v = torch.randn(b, h, total + decode, d, generator=g).bfloat16()
    k[..., ::37, :3] *= 8  # a few outlier tokens
    pads = [total - n for n in lengths]
    chunks = chunked(total, chunk)
    got, kept = _recording_feed(Int2Layer(meth, t, rotate_values=True), k, v, pads, chunks, decode)
    want = dense_reference(base, t, k, v, pads, chunks, decode)
    raw = dense_reference(replace(base, sink=total + decode), t, k, v, pads, chunks, decode)[-1]  # all BF16
    s = sink + (max(pads) if sink else 0)
    valid = torch.arange(total + decode)[None, :] >= torch.tensor(pads)[:, None]
    grew = 0
    for i, ((gk, gv), (wk, wv), (pos, hist)) in enumerate(zip(got, want, kept, strict=True)):
        assert pos.shape == (b, h, keep_count(frac, hist)), f"update {i}"
        assert ((pos >= s) & (pos < s + hist)).all(), f"update {i}: kept slots outside the history"
        grew = max(grew, pos.shape[-1])
        n = gk.shape[2]
        sel = torch.zeros(b, h, n, dtype=torch.bool)
        sel.scatter_(2, pos.clamp(max=n - 1), pos < n)
        want_k = torch.where(sel[..., None], raw[0][..., :n, :], wk) if side != "values" else wk
        want_v = torch.where(sel[..., None], raw[1][..., :n, :], wv) if side != "keys" else wv
        m = valid[:, None, :n, None].expand_as(gk)
        assert torch.equal(gk[m], want_k[m]) and torch.equal(gv[m], want_v[m]), f"update {i}"
    assert grew >= 2


@pytest.mark.parametrize(("score", "side"), [("qerr", "both"), ("knorm", "both"), ("qerr", "keys"),
                                             ("qerr", "values")])
def test_one_chunk_keeps_the_highest_scores(score: str, side: str) -> None:
    """Within one demoted block the kept rows are the block's top ⌊f·m⌋ by score, per KV head (``qerr`` of a
    one-sided tier: that side's error alone)."""
    d, h, n, frac = 16, 2, 400, 0.05
    t = random_transform(3, 2, clip=0.9, d=d)
    meth = replace(oscar_method([t], sink=0, recent=0), keep_fraction=frac, keep_score=score, keep_side=side)
    layer = Int2Layer(meth, t, rotate_values=True)
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(2, 1, h, n, d, generator=g)
    layer.update(k, v)
    kr, vr = rotate(k, t.k_rotation), rotate(v, t.v_rotation)

    def hat(x: torch.Tensor, mean: torch.Tensor, clip: float) -> torch.Tensor:
        return dequantize_rows(quantize_rows(x, None, mean, clip)) + mean.unsqueeze(-2)

    scores = token_scores(score, kr, vr, hat(kr, t.k_mean, t.k_clip), hat(vr, t.v_mean, t.v_clip), side=side)
    if side != "both":  # one side's error alone, and the tier holds that side's rows only
        other = token_scores(score, kr, vr, hat(kr, t.k_mean, t.k_clip), hat(vr, t.v_mean, t.v_clip))
        assert not torch.equal(scores, other)
        assert layer.keep is not None and (layer.keep.k is None) == (side == "values")
        assert (layer.keep.v is None) == (side == "keys")
    assert layer.keep is not None and layer.keep.pos is not None
    want = scores.topk(keep_count(frac, n), dim=-1).indices.sort(-1).values
    assert torch.equal(layer.keep.pos.long().sort(-1).values, want)


def test_bits_per_element_and_allocated_bytes_grow_by_the_formula() -> None:
    """BPE adds ⌊f·(L - S0 - W)⌋·(2·D·16 + 64)/(2·D·L); the layer allocates exactly that many rows more per
    sequence and head (2·D bf16 values, int32 position, float32 score)."""
    d, h, b, length, frac = 64, 2, 2, 3000, 0.01
    base = oscar_method([LayerTransform()], sink=64, recent=256)
    meth = replace(base, keep_fraction=frac)
    kept = keep_count(frac, length - 320)
    assert kept == 26
    extra = meth.bits_per_element(length, d) - base.bits_per_element(length, d)
    assert extra == pytest.approx(kept * (2 * d * 16 + 64) / (2 * d * length), rel=1e-12)
    assert replace(base, keep_fraction=0.0).bits_per_element(length, d) == base.bits_per_element(length, d)
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, b, h, length, d, generator=g).bfloat16()
    plain, with_keep = Int2Layer(base, LayerTransform()), Int2Layer(meth, LayerTransform())
    for layer in (plain, with_keep):
        layer.update(k, v)
    row = 2 * d * 2 + 4 + 4
    assert with_keep.allocated_bytes() - plain.allocated_bytes() == b * h * kept * row
    assert with_keep.storage_bytes() - plain.storage_bytes() == b * h * kept * row
    from oscar_cli.calibration.schemes import BPE_CONTEXT, scheme_bpe

    recipe = Recipe().replace({"quant": {"keep": {"fraction": frac}}})
    assert scheme_bpe(recipe, d)(["oscar"]) == replace(base, keep_fraction=frac).bits_per_element(BPE_CONTEXT, d)
    for side in ("keys", "values"):  # one side: D values per kept row in memory and in the formula
        one = replace(meth, keep_side=side)
        assert one.bits_per_element(length, d) - base.bits_per_element(length, d) == pytest.approx(
            kept * (d * 16 + 64) / (2 * d * length), rel=1e-12)
        layer = Int2Layer(one, LayerTransform())
        layer.update(k, v)
        assert layer.allocated_bytes() - plain.allocated_bytes() == b * h * kept * (d * 2 + 4 + 4)
    with_keep.batch_select_indices(torch.tensor([1, 1, 0]))
    assert with_keep.keep is not None and with_keep.keep.pos is not None and with_keep.keep.pos.shape == (3, h, kept)


def test_triton_path_refuses_a_keep_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--backend triton`` refuses in one line; ``auto`` refuses where the kernels would run, and takes the
    reference path where they could not anyway (CPU)."""
    meth = replace(oscar_method([LayerTransform()], sink=8, recent=16), keep_fraction=0.02)
    assert_kernels_refuse(meth, "keep tier", "keep tier", monkeypatch)


def test_recipe_knob_is_validated_and_left_out_while_off() -> None:
    """``quant.keep`` is range- and type-checked; off, a recipe dict (recipe.yaml, the manifest) has no such key,
    so default recipes write the bytes they wrote before the knob existed."""
    assert "keep" not in Recipe().to_dict()["quant"] and Recipe().full_dict()["quant"]["keep"]["fraction"] == 0.0
    on = Recipe().replace({"quant": {"keep": {"fraction": 0.01, "score": "knorm"}}})
    assert on.to_dict()["quant"]["keep"] == {"fraction": 0.01, "score": "knorm"}
    assert recipe_from_dict(on.to_dict()) == on
    for bad, msg in [(-0.1, ">= 0"), (1.5, "<= 1"), ("0.1", "a number")]:
        with pytest.raises(RecipeError, match=msg):
            recipe_from_dict({"quant": {"keep": {"fraction": bad}}})
    with pytest.raises(RecipeError, match="quant.keep.score"):
        recipe_from_dict({"quant": {"keep": {"score": "random"}}})
    one = Recipe().replace({"quant": {"keep": {"fraction": 1.0, "side": "values"}}})  # written when not both
    assert one.to_dict()["quant"]["keep"] == {"fraction": 1.0, "score": "qerr", "side": "values"}
    assert recipe_from_dict(one.to_dict()) == one
    with pytest.raises(RecipeError, match="quant.keep.side"):
        recipe_from_dict({"quant": {"keep": {"fraction": 0.5, "side": "queries"}}})


def test_artifact_carries_the_keep_budget(tmp_path: Path) -> None:
    """An artifact whose manifest ``quant`` has ``keep`` serves a method with that budget; an invalid one is
    refused (the manifest schema bounds it)."""
    from helpers.fakehub.artifacts import _layers, make_manifest
    from helpers.tiny import tiny_config

    from oscar_cli.artifact import write_artifact
    from oscar_cli.errors import ArtifactError
    from oscar_cli.quant.methods import oscar_from_artifact

    plain = make_manifest(0)
    m = replace(plain, quant={**plain.quant, "keep": {"fraction": 0.02, "score": "knorm"}})
    art = write_artifact(tmp_path / "art", m, _layers(0), recipe_yaml="name: tiny\n")
    meth = oscar_from_artifact(str(art), tiny_config())
    assert (meth.keep_fraction, meth.keep_score, meth.keep_side) == (0.02, "knorm", "both")
    one = replace(plain, quant={**plain.quant, "keep": {"fraction": 1.0, "score": "qerr", "side": "keys"}})
    art1 = write_artifact(tmp_path / "art1", one, _layers(0), recipe_yaml="name: tiny\n")
    assert oscar_from_artifact(str(art1), tiny_config()).keep_side == "keys"
    from oscar_cli.artifact.card import bpe_table

    d = m.head_dim
    assert bpe_table(m.to_dict())["32k"] == round(replace(meth, keep_fraction=0.0).bits_per_element(32768, d)
                                                  + keep_bits(32768, d, 0.02, meth.sink, meth.recent), 4)
    assert bpe_table(m.to_dict())["32k"] > bpe_table(plain.to_dict())["32k"]
    assert oscar_from_artifact(str(write_artifact(tmp_path / "plain", plain, _layers(0),
                                                  recipe_yaml="name: tiny\n")), tiny_config()).keep_fraction == 0.0
    m = replace(plain, quant={**plain.quant, "keep": {"fraction": 2.0, "score": "knorm"}})
    with pytest.raises(ArtifactError, match="quant.keep.fraction must be <= 1"):
        write_artifact(tmp_path / "bad", m, _layers(0), recipe_yaml="name: tiny\n")


@pytest.mark.parametrize("layers", [[1], [0, 2], [0, 1, 2]])
def test_keep_layers_limit_the_budget_to_those_layers(layers: list[int]) -> None:
    """``quant.keep.layers``: only the listed layers get a keep tier (a cache's other INT2 layers have none); the
    bits per element are the mean over layers, each listed one paying :func:`keep_bits` of its side."""
    from oscar_cli.quant.cache import Int2Cache

    ts = [random_transform(i, 1, d=16) for i in range(3)]
    base = oscar_method(ts, sink=8, recent=16)
    meth = replace(base, keep_fraction=1.0, keep_side="keys", keep_layers=tuple(layers))
    cache = Int2Cache(meth, 3)
    assert [lay.keep is not None for lay in cache.oscar_layers] == [i in layers for i in range(3)]
    assert all(lay.keep.side == "keys" for lay in cache.oscar_layers if lay.keep is not None)
    L, d = 32768, 16
    extra = keep_bits(L, d, 1.0, 8, 16, side="keys") * len(layers) / 3
    assert meth.bits_per_element(L, d) == pytest.approx(base.bits_per_element(L, d) + extra)
    everywhere = replace(base, keep_fraction=1.0, keep_side="keys")
    assert (meth.bits_per_element(L, d) <= everywhere.bits_per_element(L, d)) and (len(layers) < 3) == (
        meth.bits_per_element(L, d) < everywhere.bits_per_element(L, d))


def test_keep_layers_in_the_recipe_and_the_artifact(tmp_path: Path) -> None:
    """The recipe writes ``layers`` only when set; the artifact carries it to the served method and the model
    card's BPE; a layer beyond the model is refused when the artifact is written."""
    from helpers.fakehub.artifacts import _layers, make_manifest
    from helpers.tiny import tiny_config

    from oscar_cli.artifact import write_artifact
    from oscar_cli.artifact.card import bpe_table
    from oscar_cli.errors import ArtifactError
    from oscar_cli.quant.methods import oscar_from_artifact

    on = Recipe().replace({"quant": {"keep": {"fraction": 1.0, "side": "keys", "layers": [18]}}})
    assert on.to_dict()["quant"]["keep"] == {"fraction": 1.0, "score": "qerr", "side": "keys", "layers": [18]}
    assert recipe_from_dict(on.to_dict()) == on
    for bad in ([], [-1], "18"):
        with pytest.raises(RecipeError, match="quant.keep.layers"):
            recipe_from_dict({"quant": {"keep": {"fraction": 1.0, "layers": bad}}})
    plain = make_manifest(0)
    keep = {"fraction": 1.0, "score": "qerr", "side": "keys", "layers": [1]}
    m = replace(plain, quant={**plain.quant, "keep": keep}, recipe={"name": "t"})
    meth = oscar_from_artifact(str(write_artifact(tmp_path / "art", m, _layers(0), recipe_yaml="name: t\n")),
                               tiny_config())
    assert meth.keep_layers == (1,) and meth.for_layer(0).keep_fraction == 0.0 and meth.for_layer(1).keep_fraction == 1
    d = m.head_dim
    assert bpe_table(m.to_dict())["32k"] == round(meth.bits_per_element(32768, d), 4)
    assert bpe_table(m.to_dict())["32k"] == pytest.approx(
        bpe_table(plain.to_dict())["32k"] + keep_bits(32768, d, 1.0, 64, 256, side="keys") / 2, abs=2e-4)
    bad = replace(m, quant={**plain.quant, "keep": {**keep, "layers": [2]}})
    with pytest.raises(ArtifactError, match="quant.keep.layers names layer 2; the model has 2 layers"):
        write_artifact(tmp_path / "bad", bad, _layers(0), recipe_yaml="name: t\n")


def test_the_model_cards_bits_count_layers_kept_in_bf16(tmp_path: Path) -> None:
    """An artifact whose calibration keeps a layer in BF16 states the bits it is served at (the mean over layers,
    that layer at 16), not the all-INT2 figure."""
    from helpers.fakehub.artifacts import make_manifest

    from oscar_cli.artifact.card import bpe_table

    plain = make_manifest(0)
    mixed = replace(plain, calibration={"layers": [{"scheme": "oscar"}, {"scheme": "bf16"}]})
    for ctx in ("4k", "32k", "128k"):
        assert bpe_table(mixed.to_dict())[ctx] == pytest.approx((bpe_table(plain.to_dict())[ctx] + 16) / 2, abs=1e-4)
