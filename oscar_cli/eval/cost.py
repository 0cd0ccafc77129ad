"""What a run will cost before it starts: prefill FLOPs of its samples over a throughput measured here.

The estimate counts ``2 · P`` FLOPs per prompt token for the ``P`` non-embedding weights, plus causal
attention ``2 · layers · L² · (query heads · head_dim)`` per prompt of ``L`` tokens, and divides by the
float matmul throughput of a 0.1 s probe on the run's device and dtype. It is a floor (the INT2 methods add
quantization work; memory traffic is ignored), good for telling minutes from days.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def prefill_flops(model: Any, lengths: list[int]) -> float:
    """FLOPs of prefilling one prompt of each length in ``lengths`` (one entry per sample)."""
    from oscar_cli.model.geometry import ModelGeometry

    geo = ModelGeometry.from_config(model.config)
    embed = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
             for p in m.parameters()}  # fmt: skip
    weights = sum(p.numel() for p in model.parameters() if id(p) not in embed)
    heads, head_dim, layers = geo.num_attention_heads, geo.head_dim, geo.num_layers
    return float(sum(2 * weights * L + 2 * layers * L * L * heads * head_dim for L in lengths))


def measured_flops_per_second(device: torch.device, dtype: torch.dtype, seconds: float = 0.1) -> float:
    """Matmul throughput (FLOP/s) of ``n × n`` products on ``device`` in ``dtype`` for about ``seconds``."""
    n = 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    count = 0
    t0 = time.perf_counter()
    while True:
        a @ b
        count += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return 2.0 * n**3 * count / dt
