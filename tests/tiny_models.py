"""Tiny random transformers models written to disk like Hub repos, for tests that need no download.

``write_tiny_llama(dir)``: 2 layers, hidden 64, 4 query / 2 KV heads, head_dim 16, vocab 128, 256 positions,
random weights (seeded) and a word-level tokenizer mapping ``"w<i>"`` to id ``i`` (``"<unk>"`` is 0).
"""

from __future__ import annotations

from pathlib import Path

import torch


def write_tiny_llama(out: Path, seed: int = 0) -> None:
    """A 2-layer random Llama (GQA 4/2, head_dim 16) with a word-level tokenizer, saved like a Hub repo."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 128)}}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=256,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(out)
