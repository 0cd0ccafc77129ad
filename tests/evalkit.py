"""Test helpers for the evaluations: a tiny random Llama with a character-level tokenizer (no downloads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tiny_models import tiny_llama

from oscar_cli.model import LoadedModel, ModelIdentity


class CharTokenizer:
    """One token per character (code point mod 128); id 0 is padding, id 4 (EOT) is end of sequence."""

    chat_template = None
    pad_token_id = 0
    eos_token_id = 4

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 128 for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i in (0, 4)))


def tiny_loaded(seed: int = 0, max_positions: int = 4096) -> LoadedModel:
    model = tiny_llama(seed, max_position_embeddings=max_positions, eos_token_id=4, pad_token_id=0)
    ident = ModelIdentity(reference="tiny-llama", kind="dir", resolved="sha256:" + "1" * 64, path=Path("."))
    return LoadedModel(model, CharTokenizer(), ident, torch.device("cpu"), torch.float32)


def prose(path: Path, sentences: int = 400) -> Path:
    """Write a small essay-like .txt (varied sentences) and return its folder."""
    words = ["river", "garden", "letter", "morning", "winter", "music", "window", "evening", "bridge", "story"]
    lines = []
    for i in range(sentences):
        a, b, c = words[i % 10], words[(3 * i + 1) % 10], words[(7 * i + 2) % 10]
        lines.append(f"The {a} near the {b} was quiet, and the {c} waited for news number {i}.")
    path.mkdir(parents=True, exist_ok=True)
    (path / "essay.txt").write_text(" ".join(lines), encoding="utf-8")
    return path


def as_loader(loaded: LoadedModel) -> Any:
    """A ``load_model`` replacement that returns ``loaded`` whatever it is asked for."""

    def load_model(*args: Any, **kwargs: Any) -> LoadedModel:
        return loaded

    return load_model
