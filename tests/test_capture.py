"""Capture through a registered attention function: tiny random models of each supported family."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.tiny import tiny_causal_lm
from transformers import DynamicCache
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from oscar_cli.calibration.capture import HoldoutStore, capture_attention, run_forward

pytestmark = pytest.mark.unit


class Recorder:
    def __init__(self) -> None:
        self.calls: dict[int, tuple[torch.Tensor, ...]] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 scaling: float) -> None:
        self.calls[layer] = (q.clone(), k.clone(), v.clone(), out.clone())


@pytest.mark.parametrize(
    ("family", "h_q", "h_kv"),
    [("llama", 4, 2), ("llama", 4, 4), ("qwen2", 6, 2), ("qwen3", 8, 2), ("qwen3", 4, 1), ("mistral", 6, 3)],
)
def test_captured_keys_equal_cache_keys_and_logits_unchanged(family: str, h_q: int, h_kv: int) -> None:
    model = tiny_causal_lm(family, heads=h_q, kv_heads=h_kv)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids, use_cache=True)
    ref_logits, cache = ref.logits, ref.past_key_values
    assert isinstance(cache, DynamicCache)
    rec = Recorder()
    with torch.no_grad(), capture_attention(model, rec):
        logits = model(ids, use_cache=False).logits
    assert torch.allclose(logits, ref_logits, atol=1e-5)
    assert sorted(rec.calls) == [0, 1]
    for i in range(2):
        q, k, v, out = rec.calls[i]
        assert q.shape == (2, h_q, 24, 16) and k.shape == (2, h_kv, 24, 16) and out.shape == q.shape
        assert torch.equal(k, cache.layers[i].keys)
        assert torch.equal(v, cache.layers[i].values)
    assert model.config._attn_implementation == "sdpa"


def test_qwen3_keys_are_post_norm_and_post_rope() -> None:
    model = tiny_causal_lm("qwen3")
    with torch.no_grad():
        model.model.layers[0].self_attn.k_norm.weight.mul_(3.0)  # make k_norm visible
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    raw: dict[str, torch.Tensor] = {}
    handle = model.model.layers[0].self_attn.k_proj.register_forward_hook(
        lambda m, a, o: raw.__setitem__("k", o.detach().clone())
    )
    rec = Recorder()
    try:
        with torch.no_grad(), capture_attention(model, rec):
            model(ids)
    finally:
        handle.remove()
    k_pre = raw["k"].view(1, 10, 2, 16).transpose(1, 2)
    # position 0 has RoPE angle 0: captured key = k_norm(k_proj) exactly there, and differs later (RoPE)
    k_norm = model.model.layers[0].self_attn.k_norm
    with torch.no_grad():
        expected0 = k_norm(k_pre)[:, :, 0]
    assert torch.allclose(rec.calls[0][1][:, :, 0], expected0, atol=1e-5)
    assert not torch.allclose(rec.calls[0][1][:, :, 5], k_norm(k_pre)[:, :, 5].detach(), atol=1e-3)


def test_everything_is_removed_even_on_error() -> None:
    model = tiny_causal_lm("llama")
    before_attn = set(AttentionInterface._global_mapping)
    before_mask = set(AttentionMaskInterface._global_mapping)

    def boom(*args: Any) -> None:
        raise RuntimeError("observer failed")

    with pytest.raises(RuntimeError, match="observer failed"), capture_attention(model, boom):
        model(torch.zeros(1, 4, dtype=torch.long))
    assert model.config._attn_implementation == "sdpa"
    assert set(AttentionInterface._global_mapping) == before_attn
    assert set(AttentionMaskInterface._global_mapping) == before_mask
    with pytest.raises(KeyboardInterrupt), capture_attention(model, Recorder()):
        raise KeyboardInterrupt
    assert model.config._attn_implementation == "sdpa"
    assert set(AttentionInterface._global_mapping) == before_attn


def test_causal_mask_is_kept() -> None:
    model = tiny_causal_lm("llama")
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    rec = Recorder()
    with torch.no_grad(), capture_attention(model, rec):
        full = model(ids).logits
        prefix = model(ids[:, :6]).logits
    assert torch.allclose(full[:, :6], prefix, atol=1e-5)  # future tokens do not leak


def test_run_forward_and_holdout_store() -> None:
    model = tiny_causal_lm("qwen3", heads=8)
    store = HoldoutStore(num_layers=2, max_queries=5)
    with capture_attention(model, store):
        run_forward(model, torch.randint(0, 128, (1, 16)))
    q, k, v = store.layers[1][0]
    assert q.shape == (1, 8, 5, 16) and k.shape == (1, 2, 16, 16) and v.shape == k.shape
    assert store.scaling == pytest.approx(16**-0.5)
