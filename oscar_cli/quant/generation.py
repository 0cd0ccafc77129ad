"""Serving-style generation over an :class:`~oscar_cli.quant.cache.Int2Cache`: chunked prefill + greedy decode.

Batches are **left-padded** (all rows end at the same slot, so the recent window is right-aligned for every
row); ``position_ids`` come from the attention mask, so each row's RoPE positions start at 0 at its first
real token. ``model.generate(..., past_key_values=cache)`` also works with the cache (prefill then counts as
one final chunk); this module exists for chunked prefill, batched early stop and teacher forcing.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from oscar_cli.quant.cache import Int2Cache

DEFAULT_CHUNK = 4096


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` of token ids -> ``(input_ids [B, T], attention_mask [B, T])``, left-padded."""
    t = max(len(r) for r in rows)
    ids = torch.full((len(rows), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, t - len(r) :] = torch.tensor(list(r), dtype=torch.long)
            mask[i, t - len(r) :] = 1
    return ids.to(device), mask.to(device)


def cache_kwarg(model: Any) -> str:
    """The forward argument that takes the cache: ``cache`` (transformers >= 5.24) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


@torch.inference_mode()
def prefill(
    model: Any,
    cache: Int2Cache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK,
    all_logits: bool = False,
) -> torch.Tensor:
    """Run the prompt through the model in chunks of ``chunk_size`` tokens.

    Each chunk attends to earlier chunks through the cache (quantized history) and to itself unquantized;
    only the last chunk keeps a BF16 recent part.

    Returns:
        logits of the last position ``[B, V]`` (float32), or of every position ``[B, T, V]`` with
        ``all_logits``.
    """
    t = input_ids.shape[1]
    cache.set_padding((attention_mask.shape[1] - attention_mask.sum(-1)).tolist())
    pos = _positions(attention_mask)
    outs = []
    for s in range(0, t, chunk_size):
        e = min(t, s + chunk_size)
        with cache.chunk(final=e == t):
            out = model(
                input_ids=input_ids[:, s:e],
                attention_mask=attention_mask[:, :e],
                position_ids=pos[:, s:e],
                use_cache=True,
                logits_to_keep=0 if all_logits else 1,
                **{cache_kwarg(model): cache},
            )
        outs.append(out.logits.float() if all_logits else out.logits[:, -1].float())
    return torch.cat(outs, dim=1) if all_logits else outs[-1]


@torch.inference_mode()
def decode_step(model: Any, cache: Int2Cache, token: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """One decode step: ``token [B]`` with the mask already extended by one column; returns logits ``[B, V]``."""
    pos = (attention_mask.sum(-1, keepdim=True) - 1).clamp(min=0)
    out = model(
        input_ids=token[:, None],
        attention_mask=attention_mask,
        position_ids=pos,
        use_cache=True,
        **{cache_kwarg(model): cache},
    )
    return out.logits[:, -1].float()


@torch.inference_mode()
def greedy_generate(
    model: Any,
    cache: Int2Cache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    chunk_size: int = DEFAULT_CHUNK,
) -> list[list[int]]:
    """Greedy decoding for a left-padded batch; a row stops at its first EOS (not included in the output)."""
    logits = prefill(model, cache, input_ids, attention_mask, chunk_size)
    b = input_ids.shape[0]
    eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=input_ids.device)
    done = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
    outputs: list[list[int]] = [[] for _ in range(b)]
    mask = attention_mask
    for step in range(max_new_tokens):
        token = logits.argmax(-1)
        is_eos = torch.isin(token, eos)
        for i, (tok, stop) in enumerate(zip(token.tolist(), (is_eos | done).tolist(), strict=True)):
            if not stop:
                outputs[i].append(int(tok))
        done |= is_eos
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits = decode_step(model, cache, token, mask)
    return outputs
