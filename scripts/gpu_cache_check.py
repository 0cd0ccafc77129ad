#!/usr/bin/env python3
"""CUDA check of the paged INT2 cache: the Triton path against the reference path, and its memory against BF16.

    python3 scripts/gpu_cache_check.py --model PATH_OR_ALIAS --artifact DIR [--ctx 4k,16k] [--samples 20]
        [--long 32k] [--stage all|ruler|kl|memory] [--out gpu_cache_check.json]

1. RULER agreement: NIAH samples (4 tasks x ``--samples`` at each ``--ctx``) through ``greedy_generate`` with the
   ``oscar`` method on ``backend="reference"`` and on ``backend="triton"``; the share of samples whose greedy
   answers are identical (target >= 98 %), the share where both score the same, each backend's score (overall and
   per task and length: `cells`),
   and for every sample where they differ its first differing token and both texts.
2. eval-kl: teacher-forced KL(bf16 || method) over windows of the shipped haystack prose for both backends
   (target: within 10 % of each other).
3. Memory: one ``model.generate`` of ``--long`` tokens (prompt + 64 new; the prompt in one forward) with the
   ``bf16`` cache and with the ``oscar`` cache (Triton path), ``torch.cuda.max_memory_allocated`` of the prefill
   and of the decode steps apart (:class:`PhasePeaks`); per cache the weights, what attaching keeps on the GPU
   (the method's transforms), the KV bytes the cache allocated (pages, tiers, tables) against the formula at the
   prompt's and at the final length. Target: BF16's peak minus oscar's is at least the KV difference the formula
   predicts at the final length (``QuantMethod.bits_per_element``); ``saved_bytes`` /
   ``predicted_kv_difference_bytes`` also give the prefill (formula at the prompt length) and decode phases.

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
STAGES = ("ruler", "kl", "memory")


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
    hit_lists: dict[str, list[float]] = {}  # per sample: string_match_all (a fraction for multi-answer tasks)
    keys = [(task, length, j) for (task, length), items in groups.items() for j in range(len(items))]
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
        hit_lists[backend] = [float(h) for h in hits]
        scores[backend] = round(100 * sum(hits) / len(hits), 2)
    pairs = list(zip(outs["reference"], outs["triton"], strict=True))
    same = sum(a == b for a, b in pairs) / len(pairs)
    same_outcome = sum(a == b for a, b in zip(hit_lists["reference"], hit_lists["triton"], strict=True)) / len(pairs)
    differ = []  # where the two paths part: the first differing generated token and both texts
    for (task, length, j), (a, b), ha, hb in zip(keys, pairs, hit_lists["reference"], hit_lists["triton"],
                                                 strict=True):
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            differ.append({"task": task, "length": length, "sample": j, "first_differing_token": first,
                           "reference": tok.decode(a, skip_special_tokens=True),
                           "triton": tok.decode(b, skip_special_tokens=True),
                           "reference_score": ha, "triton_score": hb})
    cells: dict[str, dict[str, float]] = {}  # per task and length, each backend's score (to compare with vLLM's)
    for backend in ("reference", "triton"):
        for (task, length, _), h in zip(keys, hit_lists[backend], strict=True):
            cells.setdefault(f"{task}/{length}", {}).setdefault(backend, 0.0)
            cells[f"{task}/{length}"][backend] += 100.0 * h / samples
    return {"samples": len(pairs), "identical_share": round(same, 4), "same_outcome_share": round(same_outcome, 4),
            "score": scores, "cells": {k: {b: round(v, 2) for b, v in c.items()} for k, c in cells.items()},
            "seconds": seconds, "differing": differ, "pass": same >= 0.98}


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


class PhasePeaks:
    """Split one ``model.generate`` into its prefill (the first forward) and decode (the rest) memory peaks.

    A forward pre-hook on the model reads the peak when the second forward starts and resets it, so ``prefill``
    is the peak of the prompt's forward (and the first token's sampling) and ``decode`` that of every later step.
    ``peak()`` / ``reset()`` default to ``torch.cuda.max_memory_allocated`` / ``reset_peak_memory_stats``.
    """

    def __init__(self, model: Any, peak: Any = None, reset: Any = None) -> None:
        self.peak = peak or torch.cuda.max_memory_allocated
        self.reset = reset or torch.cuda.reset_peak_memory_stats
        self.model, self.forwards = model, 0
        self.prefill: int | None = None
        self.decode: int | None = None

    def _pre(self, *_: Any) -> None:
        self.forwards += 1
        if self.forwards == 2:
            self.prefill = int(self.peak())
            self.reset()

    def __enter__(self) -> PhasePeaks:
        self.reset()
        self._hook = self.model.register_forward_pre_hook(self._pre)
        return self

    def __exit__(self, *exc: object) -> None:
        self._hook.remove()
        if self.prefill is None:
            self.prefill = int(self.peak())
        else:
            self.decode = int(self.peak())


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages among ``tensors``."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[(str(t.device), st.data_ptr())] = st.nbytes()
    return sum(seen.values())


def method_tensor_bytes(method: Any, device: torch.device) -> int:
    """Bytes of the method's transform tensors on ``device`` (rotations, means: not part of the KV formula)."""
    ts = [getattr(t, f, None) for t in method.layers for f in ("k_rotation", "v_rotation", "k_mean", "v_mean")]
    return tensor_bytes(t for t in ts if isinstance(t, torch.Tensor) and t.device.type == device.type)


