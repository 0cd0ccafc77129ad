"""Formula 10 of ``oscar_kernels.reference``: 8-bit metadata (``quant.meta_dtype: uint8``) — exact decode, a bounded
error, its bits per element, the cache's bytes, and the one-line refusals where it is not served (vLLM, KIVI)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from helpers.calib import random_transform
from helpers.layers import feed
from hypothesis import given, settings
from hypothesis import strategies as st

from oscar_cli.errors import UnsupportedModelError
from oscar_cli.quant import LayerTransform, oscar_method
from oscar_cli.quant.cache import Int2Cache
from oscar_cli.quant.int2_layer import Int2Layer
from oscar_cli.quant.kernel_path import kernel_unsupported
from oscar_cli.quant.kivi import quantize_channels
from oscar_cli.quant.methods import bf16_method
from oscar_cli.vllm import layout
from oscar_kernels import reference as ref

pytestmark = pytest.mark.unit

META8 = ref.META8


def test_every_scale_byte_decodes_exactly_to_its_e5m3_value() -> None:
    byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    sf, zf = ref.decode_meta(byte, byte)
    e, m = torch.arange(256) >> 3, torch.arange(256) & 7
    want = (2.0 ** (e.double() - 16)) * (1 + m.double() / 8)
    assert torch.equal(sf.double(), want)
    assert sf[0].item() == 2.0**-16 and sf[255].item() == 61440.0
    assert torch.equal(zf.double(), (torch.arange(256).double() - 128) * want / 16)  # z·sf/16, exact in float32
    assert bool((torch.diff(sf) > 0).all())  # monotone: a larger byte is a larger step


@pytest.mark.parametrize("scale", [2.0**-16, 1e-3, 0.0625, 0.1, 1.0, 3.0, 1000.0, 61440.0])
def test_a_representable_scale_encodes_to_itself(scale: float) -> None:
    """A step already on the e5m3 grid is stored exactly (rounding only where it must), centred on a row about 0."""
    s = torch.tensor([scale], dtype=torch.float32)
    b, _ = ref.encode_meta(s, s * -1.5, s * 1.5, 3.0, META8)
    sf, zf = ref.decode_meta(b, ref.encode_meta(s, s * -1.5, s * 1.5, 3.0, META8)[1])
    rounded = float(ref.decode_meta(b, b)[0])
    assert abs(rounded - scale) <= scale / 16
    if scale in (2.0**-16, 0.0625, 1.0, 3.0, 61440.0):  # on the grid
        assert sf.item() == scale and zf.item() == -1.5 * scale


def _rows(seed: int, n: int, d: int, magnitude: float, offset: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g) * magnitude + offset * magnitude).float()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), d=st.sampled_from([16, 64, 128]), groups=st.sampled_from([1, 2, 4]),
       magnitude=st.sampled_from([1e-3, 0.05, 1.0, 30.0, 2000.0]), offset=st.floats(-2.0, 2.0), clip=st.sampled_from([0.0, 0.92]))
def test_int2_error_is_bounded_by_the_stored_step(seed: int, d: int, groups: int, magnitude: float, offset: float,
                                                  clip: float) -> None:
    """``|x_hat - y| <= sf/2 + 1.5·|sf - s| + sf/32`` per element for rows centred within 5.5 steps (formula 10), and
    the stored step is the row's own to within 1/16."""
    y = ref.clip_rows(_rows(seed, 33, d, magnitude, offset), clip)
    g = d // groups
    codes, scale, zero = ref.quantize_int2(y, g, META8)
    assert scale.dtype == META8 and zero.dtype == META8 and scale.shape == (33, groups)
    sf, _ = ref.decode_meta(scale, zero)
    yg = y.reshape(33, groups, g)
    mn, mx = yg.amin(-1), yg.amax(-1)
    s = torch.clamp(mx - mn, min=1e-8) / 3
    mid = (mn + mx) / 2
    centred = mid.abs() <= 5.5 * s
    assert bool((((sf - s).abs() <= s / 16 + 1e-12) | ~centred).all())
    err = (ref.dequantize_codes(codes, scale, zero) - y).reshape(33, groups, g).abs().amax(-1)
    bound = sf / 2 + 1.5 * (sf - s).abs() + sf / 32
    assert bool(((err <= bound * (1 + 1e-5)) | ~centred).all())


