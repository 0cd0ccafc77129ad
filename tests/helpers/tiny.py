"""Tiny random transformers models for tests that need no download: one factory for every family.

``tiny_config(family, ...)`` / ``tiny_causal_lm(family, seed=, dtype=, ...)``: defaults are the shape most tests
share (llama, 2 layers, 4 query / 2 KV heads, head_dim 16, hidden = heads x head_dim = 64, intermediate 128,
vocab 128, 2048 positions), seeded random weights, eval mode, SDPA attention.
``write_tiny_model(dir, ...)``: such a model (256 positions by default) saved like a Hub repo with a word-level
tokenizer mapping ``"w<i>"`` to id ``i`` (``"<unk>"`` is 0).
``tiny_loaded(...)``: a :class:`LoadedModel` around a tiny Llama and :class:`CharTokenizer` (EOS 4, pad 0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from oscar_cli.model import LoadedModel, ModelIdentity

FAMILIES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
}


def tiny_config(family: str = "llama", *, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, layers: int = 2,
                intermediate: int = 128, vocab: int = 128, max_positions: int = 2048,
                **overrides: Any) -> PretrainedConfig:
    """The config of a tiny ``family`` model; ``overrides`` set any other config field (they win)."""
    fields: dict[str, Any] = dict(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        vocab_size=vocab,
        max_position_embeddings=max_positions,
    )
    if family == "mistral":
        fields["sliding_window"] = None  # full attention unless a test asks for a window
    fields.update(overrides)
    return FAMILIES[family](**fields)


def tiny_causal_lm(family: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32,
                   **config: Any) -> Any:
    """A seeded random tiny model of ``family`` in eval mode (``config``: see :func:`tiny_config`)."""
    cfg = tiny_config(family, **config)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype).eval()


def write_tiny_model(out: Path, *, seed: int = 0, max_positions: int = 256, **config: Any) -> Path:
    """Save a tiny model and a word-level tokenizer into ``out`` like a Hub repo; return ``out``."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, config.get("vocab", 128))}}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tiny_causal_lm(seed=seed, max_positions=max_positions, **config).save_pretrained(out)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(out)
    return out


class CharTokenizer:
    """One token per character (code point mod 128); id 0 is padding, id 4 (EOT) is end of sequence."""

    chat_template = None
    pad_token_id = 0
    eos_token_id = 4

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 128 for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i in (0, 4)))


def tiny_loaded(seed: int = 0, max_positions: int = 4096, **config: Any) -> LoadedModel:
    """A tiny Llama (EOS 4, pad 0) with :class:`CharTokenizer`, as ``load_model`` would return it, on CPU."""
    model = tiny_causal_lm(seed=seed, max_positions=max_positions, eos_token_id=4, pad_token_id=0, **config)
    ident = ModelIdentity(reference="tiny-llama", kind="dir", resolved="sha256:" + "1" * 64, path=Path("."))
    return LoadedModel(model, CharTokenizer(), ident, torch.device("cpu"), torch.float32)
