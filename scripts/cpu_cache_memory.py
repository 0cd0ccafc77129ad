#!/usr/bin/env python3
"""Where a generation's memory goes, per phase, on CPU: ``DynamicCache`` vs oscar's ``bf16`` cache vs ``oscar``.

    python3 scripts/cpu_cache_memory.py [--tokens 4096] [--layers 2] [--decode 4] [--intermediate 8960]
        [--out cpu_cache_memory.json]

A random qwen2-shaped model with Qwen2.5-Coder-1.5B's attention geometry (hidden 1536, 12 query / 2 KV heads,
head_dim 128; ``--layers`` decoder layers, ``--intermediate`` MLP width, a small vocabulary) in bfloat16 runs
``model.generate`` over a ``--tokens`` prompt (one prefill chunk, as ``model.generate`` sends it) plus ``--decode``
new tokens, once per cache. The oscar method is random per-KV-head rotations, small means, clip 0.9, the default
sink/recent windows, on the reference (torch) path. Allocations come from
:class:`oscar_cli.bench.allocations.AllocationTrace` (``torch.profiler`` with ``profile_memory=True``: the CPU
allocator reports every allocation and free, ``torch.cuda.max_memory_allocated`` has no CPU counterpart).

Per cache: bytes ``attach`` keeps (weights backup, run-time rotations), the prefill and decode forwards' peak
above what was live before them and what they leave (the KV cache), per decoder layer the transient peak of the
cache ``update``, of the whole attention module and of the MLP, and ``peak`` = attach + the generation's
highest live bytes (what ``max_memory_allocated`` after ``reset_peak_memory_stats`` would see, weights aside).
``saving`` = bf16's peak minus oscar's, next to the formula's KV difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

GEOMETRY: dict[str, Any] = {"hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128}


def build_model(layers: int, intermediate: int, positions: int) -> Any:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**GEOMETRY, num_hidden_layers=layers, intermediate_size=intermediate, vocab_size=1024,
                      max_position_embeddings=positions, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(torch.bfloat16).eval()


def random_oscar(config: Any) -> Any:
    from oscar_cli.quant import LayerTransform, oscar_method

    h, d = int(config.num_key_value_heads), int(config.head_dim)
    g = torch.Generator().manual_seed(1)

    def orth() -> torch.Tensor:
        q, r = torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))
        return (q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)).float()

    layers = [LayerTransform(k_rotation=orth(), v_rotation=orth(), k_mean=0.1 * torch.randn(h, d, generator=g),
                             v_mean=0.1 * torch.randn(h, d, generator=g), k_clip=0.9, v_clip=0.9)
              for _ in range(int(config.num_hidden_layers))]
    return oscar_method(layers)


def _wrap_update(cache: Any, trace: Any) -> None:
    update = cache.update

    def traced(*args: Any, **kwargs: Any) -> Any:
        with trace.phase("cache.update"):
            return update(*args, **kwargs)

    cache.update = traced


def run(model: Any, name: str, ids: torch.Tensor, new: int) -> dict[str, Any]:
    """One ``model.generate`` with cache ``name`` (``dynamic``, ``bf16``, ``oscar``) under the trace."""
    from contextlib import ExitStack

    from transformers import DynamicCache

    from oscar_cli.bench.allocations import AllocationTrace, phase_hooks
    from oscar_cli.quant import attach, build_method

    meth = None if name == "dynamic" else random_oscar(model.config) if name == "oscar" else \
        build_method(name, model.config)
    with AllocationTrace() as trace:
        with trace.phase("attach"):
            session = None if meth is None else attach(model, meth, backend="reference")
            cache = DynamicCache(config=model.config) if session is None else session.new_cache()
        _wrap_update(cache, trace)
        with ExitStack() as hooks:
            hooks.enter_context(phase_hooks(model, "forward"))
            for layer in model.model.layers:
                hooks.enter_context(phase_hooks(layer.self_attn, "attention"))
                hooks.enter_context(phase_hooks(layer.mlp, "mlp"))
            with trace.phase("generate"):
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new + 1,
                               min_new_tokens=new + 1, do_sample=False, past_key_values=cache)
        if hasattr(cache, "allocated_bytes"):
            allocated = int(cache.allocated_bytes())
        else:  # DynamicCache: its keys and values
            allocated = sum(int(getattr(layer, f).nbytes) for layer in cache.layers for f in ("keys", "values"))
        if session is not None:
            session.close()
    n_layers = len(model.model.layers)
    fwd = trace.phases("forward")
    att, upd, mlp = (trace.phases(p) for p in ("attention", "cache.update", "mlp"))
    attach_kept = trace.phases("attach")[0].retained
    gen = trace.phases("generate")[0]
    return {
        "attach_retained_bytes": attach_kept,
        "prefill": {"transient_peak_bytes": fwd[0].transient, "retained_bytes": fwd[0].retained},
        "decode": {"max_transient_peak_bytes": max(p.transient for p in fwd[1:]),
                   "retained_bytes_per_step": [p.retained for p in fwd[1:]]},
        "prefill_per_layer": {
            "cache_update_transient_bytes": [p.transient for p in upd[:n_layers]],
            "attention_transient_bytes": [p.transient for p in att[:n_layers]],
            "mlp_transient_bytes": [p.transient for p in mlp[:n_layers]],
        },
        "decode_per_layer_max": {
            "cache_update_transient_bytes": max(p.transient for p in upd[n_layers:]),
            "attention_transient_bytes": max(p.transient for p in att[n_layers:]),
        },
        "cache_allocated_bytes": allocated,
        "peak_bytes": attach_kept + gen.peak - gen.start,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens (one prefill chunk)")
    ap.add_argument("--decode", type=int, default=4, help="decode steps after the prefill")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers")
    ap.add_argument("--intermediate", type=int, default=8960, help="MLP width (Qwen2.5-Coder-1.5B: 8960)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--out", default="cpu_cache_memory.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args.layers, args.intermediate, args.tokens + args.decode + 8)
    ids = torch.randint(5, 1000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    res: dict[str, Any] = {"tokens": args.tokens, "decode": args.decode, "layers": args.layers,
                           "intermediate": args.intermediate, **GEOMETRY}
    with torch.inference_mode():
        for name in ("dynamic", "bf16", "oscar"):
            res[name] = run(model, name, ids, args.decode)
    length = args.tokens + args.decode
    meth = random_oscar(model.config)
    elements = 2 * args.layers * GEOMETRY["num_key_value_heads"] * length * GEOMETRY["head_dim"]
    res["predicted_kv_difference_bytes"] = int(elements * (16 - meth.bits_per_element(length, 128)) / 8)
    res["saving_bytes"] = res["bf16"]["peak_bytes"] - res["oscar"]["peak_bytes"]
    text = json.dumps(res, indent=2)
    Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