def test_rows_far_off_centre_widen_their_step_instead_of_losing_their_zero() -> None:
    """A group whose centre is beyond 5.5 of its steps from 0 cannot hold its zero in 8 bits at that step: the step
    widens to ``|mid|/5.5`` so the grid still covers the group (error at most half the wider step, not unbounded)."""
    y = _rows(0, 50, 64, 0.1, 0.0) + 100.0
    codes, scale, zero = ref.quantize_int2(y, None, META8)
    sf, zf = ref.decode_meta(scale, zero)
    assert bool((sf >= 100.0 / 5.5 * 15 / 16).all())
    assert bool(((zf <= y.amin(-1, keepdim=True).squeeze(-1)) & (zf + 3 * sf >= y.amax(-1))).all())
    err = (ref.dequantize_codes(codes, scale, zero) - y).abs().amax(-1)
    assert bool((err <= sf / 2 + sf / 32).all())


@pytest.mark.parametrize("d", [64, 128])
def test_gaussian_rows_lose_under_one_percent_against_bfloat16_metadata(d: int) -> None:
    y = ref.clip_rows(_rows(1, 4000, d, 1.0, 0.0), 0.92)
    mse = {}
    for md in (torch.bfloat16, META8):
        mse[md] = float(((ref.dequantize_codes(*ref.quantize_int2(y, None, md)) - y) ** 2).mean())
    assert mse[META8] <= mse[torch.bfloat16] * 1.01, mse


def test_int4_planes_with_8bit_metadata() -> None:
    """Formula 9 with formula 10's bytes: the 16-level grid is centred too, and the high plane read alone is the
    same valid coarse INT2 row (its grid: ``zf + hi·sf``)."""
    y = _rows(2, 500, 128, 1.0, 0.3)
    hi, lo, scale, zero = ref.quantize_int4_planes(y, None, META8)
    sf, zf = ref.decode_meta(scale, zero)
    x4 = ref.dequantize_int4_planes(hi, lo, scale, zero)
    assert bool(((x4 - y).abs().amax(-1) <= sf / 8 + 1.875 * (sf - (y.amax(-1) - y.amin(-1)) * 4 / 15).abs() + sf / 32
                 + 1e-6).all())
    coarse = ref.dequantize_codes(hi, scale, zero)
    assert torch.equal(coarse, zf + hi.float() * sf)  # one group per row: [500, 1] broadcasts over D
    bf = ref.quantize_int4_planes(y, None, torch.bfloat16)
    e8, e16 = ((x4 - y) ** 2).mean(), ((ref.dequantize_int4_planes(*bf) - y) ** 2).mean()
    assert e8 <= e16 * 1.05


@pytest.mark.parametrize("d", [64, 128])
def test_bits_per_element_count_one_byte_per_scale_and_zero(d: int) -> None:
    """docs/METHOD.md §9 with ``b_meta = 8``: at 32K, 2 + 16/D bits per history element plus the BF16 windows."""
    meth = oscar_method([LayerTransform()], sink=32, recent=288, meta_dtype=META8)
    L = 32768
    want = ((L - 320) * (2 + 16 / d) + 320 * 16) / L
    assert math.isclose(meth.bits_per_element(L, d), want, rel_tol=1e-12)
    assert meth.bits_per_element(L, d) < oscar_method([LayerTransform()], sink=32, recent=288).bits_per_element(L, d)
    assert ref.meta_bits(META8) == 8 and ref.meta_bits(torch.bfloat16) == 16


@pytest.mark.parametrize("length", [100, 400, 1500])
def test_measured_bytes_equal_the_formula_with_8bit_metadata(length: int) -> None:
    meth = oscar_method([LayerTransform()], sink=64, recent=256, meta_dtype=META8)
    cache = Int2Cache(meth, 1)
    x = torch.randn(1, 2, length, 16).bfloat16()
    cache.update(x, x, 0)
    assert math.isclose(cache.measured_bits_per_element(), meth.bits_per_element(length, 16), rel_tol=1e-12)


def test_cache_history_is_the_reference_quantizer_bitwise() -> None:
    torch.manual_seed(3)
    t = random_transform(5, 2)
    meth = oscar_method([t], sink=8, recent=16, meta_dtype=META8)
    layer = Int2Layer(meth, t, rotate_values=True)
    k, v = (torch.randn(2, 2, 121, 16).bfloat16() for _ in range(2))
    feed(layer, k, v, [60, 40], 21)
    n_sink, n_hist, _ = layer.tier_sizes()
    rows = ref.rotate(k, t.k_rotation).to(torch.bfloat16)[..., n_sink : n_sink + n_hist, :]
    want = ref.quantize_rows(rows, None, t.k_mean, t.k_clip, None, META8)
    hist = layer.history("k")
    assert hist is not None and hist[1].dtype == META8
    assert torch.equal(hist[0], want.packed) and torch.equal(hist[1], want.scale) and torch.equal(hist[2], want.zero)
    view = layer.stored()[0][..., n_sink : n_sink + n_hist, :]
    assert torch.equal(view, (ref.dequantize_rows(want) + t.k_mean.unsqueeze(-2)).to(torch.bfloat16))


