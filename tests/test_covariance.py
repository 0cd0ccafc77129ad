"""Streaming statistics against direct (non-streaming) formulas of docs/METHOD.md §2 and §11.12."""

from __future__ import annotations

import pytest
import torch

from oscar_cli.calibration.covariance import LayerStatistics, reservoir_plan, softmax_key_weights

pytestmark = pytest.mark.unit

B, HQ, HKV, T, D = 2, 6, 2, 20, 8
G = HQ // HKV


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, T, D, generator=g)
    k = torch.randn(B, HKV, T, D, generator=g) + 0.5
    v = torch.randn(B, HKV, T, D, generator=g) - 0.25
    kk = k.repeat_interleave(G, 1)
    p = torch.softmax((q @ kk.transpose(-1, -2)) * D**-0.5 + torch.full((T, T), float("-inf")).triu(1), -1)
    out = p @ v.repeat_interleave(G, 1)
    return q, k, v, out


def _feed(stats: LayerStatistics, batches: list[tuple[torch.Tensor, ...]], cap: int) -> None:
    gen = torch.Generator().manual_seed(0)
    seen = 0
    for q, k, v, out in batches:
        plan = reservoir_plan(seen, B * T, cap, gen)
        stats.update(q, k, v, out, D**-0.5, plan)
        seen += B * T


def _all(batches: list[tuple[torch.Tensor, ...]], i: int) -> torch.Tensor:
    return torch.cat([b[i] for b in batches], 0).double()


def _is_sym_psd(m: torch.Tensor) -> bool:
    return bool(torch.allclose(m, m.transpose(-1, -2)) and torch.linalg.eigvalsh(m).min() > -1e-10)


def test_qqt_is_the_query_second_moment_and_streaming_equals_batch() -> None:
    batches = [_batch(s) for s in range(3)]
    stats = LayerStatistics(HKV, D, "qqt", "vtv", reservoir=16)
    _feed(stats, batches, 16)
    t = stats.finalize()
    q = _all(batches, 0)  # [3B, HQ, T, D]
    for h in range(HKV):
        rows = q[:, h * G : (h + 1) * G].reshape(-1, D)
        assert torch.allclose(t.k_target[h], rows.T @ rows / rows.shape[0], rtol=1e-10)
    all_q = q.reshape(-1, D)
    assert torch.allclose(t.k_target.mean(0), all_q.T @ all_q / all_q.shape[0], rtol=1e-10)
    v = _all(batches, 2).permute(1, 0, 2, 3).reshape(HKV, -1, D)
    assert torch.allclose(t.v_target, v.transpose(1, 2) @ v / v.shape[1], rtol=1e-10)
    assert torch.allclose(t.k_mean, _all(batches, 1).permute(1, 0, 2, 3).reshape(HKV, -1, D).mean(1))
    assert t.tokens == 3 * B * T
    assert _is_sym_psd(t.k_target) and _is_sym_psd(t.v_target)


def test_sst_matches_the_published_formula_when_the_reservoir_holds_everything() -> None:
    batches = [_batch(s) for s in range(2)]
    stats = LayerStatistics(HKV, D, "qqt", "sst", reservoir=4 * B * T)
    _feed(stats, batches, 4 * B * T)
    t = stats.finalize()
    q, k, v = _all(batches, 0), _all(batches, 1), _all(batches, 2)
    for h in range(HKV):
        qh = q[:, h * G : (h + 1) * G].reshape(-1, D)
        a = qh.T @ qh / qh.shape[0]
        kh, vh = k[:, h].reshape(-1, D), v[:, h].reshape(-1, D)
        w = ((kh @ a) * kh).sum(-1)
        # equivalently the mean squared raw logit over the group's queries
        assert torch.allclose(w, ((kh @ qh.T) ** 2).mean(1), rtol=1e-9)
        n = w.shape[0]
        w = n * w / w.sum()
        expected = (vh * w[:, None]).T @ vh / n
        assert torch.allclose(t.v_target[h], expected, rtol=1e-9)
    assert torch.allclose(t.v_weight_mean, torch.ones(HKV, dtype=torch.float64))
    assert _is_sym_psd(t.v_target)


def test_sst_reservoir_is_bounded() -> None:
    batches = [_batch(s) for s in range(4)]
    stats = LayerStatistics(HKV, D, "qqt", "sst", reservoir=16)
    _feed(stats, batches, 16)
    assert stats.res_k is not None and stats.res_k.shape == (16, HKV, D)
    t = stats.finalize()
    assert torch.isfinite(t.v_target).all() and _is_sym_psd(t.v_target)


def test_reservoir_plan_fills_then_samples_uniformly() -> None:
    gen = torch.Generator().manual_seed(0)
    slots, idx = reservoir_plan(0, 10, 16, gen)
    assert slots.tolist() == list(range(10)) and idx.tolist() == list(range(10))
    slots, idx = reservoir_plan(10, 30, 16, gen)
    assert len(set(slots.tolist())) == slots.numel() and bool((slots < 16).all())
    assert set(range(10, 16)) <= set(slots.tolist())  # the first 6 new tokens fill the rest
    # over many draws, the kept fraction of late tokens is close to cap / n
    hits = 0
    for s in range(200):
        g = torch.Generator().manual_seed(s)
        _, idx = reservoir_plan(1000, 1000, 100, g)
        hits += idx.numel()
    assert 0.35 < hits / 200 / 100 < 0.75  # ~ln(2) = 0.69 of the reservoir is replaced


def test_softmax_weights_match_a_direct_causal_softmax_and_exclude_the_sink() -> None:
    q, k, v, _ = _batch(5)
    w = softmax_key_weights(q, k, D**-0.5, sink=3)
    kk = k.repeat_interleave(G, 1)
    p = torch.softmax((q @ kk.transpose(-1, -2)) * D**-0.5 + torch.full((T, T), float("-inf")).triu(1), -1)
    direct = p.square().sum(2).reshape(B, HKV, G, T).mean(2)
    direct[:, :, :3] = 0
    assert torch.allclose(w, direct, atol=1e-6)
    stats = LayerStatistics(HKV, D, "qqt", "softmax", sink=3, exclude_sink=True)
    stats.update(q, k, v, None, D**-0.5)
    t = stats.finalize()
    for h in range(HKV):
        vh, wh = v[:, h].reshape(-1, D).double(), direct[:, h].reshape(-1).double()
        assert torch.allclose(t.v_target[h], (vh * wh[:, None]).T @ vh / wh.sum(), rtol=1e-5)


def test_sv_is_the_attention_output_second_moment_and_ktk() -> None:
    q, k, v, out = _batch(6)
    stats = LayerStatistics(HKV, D, "ktk", "sv")
    stats.update(q, k, v, out, D**-0.5)
    t = stats.finalize()
    for h in range(HKV):
        o = out[:, h * G : (h + 1) * G].reshape(-1, D).double()
        assert torch.allclose(t.v_target[h], o.T @ o / o.shape[0], rtol=1e-9)
        kh = k[:, h].reshape(-1, D).double()
        assert torch.allclose(t.k_target[h], kh.T @ kh / kh.shape[0], rtol=1e-9)


def test_finalize_without_tokens_raises() -> None:
    with pytest.raises(ValueError, match="no tokens"):
        LayerStatistics(HKV, D).finalize()
