"""Capture post-RoPE q, k and v per layer through an attention function registered with ``AttentionInterface``.

:func:`capture_attention` registers a wrapper of transformers' ``sdpa_attention_forward`` under a unique
name (``AttentionInterface.register`` + ``AttentionMaskInterface.register`` with ``sdpa_mask``, so causal
masking is kept), switches the model to it, and hands every call's tensors to an observer. On exit — normal,
exception or Ctrl-C — the model's previous attention implementation is restored and both registrations are
removed. No modeling file is forked: what the observer sees is exactly what the attention kernel sees
(Qwen3: after q_norm/k_norm and RoPE; keys equal those the model writes into its ``DynamicCache``).

The observer is called as ``observer(layer_idx, q, k, v, out, scaling)`` with ``q [B, H_q, T, D]``,
``k, v [B, H_kv, T, D]`` and ``out [B, H_q, T, D]`` (attention output, before ``o_proj``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

Observer = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], None]

_counter = itertools.count()


def _interfaces() -> tuple[Any, Any, Callable[..., Any], Callable[..., Any]]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    return AttentionInterface, AttentionMaskInterface, sdpa_attention_forward, sdpa_mask


def make_attention_function(observer: Observer) -> Callable[..., tuple[torch.Tensor, Any]]:
    """An attention function (transformers' signature) that runs SDPA and reports its inputs/output."""
    _, _, sdpa_forward, _ = _interfaces()

    def oscar_capture_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        out, weights = sdpa_forward(module, query, key, value, attention_mask, **kwargs)
        scaling = kwargs.get("scaling")
        if scaling is None:
            scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
        layer_idx = int(getattr(module, "layer_idx", -1))
        observer(layer_idx, query, key, value, out.transpose(1, 2), float(scaling))
        return out, weights

    return oscar_capture_attention


@contextmanager
def capture_attention(model: Any, observer: Observer) -> Iterator[str]:
    """Route ``model``'s attention through ``observer`` for the duration of the block.

    Yields the registered implementation name. Everything is undone on exit, even on error.
    """
    attention_iface, mask_iface, _, sdpa_mask = _interfaces()
    name = f"oscar_capture_{next(_counter)}"
    previous = model.config._attn_implementation
    attention_iface.register(name, make_attention_function(observer))
    mask_iface.register(name, sdpa_mask)
    try:
        model.set_attn_implementation(name)
        yield name
    finally:
        try:
            if model.config._attn_implementation != previous:
                model.set_attn_implementation(previous)
        finally:
            attention_iface._global_mapping.pop(name, None)
            mask_iface._global_mapping.pop(name, None)


def decoder_body(model: Any) -> Any:
    """The decoder without its LM head (``model.model`` for ``*ForCausalLM``): capture needs no logits."""
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, torch.nn.Module) else model


@torch.inference_mode()
def run_forward(model: Any, input_ids: torch.Tensor) -> None:
    """One unpadded forward pass without cache or logits (``input_ids [B, T]`` on the model's device)."""
    decoder_body(model)(input_ids=input_ids, use_cache=False)


class HoldoutStore:
    """Keeps q, k, v of the held-out sequences per layer (bounded by the held-out budget).

    ``layers[i]`` = list of ``(q [B, H_q, T, D], k [B, H_kv, T, D], v [B, H_kv, T, D])`` per forward call.
    """

    def __init__(self, num_layers: int, max_queries: int) -> None:
        self.layers: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = [[] for _ in range(num_layers)]
        self.max_queries = max_queries
        self.scaling = 1.0

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scaling: float
    ) -> None:
        self.scaling = scaling
        tq = min(self.max_queries, q.shape[2])
        self.layers[layer].append((q[:, :, -tq:].detach().clone(), k.detach().clone(), v.detach().clone()))
