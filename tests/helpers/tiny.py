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


def write_tiny_gguf(path: Path, *, seed: int = 0, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    head_dim: int = 16, intermediate: int = 128) -> Path:
    """Write a tiny random Llama as a GGUF the way llama.cpp lays one out: Q4_1 matrices (the embedded model's
    type), float32 norms, and a byte-level BPE tokenizer (the 256 byte symbols, two merges, ``<|endoftext|>``)."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), "ab", "abc", "<|endoftext|>"]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL]
    hidden, eot = heads * head_dim, len(tokens) - 1
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["a b", "ab c"])
    w.add_bos_token_id(eot)
    w.add_eos_token_id(eot)
    rng = np.random.default_rng(seed)

    def matrix(name: str, rows: int, cols: int) -> None:  # torch shape (rows, cols), quantized along cols
        data = rng.standard_normal((rows, cols), dtype=np.float32) * 0.05
        w.add_tensor(name, gguf.quantize(data, gguf.GGMLQuantizationType.Q4_1),
                     raw_dtype=gguf.GGMLQuantizationType.Q4_1)  # the shape follows from the blocks' bytes

    def norm(name: str) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))

    matrix("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", hidden, hidden)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, hidden)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", intermediate, hidden)
        matrix(f"blk.{i}.ffn_up.weight", intermediate, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, intermediate)
    norm("output_norm.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
