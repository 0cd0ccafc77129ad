"""Clip search: the objective against a direct tiered attention built from the reference quantizer."""

from __future__ import annotations

import pytest
import torch

from oscar_cli.calibration.clipping import (
    LayerClipProblem,
    evaluate_clip,
    fake_quantize,
    int2_pair_mask,
    search_clip,
)

ref = pytest.importorskip("oscar_kernels.reference")
pytestmark = pytest.mark.unit

B, HQ, HKV, T, TQ, D = 1, 4, 2, 48, 10, 16
G = HQ // HKV
SINK, RECENT = 4, 8


def _data(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, TQ, D, generator=g)
    k = torch.randn(B, HKV, T, D, generator=g) * torch.linspace(0.2, 3, D)
    v = torch.randn(B, HKV, T, D, generator=g)
    r = torch.linalg.qr(torch.randn(1, D, D, generator=g, dtype=torch.float64))[0].float()
    return q, k, v, r


@pytest.mark.parametrize(("ratio", "group"), [(0.0, None), (0.9, None), (0.96, 8), (1.0, 4)])
def test_fake_quantize_equals_the_reference_bitwise(ratio: float, group: int | None) -> None:
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(1)) * 4
    want = ref.fake_quantize_rows(x, None, None, ratio, group, torch.bfloat16)
    assert torch.equal(fake_quantize(x, ratio, group, torch.bfloat16), want)


def test_int2_pair_mask() -> None:
    m = int2_pair_mask(t=12, tq=2, sink=2, recent=3, device=torch.device("cpu"))
    # query at position 10 sees INT2 keys 2..7; query 11 sees 2..8
    assert m[0].nonzero().flatten().tolist() == list(range(2, 8))
    assert m[1].nonzero().flatten().tolist() == list(range(2, 9))


def _direct_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: torch.Tensor, mk: torch.Tensor,
                  mv: torch.Tensor, rk_ratio: float, rv_ratio: float | None) -> float:
    """Independent tiered attention: one query at a time, concatenating BF16 and INT2 keys explicitly."""
    kr = ref.rotate(k, r[0]) - mk[:, None]
    vr = ref.rotate(v, r[0]) - mv[:, None]
    kq = ref.fake_quantize_rows(kr, None, None, rk_ratio, None, torch.bfloat16)
    vq = vr if rv_ratio is None else ref.fake_quantize_rows(vr, None, None, rv_ratio, None, torch.bfloat16)
    qr = ref.rotate(q, r[0])
    num = den = 0.0
    for ti in range(TQ):
        i = T - TQ + ti
        pos = torch.arange(i + 1)
        int2 = (pos >= SINK) & (pos <= i - RECENT)
        kk = torch.where(int2[:, None], kq[:, :, : i + 1], kr[:, :, : i + 1])
        vv = torch.where(int2[:, None], vq[:, :, : i + 1], vr[:, :, : i + 1])
        qi = qr[:, :, ti : ti + 1]
        exact, _ = ref.attention_partial(qi, kr[:, :, : i + 1], vr[:, :, : i + 1], D**-0.5)
        approx, _ = ref.attention_partial(qi, kk, vv, D**-0.5)
        num += float((approx - exact).square().sum())
        den += float((exact + mv.repeat_interleave(G, 0)[None, :, None]).square().sum())
    return num / den


def test_objective_matches_direct_tiered_attention() -> None:
    q, k, v, r = _data()
    mk = torch.randn(HKV, D) * 0.1
    mv = torch.randn(HKV, D) * 0.1
    p = LayerClipProblem(q, k, v, r, r, mk, mv, D**-0.5, SINK, RECENT, None, "bfloat16")
    assert p.has_int2
    assert p.key_error(0.9) == pytest.approx(_direct_error(q, k, v, r, mk, mv, 0.9, None), rel=1e-4)
    p.set_key_ratio(0.9)
    assert p.value_error(0.92) == pytest.approx(_direct_error(q, k, v, r, mk, mv, 0.9, 0.92), rel=1e-4)
    p.set_key_ratio(0.0)
    assert p.value_error(0.0) == pytest.approx(_direct_error(q, k, v, r, mk, mv, 0.0, 0.0), rel=1e-4)


