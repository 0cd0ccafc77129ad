"""Non-uniform INT2 levels (recipe ``quant.levels``, ``oscar_kernels.reference`` formula 8): the uniform default is
bitwise today's min-max path, codes are the nearest level, prefill and demotion use the same levels, the Triton path
and the vLLM geometry check refuse it, the recipe and artifact fields."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers.calib import random_transform
from helpers.layers import assert_kernels_refuse, chunked, dense_reference, run_layer

from oscar_cli.errors import RecipeError, UnsupportedModelError
from oscar_cli.quant import LayerTransform, oscar_method
from oscar_cli.quant.int2_layer import Int2Layer
from oscar_cli.recipe import Recipe, recipe_from_dict
from oscar_kernels import reference as ref

pytestmark = pytest.mark.unit


def _rows(seed: int, n: int = 4000, d: int = 128) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g)


def test_level_table_is_exact_at_one_third_and_bounded() -> None:
    assert ref.level_table(ref.UNIFORM_INNER) == ((0.0, 1.0, 2.0, 3.0), (1.0, 2.0, 3.0))
    lv, th = ref.level_table(0.4)
    assert lv[0] == 0.0 and lv[3] == 3.0 and lv[1] == pytest.approx(1.2) and lv[2] == pytest.approx(1.8)
    assert th == pytest.approx((1.1, 2.0, 2.9))
    for bad in (0.0, 0.5, -0.1, 0.7):
        with pytest.raises(ValueError, match=r"\(0, 0.5\)"):
            ref.level_table(bad)


def test_general_codes_at_one_third_equal_the_uniform_rounding_bitwise() -> None:
    """The threshold form of formula 8 at a = 1/3 is formula 5 (``clamp(floor(v), 0, 3)``) on every float32 ``v``,
    including exact ties, the float32 neighbours of each threshold, and values outside [0, 4)."""
    ties = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, -1.0, 0.5, 1.5, 2.5, 3.5, 100.0, -100.0])
    near = torch.cat([torch.nextafter(ties, torch.full_like(ties, s)) for s in (-1e9, 1e9)])
    v = torch.cat([ties, near, torch.rand(50000, generator=torch.Generator().manual_seed(1)) * 5 - 0.5])
    want = torch.floor(v).clamp(0, 3).to(torch.uint8)
    assert torch.equal(ref.level_codes(v, ref.UNIFORM_INNER), want)
    # and the whole quantizer through the general path (a = 1/3 given as the float it is, codes via level_codes)
    y = ref.clip_rows(_rows(2), 0.96)
    codes, scale, zero = ref.quantize_int2(y, 32)
    v = (y.reshape(-1, 4, 32) - zero.float()[..., None]) / scale.float()[..., None] + 0.5
    assert torch.equal(ref.level_codes(v, ref.UNIFORM_INNER).reshape(y.shape), codes)


@pytest.mark.parametrize("inner", [0.3, 0.36, 0.38, 0.42])
@pytest.mark.parametrize("meta", [torch.bfloat16, torch.float32])
def test_codes_are_the_nearest_level(inner: float, meta: torch.dtype) -> None:
    """Each value's dequantized level is (one of) the nearest of the group's four levels, computed from the stored
    scale and zero; scale and zero are the uniform path's (min-max) and the extremes decode to the group's min/max
    as in the uniform path."""
    y = ref.clip_rows(_rows(3, 2000), 0.92)
    codes, scale, zero = ref.quantize_int2(y, 64, meta, inner)
    u_codes, u_scale, u_zero = ref.quantize_int2(y, 64, meta)
    assert torch.equal(scale, u_scale) and torch.equal(zero, u_zero)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 3
    assert not torch.equal(codes, u_codes)  # the levels do move codes
    x_hat = ref.dequantize_codes(codes, scale, zero, torch.float32, inner)
    lv, _ = ref.level_table(inner)
    cand = zero.float()[..., None] + torch.tensor(lv)[None, None, :] * scale.float()[..., None]  # [N, groups, 4]
    cand = cand.repeat_interleave(64, dim=1)  # per channel
    dist = (y[..., None] - cand).abs()
    got = (y - x_hat).abs()
    assert (got <= dist.amin(-1) + 1e-5 * scale.float().repeat_interleave(64, dim=1)).all()
    u_hat = ref.dequantize_codes(codes, scale, zero)  # the same codes read as uniform levels
    ends = (codes == 0) | (codes == 3)
    assert torch.equal(x_hat[ends], u_hat[ends]) and not torch.equal(x_hat, u_hat)  # levels 0 and 3 are uniform's


def test_ties_round_up() -> None:
    """A value exactly on a threshold (in the float32 ``v`` of formula 8) takes the upper level."""
    _, th = ref.level_table(0.4)
    v = torch.tensor(th)
    assert ref.level_codes(v, 0.4).tolist() == [1, 2, 3]
    assert ref.level_codes(torch.nextafter(v, torch.zeros_like(v)), 0.4).tolist() == [0, 1, 2]


def test_round_trip_error_on_gaussian_groups_is_lower_at_0_38() -> None:
    """Unclipped Gaussian groups of 128: the mean squared round-trip error at a = 0.38 is below uniform's (the
    Gaussian's inner mass sits closer to the centre than the evenly spaced levels)."""
    y = _rows(4, 8000)

    def mse(inner: float) -> float:
        return float((ref.fake_quantize_rows(y, inner=inner) - y).square().mean())

    uniform, inner = mse(ref.UNIFORM_INNER), mse(0.38)
    assert inner < 0.95 * uniform
    assert ref.fake_quantize_rows(y, inner=ref.UNIFORM_INNER).equal(ref.fake_quantize_rows(y))
    q = ref.quantize_rows(y, inner=0.38)
    assert torch.equal(ref.dequantize_rows(q, inner=0.38), ref.fake_quantize_rows(y, inner=0.38))


