"""Evaluation inputs without downloads: a small essay-like prose folder and a ``load_model`` stand-in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oscar_cli.model import LoadedModel


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