def test_search_picks_the_minimum_and_records_every_candidate() -> None:
    q, k, v, r = _data(2)
    zeros = torch.zeros(HKV, D)
    problems = [LayerClipProblem(q, k, v, r, r, zeros, zeros, D**-0.5, SINK, RECENT, None, "float32")]
    grid = (0.0, 0.8, 0.9, 0.96)
    choice = search_clip(problems, grid, grid)
    assert set(choice.k_objective) == set(grid) and set(choice.v_objective) == set(grid)
    assert choice.k_objective[choice.k_ratio] == min(choice.k_objective.values())
    assert choice.v_objective[choice.v_ratio] == min(choice.v_objective.values())
    assert choice.error == choice.v_objective[choice.v_ratio] > 0
    fixed = evaluate_clip(problems, 0.96, 0.92)
    assert (fixed.k_ratio, fixed.v_ratio) == (0.96, 0.92) and fixed.error > 0
    d = choice.to_dict()
    assert set(d) == {"k_ratio", "v_ratio", "error", "k_objective", "v_objective"}


def test_nothing_to_search_when_the_bf16_tiers_cover_everything() -> None:
    q, k, v, r = _data(3)
    zeros = torch.zeros(HKV, D)
    p = LayerClipProblem(q, k, v, r, r, zeros, zeros, D**-0.5, sink=T, recent=T, group_size=None,
                         meta_dtype="bfloat16")
    assert not p.has_int2 and p.key_error(0.9) == 0.0


def _needle_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A layer where the mean error and the top-k error disagree about clipping (head_dim 16, 128 keys).

    Bulk keys carry a ±10 spike on channel 1 that no query reads: clipping it (0.9 clips each row's largest
    entry to its second largest) sharpens INT2 on the channels queries do read, which the mean error rewards.
    One needle key instead holds its whole signal on channel 0, which only the first 4 queries read; clipping
    flattens it and those queries lose the key they concentrate on.
    """
    g = torch.Generator().manual_seed(seed)
    t, tq, d = 128, 64, 16
    k = torch.randn(1, 1, t, d, generator=g)
    k[..., 0] = 0
    k[..., 1] = 10 * torch.sign(torch.randn(1, 1, t, generator=g))
    needle = t // 4
    k[0, 0, needle, :2] = torch.tensor([5.0, 0.0])
    q = torch.randn(1, 1, tq, d, generator=g)
    q[..., :2] = 0
    q[0, 0, :4] = 0
    q[0, 0, :4, 0] = 4.0
    return q, k, torch.randn(1, 1, t, d, generator=g), needle


@pytest.mark.parametrize("seed", [0, 1, 3])
def test_topk_objective_keeps_the_clip_that_protects_the_most_attended_key(seed: int) -> None:
    q, k, v, needle = _needle_case(seed)
    args = (q, k, v, None, None, None, None, 16**-0.5, SINK, RECENT, None, "float32")
    weight = {}
    choices = {}
    for objective in ("mean", "topk"):
        p = LayerClipProblem(*args, objective=objective, topk_keys=4)
        choices[objective] = search_clip([p], (0.0, 0.9), (0.0,))
        weight[objective] = float(p.p_k[0, 0, :4, needle].mean())  # keys at the chosen ratio
    exact = float(torch.softmax(LayerClipProblem(*args).logits, -1)[0, 0, :4, needle].mean())
    assert choices["mean"].k_ratio == 0.9 and choices["topk"].k_ratio == 0.0
    assert weight["mean"] < 0.2 * exact  # the mean error's clip takes the needle away from its queries
    assert weight["topk"] > 0.5 * exact
    # whatever the objective, the recorded error is the mean objective at the chosen ratios
    mean_at_topk = LayerClipProblem(*args)
    mean_at_topk.set_key_ratio(0.0)
    assert choices["topk"].error == pytest.approx(mean_at_topk.value_error(0.0), rel=1e-6)
    assert choices["topk"].error > choices["mean"].error


def test_topk_objective_only_counts_int2_keys_and_is_zero_without_quantization_error() -> None:
    q, k, v, r = _data(4)
    zeros = torch.zeros(HKV, D)
    p = LayerClipProblem(q, k, v, r, r, zeros, zeros, D**-0.5, SINK, RECENT, None, "float32", "topk", 3)
    assert bool((p.top <= p.int2).all())  # never a BF16-tier or future key
    assert int(p.top.sum(-1).max()) == 3
    assert p.key_error(0.9) > 0 and p.value_error(0.9) > 0
    with pytest.raises(ValueError, match="objective"):
        LayerClipProblem(q, k, v, r, r, zeros, zeros, D**-0.5, SINK, RECENT, None, "float32", "median")
