"""Tiny random transformers models for tests that need no download.

``tiny_llama_config(**overrides)`` / ``tiny_llama(seed, dtype, **overrides)``: the one tiny Llama shape the tests
share (2 layers, hidden 64, 4 query / 2 KV heads, head_dim 16, vocab 128), in memory.
``write_tiny_llama(dir)``: 2 layers, hidden 64, 4 query / 2 KV heads, head_dim 16, vocab 128, 256 positions,
random weights (seeded) and a word-level tokenizer mapping ``"w<i>"`` to id ``i`` (``"<unk>"`` is 0).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama_config(**overrides: object) -> LlamaConfig:
    """The shared tiny Llama config; ``overrides`` set other fields (e.g. ``max_position_embeddings``)."""
    fields: dict[str, object] = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=2048,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: object) -> LlamaForCausalLM:
    """A seeded random tiny Llama in eval mode (see :func:`tiny_llama_config`)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).to(dtype).eval()


def write_tiny_llama(out: Path, seed: int = 0) -> None:
    """A 2-layer random Llama (GQA 4/2, head_dim 16) with a word-level tokenizer, saved like a Hub repo."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 128)}}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tiny_llama(seed, max_position_embeddings=256).save_pretrained(out)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(out)