CASES = [
    # id, row lengths (left-padded), sink, recent, prefill chunk, H_kv, rotations per head
    ("single-chunked", [700], 16, 32, 256, 2, 2),
    ("batch-ragged", [600, 257, 65], 16, 32, 256, 2, 1),
    ("no-windows", [400, 63], 0, 0, 128, 1, 1),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_prefill_and_demotion_use_the_same_levels(case: tuple) -> None:
    """Every update (prefill chunks, then decode steps that demote blocks of 8) returns exactly the dense reference
    whose INT2 rows are each token's own non-uniform round trip; and differs from the uniform cache's."""
    _, lengths, sink, recent, chunk, h, n_rot = case
    d, b, total, decode = 16, len(lengths), max(lengths), 50
    t = random_transform(total + h, n_rot, clip=0.9, d=d)
    base = oscar_method([t], sink=sink, recent=recent)
    meth = replace(base, levels=0.4)
    g = torch.Generator().manual_seed(total)
    k = torch.randn(b, h, total + decode, d, generator=g).bfloat16()
    v = torch.randn(b, h, total + decode, d, generator=g).bfloat16()
    pads = [total - n for n in lengths]
    chunks = chunked(total, chunk)
    got = run_layer(Int2Layer(meth, t, rotate_values=True), k, v, pads, chunks, decode)
    want = dense_reference(meth, t, k, v, pads, chunks, decode)
    uniform = dense_reference(base, t, k, v, pads, chunks, decode)
    valid = torch.arange(total + decode)[None, :] >= torch.tensor(pads)[:, None]
    for i, ((gk, gv), (wk, wv)) in enumerate(zip(got, want, strict=True)):
        m = valid[:, None, : gk.shape[2], None].expand_as(gk)
        assert torch.equal(gk[m], wk[m]) and torch.equal(gv[m], wv[m]), f"update {i}"
    fk, uk = got[-1][0], uniform[-1][0]
    m = valid[:, None, : fk.shape[2], None].expand_as(fk)
    assert not torch.equal(fk[m], uk[m])


def test_uniform_method_is_the_default_and_kivi_or_dense_layers_drop_it() -> None:
    meth = oscar_method([LayerTransform()], sink=8, recent=16)
    assert meth.levels == ref.UNIFORM_INNER
    odd = replace(meth, levels=0.4)
    assert odd.for_layer(0).levels == 0.4
    assert replace(odd, layer_kinds=("kivi",)).for_layer(0).levels == ref.UNIFORM_INNER
    assert replace(odd, layer_kinds=("dense",)).for_layer(0).levels == ref.UNIFORM_INNER
    assert odd.bits_per_element(4096, 64) == meth.bits_per_element(4096, 64)  # same codes and metadata


def test_triton_path_refuses_non_uniform_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--backend triton`` refuses in one line; ``auto`` refuses where the kernels would run, and takes the
    reference path where they could not anyway (CPU)."""
    meth = replace(oscar_method([LayerTransform()], sink=8, recent=16), levels=0.38)
    assert_kernels_refuse(meth, "uniform INT2 levels only", "quant.levels 0.38", monkeypatch)
    k = torch.randn(1, 2, 40, 16).bfloat16()
    Int2Layer(replace(meth, levels=ref.UNIFORM_INNER), LayerTransform(), backend="auto").update(k, k)


def test_vllm_geometry_check_refuses_non_uniform_levels() -> None:
    from oscar_cli.vllm import layout

    s = layout.Int2Settings(sink=64, recent=256)
    layout.check_geometry(head_dim=128, block_size=16, settings=s, group_size=None, levels=ref.UNIFORM_INNER)
    with pytest.raises(UnsupportedModelError, match="non-uniform INT2 levels") as e:
        layout.check_geometry(head_dim=128, block_size=16, settings=s, group_size=None, levels=0.4)
    assert "\n" not in str(e.value) and "quant.levels 0.4" in str(e.value)


def test_recipe_knob_is_validated_and_left_out_while_uniform() -> None:
    """``quant.levels`` lies in (0, 0.5) and is a number; uniform (1/3), a recipe dict has no such key."""
    assert "levels" not in Recipe().to_dict()["quant"]
    assert Recipe().full_dict()["quant"]["levels"] == ref.UNIFORM_INNER
    on = Recipe().replace({"quant": {"levels": 0.38}})
    assert on.to_dict()["quant"]["levels"] == 0.38 and recipe_from_dict(on.to_dict()) == on
    assert recipe_from_dict({"quant": {"levels": 1 / 3}}).to_dict() == Recipe().to_dict()
    for bad, msg in [(0.0, "> 0"), (0.5, "< 0.5"), (-0.2, "> 0"), (0.9, "< 0.5"), ("0.4", "a number")]:
        with pytest.raises(RecipeError, match=msg):
            recipe_from_dict({"quant": {"levels": bad}})


def test_calibration_scores_clips_with_the_same_levels() -> None:
    """The clip search's fake quantizer is the cache's round trip at the recipe's inner level."""
    from oscar_cli.calibration.clipping import fake_quantize

    y = _rows(6, 500, 64)
    for inner in (ref.UNIFORM_INNER, 0.4):
        got = fake_quantize(y, 0.92, 32, torch.bfloat16, inner)
        assert torch.equal(got, ref.fake_quantize_rows(y, None, None, 0.92, 32, torch.bfloat16, inner))


def test_artifact_carries_the_levels(tmp_path: Path) -> None:
    """A manifest ``quant.levels`` serves a method with those levels; absent, uniform; out of range, refused."""
    from helpers.fakehub.artifacts import _layers, make_manifest
    from helpers.tiny import tiny_config

    from oscar_cli.artifact import write_artifact
    from oscar_cli.artifact.build import build_manifest
    from oscar_cli.errors import ArtifactError
    from oscar_cli.quant.methods import oscar_from_artifact

    def built(recipe: Recipe) -> dict:
        return build_manifest(recipe, reference="tiny", resolved="sha256:" + "0" * 64,
                              architecture=make_manifest(0).architecture, data={"source": "x"}, clip_layers=[],
                              orthogonality_error=0.0, statistics_tokens=1, holdout_tokens=0, timings={},
                              device="cpu", dtype="torch.float32").quant

    assert "levels" not in built(Recipe()) and built(Recipe().replace({"quant": {"levels": 0.38}}))["levels"] == 0.38
    plain = make_manifest(0)
    m = replace(plain, quant={**plain.quant, "levels": 0.38})
    meth = oscar_from_artifact(str(write_artifact(tmp_path / "art", m, _layers(0), recipe_yaml="name: tiny\n")),
                               tiny_config())
    assert meth.levels == 0.38
    art = write_artifact(tmp_path / "plain", plain, _layers(0), recipe_yaml="name: tiny\n")
    assert oscar_from_artifact(str(art), tiny_config()).levels == ref.UNIFORM_INNER
    with pytest.raises(ArtifactError, match="quant.levels"):
        write_artifact(tmp_path / "bad", replace(plain, quant={**plain.quant, "levels": 0.6}), _layers(0),
                       recipe_yaml="name: tiny\n")
