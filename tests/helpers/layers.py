"""Driving one cache layer the way a server does: chunked prefill, then single-token decode steps."""

from __future__ import annotations

from typing import Any

import torch


def feed(layer: Any, k: torch.Tensor, v: torch.Tensor, chunks: list[int], decode: int) -> list:
    """Prefill ``chunks`` (sizes; last is final) then ``decode`` single tokens; return every update's output.

    ``layer``: an ``Int2Layer`` or ``KiviLayer`` (anything with ``final_chunk`` and ``update(k, v)``)."""
    outs, s = [], 0
    for i, c in enumerate(chunks):
        layer.final_chunk = i == len(chunks) - 1
        outs.append(layer.update(k[..., s : s + c, :], v[..., s : s + c, :]))
        s += c
    layer.final_chunk = True
    for _ in range(decode):
        outs.append(layer.update(k[..., s : s + 1, :], v[..., s : s + 1, :]))
        s += 1
    return outs