def kv_formula_bytes(method: Any, geo: Any, tokens: int) -> int:
    """The formula's KV bytes at ``tokens`` (batch 1): ``2·layers·H_kv·tokens·D·bits_per_element/8``."""
    elements = 2 * geo.num_layers * geo.num_key_value_heads * tokens * geo.head_dim
    return int(elements * method.bits_per_element(tokens, geo.head_dim) / 8)


class CudaMeter:
    """The CUDA allocator's counters :func:`memory` reads (a test passes another meter on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def settle(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


def memory(loaded: Any, artifact: str, long: int, new: int = 64, meter: Any = None) -> dict[str, Any]:
    """``model.generate`` of ``long - new`` prompt tokens (one prefill forward) + ``new`` tokens per cache,
    peaks of the prefill and of the decode steps apart (:class:`PhasePeaks`), against the formula."""
    import oscar_cli as oscar
    from oscar_cli.model.geometry import ModelGeometry
    from oscar_cli.quant.generation import cache_kwarg

    model, dev = loaded.model, loaded.device
    meter = meter or CudaMeter(dev)
    geo = ModelGeometry.of(model.config)
    prompt = long - new
    high = min(1000, int(model.config.vocab_size))
    ids = torch.randint(high // 10, high, (1, prompt), generator=torch.Generator().manual_seed(0)).to(dev)
    weights = tensor_bytes([*model.parameters(), *model.buffers()])
    out: dict[str, Any] = {"tokens": long, "prompt_tokens": prompt, "new_tokens": new, "weights_bytes": weights}
    for name in ("bf16", "oscar"):
        oscar.detach(model)
        meter.settle()
        before = meter.allocated()
        session = oscar.attach(model, artifact if name == "oscar" else None, method=name)
        cache = session.new_cache()
        attached = meter.allocated() - before
        with PhasePeaks(model, peak=meter.peak, reset=meter.reset) as peaks:
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, **{cache_kwarg(model): cache})
            meter.settle()
        predicted = {f"at_{n}": kv_formula_bytes(session.method, geo, n) for n in (prompt, long)}
        allocated = int(cache.allocated_bytes())
        out[name] = {
            "path": cache.path, "peak_bytes": max(peaks.prefill or 0, peaks.decode or 0),
            "prefill_peak_bytes": peaks.prefill, "decode_peak_bytes": peaks.decode,
            "attach_device_bytes": int(attached), "method_tensor_device_bytes": method_tensor_bytes(session.method, dev),
            "kv_allocated_bytes": allocated, "kv_formula_bytes": predicted,
            "kv_allocated_over_formula": round(allocated / max(predicted[f"at_{long}"], 1), 4),
            "persistent_after_bytes": meter.allocated() - before,
        }
        del cache
    oscar.detach(model)
    b, o = out["bf16"], out["oscar"]
    diff = {k: b["kv_formula_bytes"][k] - o["kv_formula_bytes"][k] for k in b["kv_formula_bytes"]}
    saved = {"peak": b["peak_bytes"] - o["peak_bytes"],
             "prefill": b["prefill_peak_bytes"] - o["prefill_peak_bytes"],
             "decode": b["decode_peak_bytes"] - o["decode_peak_bytes"]}
    out.update({
        "saved_bytes": saved,
        "predicted_kv_difference_bytes": {"prefill": diff[f"at_{prompt}"], "decode": diff[f"at_{long}"],
                                          "peak": diff[f"at_{long}"]},
        "pass": saved["peak"] >= diff[f"at_{long}"] and o["path"] == "triton",
    })
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model path or alias (oscar_cli.model.load_model)")
    ap.add_argument("--artifact", required=True, help="OSCAR artifact for the model")
    ap.add_argument("--ctx", default="4k,16k", help="RULER lengths")
    ap.add_argument("--samples", type=int, default=20, help="samples per task and length")
    ap.add_argument("--batch", type=int, default=4, help="RULER batch size")
    ap.add_argument("--kl-ctx", default="4k", help="eval-kl context length")
    ap.add_argument("--long", default="32k", help="tokens of the memory generation")
    ap.add_argument("--stage", choices=("all", *STAGES), default="all", help="run one stage only")
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
    stages = STAGES if args.stage == "all" else (args.stage,)
    res: dict[str, Any] = {"model": args.model, "artifact": args.artifact, "gpu": torch.cuda.get_device_name()}
    if "ruler" in stages:
        res["ruler"] = ruler_agreement(loaded, method, parse_ctx_list(args.ctx), args.samples, args.batch)
    if "kl" in stages:
        res["kl"] = kl_agreement(loaded, method, parse_ctx(args.kl_ctx), 64, 4)
    if "memory" in stages:
        res["memory"] = memory(loaded, args.artifact, parse_ctx(args.long))
    text = json.dumps(res, indent=2)
    Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0 if all(res[k]["pass"] for k in stages) else 1


if __name__ == "__main__":
    sys.exit(main())
