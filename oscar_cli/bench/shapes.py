"""Attention shapes of real models for ``oscar bench`` (one layer's decode attention)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttnShape:
    """One attention layer: ``h_q`` query heads, ``h_kv`` KV heads, head_dim ``d``."""

    name: str
    h_q: int
    h_kv: int
    d: int

    @property
    def group(self) -> int:
        return self.h_q // self.h_kv


NAMED_SHAPES: dict[str, AttnShape] = {
    "qwen3-8b": AttnShape("qwen3-8b", 32, 8, 128),
    "llama-3.1-8b": AttnShape("llama-3.1-8b", 32, 8, 128),
    "smollm2-135m": AttnShape("smollm2-135m", 9, 3, 64),
}


def parse_shape(text: str) -> AttnShape:
    """``qwen3-8b`` | ``llama-3.1-8b`` | ``smollm2-135m`` | ``H_Q,H_KV,D`` (e.g. ``32,8,128``).

    Raises:
        ValueError: unknown name, malformed triple, ``H_KV`` not dividing ``H_Q``, or ``D`` not 64/128.
    """
    key = text.strip().lower()
    if key in NAMED_SHAPES:
        return NAMED_SHAPES[key]
    parts = key.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        names = ", ".join(NAMED_SHAPES)
        raise ValueError(f"unknown shape {text!r}: use one of {names} or H_Q,H_KV,D such as 32,8,128")
    h_q, h_kv, d = (int(p) for p in parts)
    if h_kv <= 0 or h_q <= 0 or h_q % h_kv:
        raise ValueError(f"shape {text!r}: H_KV must divide H_Q")
    if d not in (64, 128):
        raise ValueError(f"shape {text!r}: the kernels support head_dim 64 and 128, got {d}")
    return AttnShape(f"{h_q}q{h_kv}kv{d}", h_q, h_kv, d)


def parse_int_list(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (sorted, unique, positive)."""
    try:
        vals = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError as exc:
        raise ValueError(f"invalid list {text!r}: use comma-separated positive integers such as 1,4,16") from exc
    if not vals or vals[0] <= 0:
        raise ValueError(f"invalid list {text!r}: use comma-separated positive integers such as 1,4,16")
    return vals
