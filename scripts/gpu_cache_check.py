#!/usr/bin/env python3
"""CUDA check of the paged INT2 cache: the Triton path against the reference path, and its memory against BF16.

    python3 scripts/gpu_cache_check.py --model PATH_OR_ALIAS --artifact DIR [--ctx 4k,16k] [--samples 20]
        [--long 32k] [--out gpu_cache_check.json]

1. RULER agreement: NIAH samples (4 tasks x ``--samples`` at each ``--ctx``) through ``greedy_generate`` with the
   ``oscar`` method on ``backend="reference"`` and on ``backend="triton"``; the share of samples whose greedy
   answers are identical (target >= 98 %) and each backend's score.
2. eval-kl: teacher-forced KL(bf16 || method) over windows of the shipped haystack prose for both backends
   (target: within 10 % of each other).
3. Memory: ``torch.cuda.max_memory_allocated`` during one ``model.generate`` of ``--long`` tokens (prompt + 64 new)
   with the ``bf16`` cache and with the ``oscar`` cache (Triton path); target: BF16's peak minus oscar's is at least
   the KV difference the formula predicts (``QuantMethod.bits_per_element``).

Prints one JSON object (also written to ``--out``); exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

TASKS = "niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue"


def ruler_agreement(loaded: Any, method: Any, ctx: list[int], samples: int, batch: int) -> dict[str, Any]:
    from oscar_cli.eval.niah import parse_tasks
    from oscar_cli.eval.ruler import RulerConfig, build_samples, eos_ids
    from oscar_cli.eval.scoring import match_all, postprocess
    from oscar_cli.quant import greedy_generate, left_pad, use_method

    cfg = RulerConfig(lengths=ctx, tasks=parse_tasks(TASKS), methods=["oscar"], samples=samples)
    groups = build_samples(cfg, loaded.tokenizer)
    tok, model = loaded.tokenizer, loaded.model
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos_ids(model, tok) or [0])[0]
    outs: dict[str, list[list[int]]] = {}
    scores: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for backend in ("reference", "triton"):
        rows, hits = [], []
        t0 = time.perf_counter()
        with use_method(model, method, backend=backend) as session:
            for items in groups.values():
                for i in range(0, len(items), batch):
                    part = items[i : i + batch]
                    ids, mask = left_pad([p for _, p in part], pad, loaded.device)
                    cache = session.new_cache()
                    got = greedy_generate(model, cache, ids, mask, cfg.max_new_tokens, eos_ids(model, tok))
                    assert cache.path == backend, (cache.path, backend)  # no silent fallback
                    rows += got
                    hits += [match_all(postprocess(tok.decode(g, skip_special_tokens=True)), s.answers)
                             for (s, _), g in zip(part, got, strict=True)]
        seconds[backend] = round(time.perf_counter() - t0, 1)
        outs[backend] = rows
        scores[backend] = round(100 * sum(hits) / len(hits), 2)
    same = sum(a == b for a, b in zip(outs["reference"], outs["triton"], strict=True)) / len(outs["reference"])
    return {"samples": len(outs["reference"]), "identical_share": round(same, 4), "score": scores,
            "seconds": seconds, "pass": same >= 0.98}


def kl_agreement(loaded: Any, method: Any, length: int, tokens: int, windows: int) -> dict[str, Any]:
    from oscar_cli.eval.kl import compare, cut_windows, teacher_forced_logprobs
    from oscar_cli.eval.niah import shipped_haystack
    from oscar_cli.method_registry import build_method
    from oscar_cli.quant import use_method

    text = "\n".join(shipped_haystack())
    ids = list(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])
    batch = cut_windows(ids, length, tokens, windows).to(loaded.device)
    targets = batch[:, length:]
    lps = {}
    for name, meth, backend in (("bf16", build_method("bf16", loaded.model.config), "reference"),
                                ("reference", method, "reference"), ("triton", method, "triton")):
        with use_method(loaded.model, meth, backend=backend) as session:
            lps[name] = teacher_forced_logprobs(loaded.model, session, batch, length, 4096)
    ref = compare(lps["bf16"], lps["reference"], targets)
    tri = compare(lps["bf16"], lps["triton"], targets)
    rel = abs(tri["kl"] - ref["kl"]) / max(ref["kl"], 1e-9)
    return {"length": length, "reference": ref, "triton": tri, "kl_rel_diff": round(rel, 4), "pass": rel <= 0.10}


def memory(loaded: Any, artifact: str, long: int, new: int = 64) -> dict[str, Any]:
    import oscar_cli as oscar
    from oscar_cli.model.geometry import ModelGeometry
    from oscar_cli.quant.generation import cache_kwarg

    model, dev = loaded.model, loaded.device
    geo = ModelGeometry.of(model.config)
    ids = torch.randint(100, 1000, (1, long - new), generator=torch.Generator().manual_seed(0)).to(dev)
    peaks, paths = {}, {}
    for name in ("bf16", "oscar"):
        cache = oscar.kv_cache(model, artifact if name == "oscar" else None, method=name)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, **{cache_kwarg(model): cache})
        torch.cuda.synchronize()
        peaks[name], paths[name] = int(torch.cuda.max_memory_allocated(dev)), cache.path
        del cache
    session = oscar.attach(model, artifact)
    elements = 2 * geo.num_layers * geo.num_key_value_heads * long * geo.head_dim
    predicted = int(elements * (16 - session.method.bits_per_element(long, geo.head_dim)) / 8)
    oscar.detach(model)
    saved = peaks["bf16"] - peaks["oscar"]
    return {"tokens": long, "peak_bytes": peaks, "paths": paths, "saved_bytes": saved,
            "predicted_kv_difference_bytes": predicted, "pass": saved >= predicted and paths["oscar"] == "triton"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model path or alias (oscar_cli.model.load_model)")
    ap.add_argument("--artifact", required=True, help="OSCAR artifact for the model")
    ap.add_argument("--ctx", default="4k,16k", help="RULER lengths")
    ap.add_argument("--samples", type=int, default=20, help="samples per task and length")
    ap.add_argument("--batch", type=int, default=4, help="RULER batch size")
    ap.add_argument("--kl-ctx", default="4k", help="eval-kl context length")
    ap.add_argument("--long", default="32k", help="tokens of the memory generation")
    ap.add_argument("--out", default="gpu_cache_check.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_cache_check needs CUDA", file=sys.stderr)
        return 2
    from oscar_cli._options import parse_ctx, parse_ctx_list
    from oscar_cli.method_registry import build_method
    from oscar_cli.model import load_model

    loaded = load_model(args.model, device="cuda", dtype="bfloat16")
    method = build_method("oscar", loaded.model.config, args.artifact)
    res = {
        "model": args.model, "artifact": args.artifact,
        "ruler": ruler_agreement(loaded, method, parse_ctx_list(args.ctx), args.samples, args.batch),
        "kl": kl_agreement(loaded, method, parse_ctx(args.kl_ctx), 64, 4),
        "memory": memory(loaded, args.artifact, parse_ctx(args.long)),
        "gpu": torch.cuda.get_device_name(),
    }
    text = json.dumps(res, indent=2)
    Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0 if all(res[k]["pass"] for k in ("ruler", "kl", "memory")) else 1


if __name__ == "__main__":
    sys.exit(main())