def test_the_triton_path_and_vllm_serve_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode and write kernels read and write formula 10 (tests/test_kernels_decode.py, test_kernels_pack.py,
    test_cache.py ``meta8``); the vLLM backend's pages hold one byte per scale and zero (a float32 scale/zero is
    refused in one line)."""
    meth = oscar_method([LayerTransform()], meta_dtype=META8)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernel_unsupported(meth, torch.zeros(1, 2, 4, 64, dtype=torch.bfloat16)) is None
    served = layout.Int2Settings(sink=64, recent=256, meta_dtype=META8)
    layout.check_geometry(head_dim=128, block_size=16, group_size=None, settings=served)
    assert served.meta_bytes == 1
    with pytest.raises(UnsupportedModelError, match="metadata dtype torch.float32") as e:
        layout.check_geometry(head_dim=128, block_size=16, group_size=None,
                              settings=layout.Int2Settings(sink=64, recent=256, meta_dtype=torch.float32))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="16-bit"):
        quantize_channels(torch.randn(1, 1, 128, 16), None, META8)
    assert meth.for_layer(0).meta_dtype == META8
    assert bf16_method().meta_dtype == torch.bfloat16


def test_a_kivi_layer_of_an_8bit_artifact_keeps_16bit_metadata() -> None:
    meth = oscar_method([LayerTransform(), LayerTransform()], meta_dtype=META8)
    mixed = replace(meth, layer_kinds=("int2", "kivi"))
    assert mixed.for_layer(1).kind == "kivi" and mixed.for_layer(1).meta_dtype == torch.bfloat16
    assert mixed.for_layer(0).meta_dtype == META8


def test_the_precision_probe_quantizes_as_the_reference() -> None:
    """``scripts/meta_precision.py``'s ``bf16`` and ``m8`` variants are formulas 4 and 10 exactly (the other three
    differ from ``m8`` only in the half they leave unrounded)."""
    from helpers.scripts import load_script

    probe = load_script("meta_precision")
    y = ref.clip_rows(_rows(4, 40, 64, 1.0, 0.2), 0.92)
    for variant, md in (("bf16", torch.bfloat16), ("m8", META8)):
        want = ref.dequantize_codes(*ref.quantize_int2(y, None, md))
        assert torch.equal(probe.fake_quantize(y, variant), want), variant
    exact = probe.fake_quantize(y, "exactscale-centred")
    assert float(((exact - y) ** 2).mean()) <= float(((probe.fake_quantize(y, "m8") - y) ** 2).mean()) * 1.02
    with pytest.raises(ValueError, match="variant"):
        probe.fake_quantize(y, "fp8")


@pytest.mark.parametrize(("script", "own"), [("meta_precision", ["--threads", "2"]),
                                           ("logit_variance", ["--device", "cpu", "--json", "lv.json"])])
def test_the_window_probes_share_their_command_line(script: str, own: list[str]) -> None:
    """Both one-window probes take the window arguments of ``scripts/_window.py`` plus their own."""
    from helpers.scripts import load_script

    args = load_script(script)._parser().parse_args(["--artifact", "A", "--text", "T", "--ctx", "1024", *own])
    assert (args.model, args.artifact, args.text, args.ctx, args.offset, args.queries) == \
        ("smollm2-135m", "A", "T", 1024, 0, 64)
    with pytest.raises(SystemExit):
        load_script(script)._parser().parse_args(["--text", "T"])  # --artifact is required


def test_the_ruler_override_serves_the_artifact_with_8bit_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """``scripts/ruler_meta8.py`` keeps the artifact's method (transforms, clips, windows) and changes only its
    metadata dtype."""
    from helpers.scripts import load_script

    script = load_script("ruler_meta8")
    t = random_transform(2, 1)
    stored = oscar_method([t], sink=16, recent=32)
    monkeypatch.setattr(script, "_from_artifact", lambda ref, config: stored)
    got = script._with_meta8("ART", None)
    assert got.meta_dtype == META8 and replace(got, meta_dtype=torch.bfloat16) == stored
