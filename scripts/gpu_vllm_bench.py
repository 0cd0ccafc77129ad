#!/usr/bin/env python3
"""vLLM end to end on one GPU: BF16 (vLLM's default FlashAttention), TurboQuant and oscar INT2 (docs/VLLM.md).

One engine per call (an engine start is 1-3 minutes); the stages of one comma-separated --stage list share it.
Results merge into one JSON file (``--out``, key ``MODEL/BACKEND/STAGE[/CTX]``).

Stages:
  smoke       a tiny Qwen3-shaped engine (random weights, or --model/--artifact) generates 8 tokens for 2 prompts
              with oscar INT2 and with BF16, printing both (run this first: it exercises plugin registration, the
              page spec, quantize-on-write, chunked prefill through the INT2 history, decode and CUDA graphs);
              --debug-steps: per-step wall times of the generation (engine steps one at a time), the backend's
              per-step lines (OSCAR_VLLM_DEBUG_STEPS=1: metadata builds, the first layer's forward time) and every
              process's Python stacks each --stacks-every seconds (OSCAR_VLLM_STACKS_EVERY): a stall shows where
  capacity    the KV-cache capacity vLLM reports (blocks x block size, tokens) at --gpu-mem
  throughput  output tokens/s for a batch of --ctx-token prompts (random ids), --out-tokens (256) output tokens each; the
              batch is as many as the backend's KV capacity holds (at most --max-num-seqs); wall time from the first
              request added to the last token, prefill included (issue #20's workload). The engine is driven step by
              step (see "Step records" below), so the same run also gives the decode-phase figures
  decode      decode throughput at capacity: per --ctx, n requests and out_tokens chosen (plan_decode) so that the pool
              holds all n whole sequences and every request is still decoding for --decode-window steps after the
              last prefill: those steps decode the full batch and nothing else. Needs --max-num-seqs >= n (auto:
              from --kv-tokens-hint); --decode-max-prefill-s skips a ctx whose estimated prefill (n x the TTFT that
              the tpot stage measured earlier in the same call) is longer
  tpot        time per output token at batch 1 for each --ctx (4k,32k,128k): the 256 tokens after the first over
              their steps' time, TTFT to the first, both from one run (tpot_of)
  profile     a torch-profiler trace of one --ctx request generating --profile-tokens tokens (--profile-dir; vLLM
              writes the trace and a table of CUDA time per op there): where a decode step's time goes
  ruler       RULER NIAH through vLLM (oscar's sample generator and scoring: the samples `oscar eval-ruler` builds for
              the same --tasks/--samples/--ctx and seed), greedy, 128 new tokens; needs --model DIR with a tokenizer

Backends: bf16, tq3 (turboquant_3bit_nc), tqk3v4 (turboquant_k3v4_nc), oscar (CUSTOM + --artifact; for the
random-weight Qwen3-8B model a data-free Hadamard artifact is written when --artifact is not given).

Step records (throughput, decode; summarize_steps). Requests are rendered and added as LLM.generate does
(vllm/entrypoints/offline_utils.py:306-316, LLM._preprocess_cmpl_one) but with DELTA outputs (LLM._add_request forces
FINAL_ONLY, offline_utils.py:561) and LLMEngine.step() is called until has_unfinished_requests() is false
(vllm/v1/engine/llm_engine.py:191, :218, :296). Per step: ms (perf_counter from the previous step() return, the
first from the first add_request: the intervals sum to the wall time; the engine core runs in its own process and
steps on while the front end records), tokens (new tokens), requests (requests that got one), pending (requests
still without their first token after the step) and finished (requests done after the step). The engine core emits
nothing for a step that produced no token (LLM turns stats off, vllm/entrypoints/llm.py:235, and then
vllm/v1/core/sched/scheduler.py:1820-1851 has no output to send), so the first front-end step covers the first
prompt's chunks before its last. Figures: the decode phase = the steps in which
every unfinished request already had its first token (no prefill in the step), the full batch = those steps in
which all n requests were still running; each is tokens / seconds over its steps, with the mean batch (tokens per
step) and mean step time; absent (null), not zero, when no step qualifies. With the pool's bytes per token (oscar,
bf16: oscar_cli/vllm/spec.py) a window also gets kv_bytes_per_step = mean batch x ctx x bytes per token (the pages
of the prompts; the generated tokens and oscar's BF16 tiers are not counted) and that divided by the mean step time
(a whole step, model weights included: a lower bound on what the attention kernels read per second).

CUDA graphs and --max-num-seqs (vLLM 0.25). The capture sizes default to 1, 2, 4, multiples of 8 below 256 and
multiples of 16 from 256, up to min(2 x max_num_seqs, 512, max_num_batched_tokens) (vllm/config/vllm.py:1719-1775);
a FULL decode graph is captured only for sizes <= max_num_seqs (V2 runner vllm/v1/worker/gpu/cudagraph_utils.py:
231-242; V1 runner vllm/v1/cudagraph_dispatcher.py:207-221). A decode batch runs in the smallest captured size >= its
size, so --max-num-seqs 147 leaves a batch of 145-147 outside the full graphs (152 > 147 is not captured for decode):
auto rounds up to a capture size (capture_size_at_least), and the throughput / decode records say which full decode
graph their batch used (decode_graph_batch, null: none). Each full graph is one more capture at engine start.

Models: qwen3-8b-dummy (36 layers, 32 q / 8 KV heads, head_dim 128, random bf16 weights, load_format=dummy) or a
local HF model directory.

GPU machine (vLLM from staged wheels; see scripts/ and ../shared/tools/README.md):
  export PYTHONPATH=/tmp/vsite:$PWD
  python3 scripts/gpu_vllm_bench.py --stage smoke --out $OUT/vllm.json
  python3 scripts/gpu_vllm_bench.py --stage smoke --debug-steps --backends oscar --runner v1 --out $OUT/vllm.json
  python3 scripts/gpu_vllm_bench.py --stage capacity --backend oscar --out $OUT/vllm.json
  python3 scripts/gpu_vllm_bench.py --stage throughput --backend bf16 --ctx 32k --out $OUT/vllm.json
  python3 scripts/gpu_vllm_bench.py --stage capacity,tpot,decode --backend oscar --ctx 32k --max-num-seqs auto \
      --kv-tokens-hint 5150656 --decode-max-prefill-s 330 --out $OUT/vllm.json
  python3 scripts/gpu_vllm_bench.py --stage tpot --backend oscar --ctx 4k,32k,128k --out $OUT/vllm.json
  python3 scripts/gpu_vllm_bench.py --stage capacity,tpot,profile --backend oscar --ctx 4k --profile-dir $OUT/prof \
      --out $OUT/vllm.json
  python3 scripts/gpu_vllm_bench.py --stage ruler --backend oscar --model DIR --artifact REF --ctx 4k,16k,32k \
      --tasks niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue --samples 20 --out $OUT/vllm.json
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

KV_DTYPES = {"bf16": None, "tq3": "turboquant_3bit_nc", "tqk3v4": "turboquant_k3v4_nc", "oscar": None}
QWEN3_8B = dict(num_hidden_layers=36, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936)
TINY = dict(num_hidden_layers=2, hidden_size=1024, intermediate_size=2048, num_attention_heads=8,
            num_key_value_heads=2, head_dim=128, vocab_size=4096)


def parse_ctx(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        out.append(int(p[:-1]) * 1024 if p.endswith("k") else int(p))
    return out


# -- the stages' arithmetic, no vLLM or GPU (tests/test_vllm_bench_logic.py) --------------------------------------

# The KV capacity vLLM reported for the Qwen3-8B shape at gpu_memory_utilization 0.85, --max-num-seqs 64, pages of 16
# (docs/VLLM.md, runs 2 and 3): what --kv-tokens-hint takes for --max-num-seqs auto. oscar's pool shrinks as
# max_num_seqs grows (its BF16 tiers, 48.2 MB per sequence slot, are allocated before vLLM sizes the pool), so at
# auto's larger value the engine holds fewer tokens than the hint: the stages re-plan from the engine's own count.
KV_TOKENS_MEASURED = {"oscar": 5_150_656, "bf16": 742_512}


def prefill_first_tokens(n: int, ctx: int, chunk: int) -> list[int]:
    """The engine step (1-based) in which each of ``n`` ``ctx``-token prompts, all added at once, gets its first token.

    vLLM 0.25's scheduler with chunked prefill (vllm/v1/core/sched/scheduler.py:396-1027): a step's budget is
    ``chunk`` (max_num_batched_tokens) tokens; the running requests come first, in admission order (:442), a decode
    taking one token and a request in prefill ``min(left, budget)`` (:480); then waiting requests are admitted into
    what is left (:640). So the prompts prefill one after another and a request decodes from the step after its last
    chunk, every decode taking one token of every later step's budget. Assumes max_num_seqs >= n, no preemption (the
    pool holds every sequence), no prefix caching (the script turns it off).
    """
    if n < 1 or ctx < 1 or chunk < 1:
        raise ValueError(f"need n, ctx, chunk >= 1, got {n}, {ctx}, {chunk}")
    if n > chunk:
        raise ValueError(f"{n} requests: the {n - 1} decoding ones would take the whole {chunk}-token budget of a "
                         "step before the last prompt is prefilled")
    first: list[int] = []
    step, left = 0, ctx
    while len(first) < n:
        step += 1
        budget = chunk - len(first)  # the requests past their prefill decode one token each
        while budget > 0 and len(first) < n:
            take = min(left, budget)
            left -= take
            budget -= take
            if left == 0:
                first.append(step)
                left = ctx
    return first


@dataclass(frozen=True)
class DecodePlan:
    n: int  # requests
    out_tokens: int  # output tokens per request
    first_token_steps: tuple[int, int]  # the steps in which the first and the last request get their first token
    window: int  # full-batch pure-decode steps after the last prefill
    blocks_per_request: int
    usable_blocks: int


def plan_decode(kv_blocks: int, block_size: int, ctx: int, chunk: int, window: int,
                max_requests: int = 0) -> DecodePlan:
    """The largest batch of ``ctx``-token prompts whose whole sequences fit the pool, with ``out_tokens`` such that
    every request is still decoding ``window`` steps after the last prompt's prefill.

    Request i gets its first token in step f_i (:func:`prefill_first_tokens`) and one per step after, so request 0,
    the first to finish, is running through step ``f_last + window`` when ``out_tokens = f_last - f_0 + 1 + window``:
    steps f_last + 1 .. f_last + window decode all n requests and nothing else. A request holds at most
    ``ceil((ctx + out_tokens) / block_size)`` blocks; vLLM's pool keeps one of ``kv_blocks`` as its null block
    (vllm/v1/core/block_pool.py:191). out_tokens grows with n, so the fit is monotone in n (bisection).
    ``max_requests`` (> 0) caps n below what fits: a run whose prefill at full capacity would not finish in time.
    """
    if window < 1:
        raise ValueError(f"the decode window must be >= 1 step, got {window}")
    usable = kv_blocks - 1

    def plan(n: int) -> DecodePlan:
        f = prefill_first_tokens(n, ctx, chunk)
        out = f[-1] - f[0] + 1 + window
        return DecodePlan(n, out, (f[0], f[-1]), window, -(-(ctx + out) // block_size), usable)

    def fits(p: DecodePlan) -> bool:
        return p.n * p.blocks_per_request <= usable

    one = plan(1)
    if not fits(one):
        raise ValueError(f"one {ctx}-token request with {one.out_tokens} output tokens needs "
                         f"{one.blocks_per_request} blocks of {block_size} tokens; the pool has {max(usable, 0)}")
    lo, hi = 1, min(chunk, usable // one.blocks_per_request)  # lo fits; nothing above hi can
    if max_requests > 0:
        hi = max(1, min(hi, max_requests))
    best = one
    while lo < hi:
        mid = (lo + hi + 1) // 2
        p = plan(mid)
        if fits(p):
            lo, best = mid, p
        else:
            hi = mid - 1
    return best


def capture_size_at_least(n: int) -> int:
    """The smallest of vLLM 0.25's default CUDA-graph capture sizes >= ``n`` (vllm/config/vllm.py:1750-1775: 1, 2, 4,
    multiples of 8 below 256, multiples of 16 from 256; at most 512 by default)."""
    if n < 1 or n > 512:
        raise ValueError(f"no default CUDA-graph capture size holds a batch of {n} (1..512)")
    if n <= 4:
        return 1 if n == 1 else 2 if n == 2 else 4
    if n <= 248:
        return -(-n // 8) * 8
    return 256 + max(0, -(-(n - 256) // 16)) * 16


def decode_graph_batch(n: int, max_num_seqs: int, capture_sizes: Iterable[int]) -> int | None:
    """The captured FULL decode graph a decode batch of ``n`` replays in: the smallest capture size >= n that is
    <= max_num_seqs (vllm/v1/worker/gpu/cudagraph_utils.py:233-240); None: the batch runs outside the full graphs."""
    fit = [s for s in capture_sizes if n <= s <= max_num_seqs]
    return min(fit) if fit else None


def resolve_max_num_seqs(value: str, stages: list[str], ctxs: list[int], kv_tokens_hint: int | None,
                         block_size: int, out_tokens: int, chunk: int, window: int) -> int:
    """--max-num-seqs: an integer, or ``auto``: the largest batch the throughput or decode stage of this call needs at
    any --ctx for a pool of ``kv_tokens_hint`` tokens, rounded up to a CUDA-graph capture size."""
    if value != "auto":
        try:
            m = int(value)
        except ValueError:
            raise ValueError(f"--max-num-seqs: expected an integer or auto, got {value!r}") from None
        if m < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {m}")
        return m
    if not kv_tokens_hint:
        raise ValueError("--max-num-seqs auto needs --kv-tokens-hint N (the capacity an earlier run reported: "
                         + ", ".join(f"{b} {t:,}" for b, t in KV_TOKENS_MEASURED.items())
                         + " on the Qwen3-8B shape at --gpu-mem 0.85)")
    need = []
    for ctx in ctxs:
        if "throughput" in stages:
            need.append(max(1, kv_tokens_hint // (ctx + out_tokens)))
        if "decode" in stages:
            need.append(plan_decode(kv_tokens_hint // block_size, block_size, ctx, chunk, window).n)
    if not need:
        raise ValueError("--max-num-seqs auto sizes the batch of the throughput and decode stages; this --stage has "
                         "neither: pass a number")
    return capture_size_at_least(max(need))


def decode_out_bound(max_num_seqs: int, ctx: int, chunk: int, window: int) -> int:
    """An upper bound on :func:`plan_decode`'s out_tokens at ``ctx`` for any pool (n <= max_num_seqs, and out_tokens
    grows with n): what max_model_len must leave room for before the engine reports its capacity."""
    f = prefill_first_tokens(min(max_num_seqs, chunk), ctx, chunk)
    return f[-1] - f[0] + 1 + window


def kv_bytes_per_token(backend: str, layers: int, kv_heads: int, head_dim: int) -> int | None:
    """Pool bytes per token over all layers: oscar's page slot (oscar_cli/vllm/spec.py) or vLLM's BF16 K + V; None for
    the TurboQuant formats (not modelled here)."""
    from oscar_cli.vllm.spec import bf16_token_bytes, slot_bytes

    if backend == "oscar":
        return layers * kv_heads * slot_bytes(head_dim)
    if backend == "bf16":
        return layers * bf16_token_bytes(kv_heads, head_dim)
    return None


@dataclass
class StepLog:
    """One entry per LLMEngine.step() (see "Step records" in the module docstring)."""

    ms: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)

    def append(self, ms: float, tokens: int, requests: int, pending: int, finished: int) -> None:
        self.ms.append(ms)
        self.tokens.append(tokens)
        self.requests.append(requests)
        self.pending.append(pending)
        self.finished.append(finished)


STEP_FIELDS = ("ms", "tokens", "requests", "pending", "finished")


def encode_steps(log: StepLog) -> dict[str, str]:
    """The per-step arrays as space-separated strings (one JSON line each; ms to 0.01)."""
    return {k: " ".join(f"{x:.2f}" if k == "ms" else str(x) for x in getattr(log, k)) for k in STEP_FIELDS}


def decode_steps(d: dict[str, str]) -> StepLog:
    """:func:`encode_steps` inverted."""
    return StepLog([float(x) for x in d["ms"].split()], *([int(x) for x in d[k].split()] for k in STEP_FIELDS[1:]))


def _window(log: StepLog, idx: list[int], bytes_per_request_step: int | None) -> dict[str, Any] | None:
    if not idx:
        return None
    tokens = sum(log.tokens[i] for i in idx)
    ms = sum(log.ms[i] for i in idx)
    w: dict[str, Any] = {"steps": len(idx), "first_step": idx[0] + 1, "tokens": tokens, "seconds": ms / 1e3,
                         "tok_per_s": tokens / (ms / 1e3) if ms > 0 else None, "mean_step_ms": ms / len(idx),
                         "mean_batch": tokens / len(idx)}
    if bytes_per_request_step:
        w["kv_bytes_per_step"] = w["mean_batch"] * bytes_per_request_step
        w["kv_tb_per_s"] = w["kv_bytes_per_step"] / (w["mean_step_ms"] / 1e3) / 1e12 if ms > 0 else None
    return w


def summarize_steps(n: int, log: StepLog, bytes_per_request_step: int | None = None,
                    exclude: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Wall and output tok/s over all steps; the prefill phase (up to the step in which the last request got its first
    token); the decode phase (steps in which every unfinished request already had its first token) and the full batch
    (those steps in which none of the ``n`` requests had finished). A window no step falls in is None. Steps in
    ``exclude`` (0-based: e.g. the ones traced by the profiler) count in the wall time but in no window."""
    wall = sum(log.ms) / 1e3
    tokens = sum(log.tokens)
    done = next((i for i, p in enumerate(log.pending) if p == 0), None)
    pending_before = [n, *log.pending[:-1]]
    finished_before = [0, *log.finished[:-1]]
    decode = [i for i in range(len(log.ms)) if pending_before[i] == 0 and i not in exclude]
    full = [i for i in decode if finished_before[i] == 0]
    return {"steps": len(log.ms), "wall_s": wall, "output_tokens": tokens,
            "output_tok_per_s": tokens / wall if wall > 0 else None,
            "prefill_steps": None if done is None else done + 1,
            "prefill_s": None if done is None else sum(log.ms[: done + 1]) / 1e3,
            "decode_phase": _window(log, decode, bytes_per_request_step),
            "full_batch": _window(log, full, bytes_per_request_step)}


@dataclass
class StepRun:
    wall_s: float
    add_s: float  # rendering and adding the requests (inside wall_s)
    log: StepLog
    tokens: list[list[int]]


@dataclass
class ProfileWindow:
    """A :func:`run_steps` hook that traces ``steps`` engine steps of the full batch: it starts the profiler ``skip``
    steps after the first step in which no request waits for its first token (prefill over, every request decoding)
    and stops it ``steps`` steps later. ``traced`` is then the 0-based indices of the traced steps, for
    :func:`summarize_steps`' ``exclude`` (the profiler slows the steps it traces)."""

    steps: int
    start: Callable[[], None]
    stop: Callable[[], None]
    skip: int = 8
    first_decode: int | None = None
    started_after: int | None = None
    stopped_after: int | None = None

    def __call__(self, done: int, waiting: int) -> None:
        if self.first_decode is None and waiting == 0:
            self.first_decode = done
        if self.first_decode is None or self.stopped_after is not None:
            return
        if self.started_after is None and done >= self.first_decode + self.skip:
            self.start()
            self.started_after = done
        elif self.started_after is not None and done >= self.started_after + self.steps:
            self.stop()
            self.stopped_after = done

    def finish(self) -> None:
        """Stop a trace the run ended inside (fewer steps left than asked)."""
        if self.started_after is not None and self.stopped_after is None:
            self.stop()
            self.stopped_after = self.started_after + self.steps

    @property
    def traced(self) -> frozenset[int]:
        if self.started_after is None:
            return frozenset()
        return frozenset(range(self.started_after, self.started_after + self.steps))


def run_steps(eng: Any, inputs: Iterable[Any], params: Any, echo: bool = False,
              on_step: Callable[[int, int], None] | None = None) -> StepRun:
    """Add ``inputs`` as requests "0", "1", ... to a vLLM LLMEngine (``params`` with DELTA outputs) and step it until it
    has no unfinished request, recording every step (:class:`StepLog`); ``on_step(steps so far, requests still
    without a first token)`` runs after each step is recorded."""
    t0 = time.perf_counter()
    ids = []
    for i, x in enumerate(inputs):
        eng.add_request(str(i), x, params)
        ids.append(str(i))
    prev = time.perf_counter()
    add_s = prev - t0
    toks: dict[str, list[int]] = {i: [] for i in ids}
    waiting = set(ids)
    finished = 0
    log = StepLog()
    while eng.has_unfinished_requests():
        outs = eng.step()
        now = time.perf_counter()
        new = got = 0
        for o in outs:
            t = list(o.outputs[0].token_ids)
            if t:
                got += 1
                new += len(t)
                toks[o.request_id].extend(t)
                waiting.discard(o.request_id)
            finished += bool(o.finished)
        log.append(1e3 * (now - (prev if log.ms else t0)), new, got, len(waiting), finished)
        if on_step is not None:
            on_step(len(log.ms), len(waiting))
        if echo:
            print(f"[step {len(log.ms)}] {log.ms[-1]:.1f} ms, {len(outs)} outputs, {new} tokens, "
                  f"{len(waiting)} waiting for a first token, {finished} finished", flush=True)
        prev = now
    return StepRun(prev - t0, add_s, log, [toks[i] for i in ids])


def write_qwen3_config(out: Path, shape: dict[str, int], max_pos: int) -> Path:
    """A Qwen3ForCausalLM config directory (no weights: vLLM's load_format=dummy fills them at random)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", torch_dtype="bfloat16", rms_norm_eps=1e-6,
               rope_theta=1_000_000.0, max_position_embeddings=max_pos, tie_word_embeddings=False,
               hidden_act="silu", attention_bias=False, bos_token_id=1, eos_token_id=2, **shape)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def write_hadamard_artifact(model_dir: Path, out: Path, int4_keys: int = 0, meta_bits: int = 16,
                            key_mean: str = "constant") -> Path:
    """A data-free oscar artifact (Sylvester Hadamard rotations, no centring, no clipping; S0 = 64, W = 256) for the
    model's architecture: speed does not depend on the values, and a random-weight model has nothing to calibrate.
    ``int4_keys``: that many layers, evenly spaced, with INT4 keys; ``meta_bits`` 8: one-byte scale/zero;
    ``key_mean`` rope: keys centred by position (a random pre-RoPE mean per layer) (the formats of the recipes'
    artifacts, whose serving cost this measures)."""
    import torch
    from transformers import AutoConfig

    from oscar_cli.artifact import Manifest, write_artifact
    from oscar_cli.model import architecture_fingerprint
    from oscar_cli.transform import LayerTransform
    from oscar_kernels.reference import hadamard

    if (out / "manifest.json").exists():
        return out
    cfg = AutoConfig.from_pretrained(model_dir)
    d, h = int(cfg.head_dim), int(cfg.num_key_value_heads)
    r = hadamard(d, torch.float32).unsqueeze(0)
    layers = [LayerTransform(k_rotation=r.clone(), v_rotation=r.clone(), k_mean=torch.zeros(h, d),
                             v_mean=torch.zeros(h, d), k_eigenvalues=torch.zeros(1, d),
                             v_eigenvalues=torch.zeros(1, d), k_clip=0.0, v_clip=0.0)
              for _ in range(int(cfg.num_hidden_layers))]  # own tensors: safetensors refuses shared storage
    n = int(cfg.num_hidden_layers)
    if key_mean == "rope":
        gen = torch.Generator().manual_seed(0)
        layers = [replace(layer, k_mean_pre=torch.randn(h, d, generator=gen)) for layer in layers]
    quant: dict[str, Any] = {"group_size": None, "meta_dtype": "uint8" if meta_bits == 8 else "bfloat16", "sink": 64,
                             "recent": 256}
    if int4_keys:
        quant["int4_keys"] = sorted({round(i * n / int4_keys) for i in range(int4_keys)})
    if key_mean == "rope":
        quant["key_mean"] = "rope"
    m = Manifest(oscar_version="0.1.0", model={"reference": str(model_dir), "resolved": "sha256:" + "0" * 64},
                 architecture=architecture_fingerprint(cfg), method="hadamard", recipe={}, quant=quant, data={},
                 seed=0)
    return write_artifact(out, m, layers, "{}\n")


def expose_plugin() -> None:
    """Make the ``vllm.general_plugins`` entry point visible to every vLLM process when oscar-kv is not installed
    (a repo checkout on PYTHONPATH): a minimal dist-info directory on PYTHONPATH, inherited by the engine core."""
    names = {e.name for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    if "oscar" in names:
        return
    site = Path(tempfile.gettempdir()) / "oscar-vllm-plugin"
    info = site / "oscar_kv_vllm_plugin-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: oscar-kv-vllm-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\noscar = oscar_cli.vllm.plugin:register\n")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()


def engine(model: str, dummy: bool, backend: str, artifact: str | None, args: argparse.Namespace,
           max_model_len: int, gpu_mem: float) -> Any:
    from vllm import LLM

    # every run here samples greedily; FlashInfer's top-k/top-p sampler JIT-compiles its CUDA sources during the
    # engine's warm-up on a machine without its cache (minutes on the H200 image), the same for every backend
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    kw: dict[str, Any] = dict(model=model, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                              gpu_memory_utilization=gpu_mem, max_model_len=max_model_len,
                              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.chunk,
                              enable_prefix_caching=False, enforce_eager=args.eager, block_size=args.block_size)
    if dummy:
        kw["load_format"] = "dummy"
    if getattr(args, "cudagraph_mode", None):
        kw["compilation_config"] = {"cudagraph_mode": args.cudagraph_mode}
    if KV_DTYPES[backend]:
        kw["kv_cache_dtype"] = KV_DTYPES[backend]
    if getattr(args, "profile_dir", None):
        kw["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": str(args.profile_dir),
                                 "torch_profiler_with_stack": False, "torch_profiler_use_gzip": True}
    if backend == "oscar":
        if artifact is None:
            raise SystemExit("--backend oscar needs --artifact for a model with real weights")
        kw.update(attention_backend="CUSTOM", additional_config={"oscar_artifact": artifact})
    t = time.perf_counter()
    llm = LLM(**kw)
    print(f"[{backend}] engine start {time.perf_counter() - t:.0f} s", flush=True)
    return llm


def engine_facts(llm: Any) -> dict[str, Any]:
    cfg = llm.llm_engine.vllm_config
    blocks = int(cfg.cache_config.num_gpu_blocks or 0)
    return {"kv_blocks": blocks, "block_size": int(cfg.cache_config.block_size),
            "kv_tokens": blocks * int(cfg.cache_config.block_size),
            "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
            "attention_backend": str(cfg.attention_config.backend), "kv_cache_dtype": cfg.cache_config.cache_dtype}


def prompts(n: int, length: int, vocab: int, seed: int) -> list[Any]:
    from vllm.inputs import TokensPrompt

    rng = random.Random(seed)
    return [TokensPrompt(prompt_token_ids=[rng.randrange(100, vocab - 100) for _ in range(length)]) for _ in range(n)]


def generate(llm: Any, ps: list[Any], tokens: int) -> tuple[float, list[list[int]]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    t = time.perf_counter()
    outs = llm.generate(ps, sp, use_tqdm=False)
    return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]


def generate_steps(llm: Any, ps: list[Any], tokens: int, echo: bool = False,
                   on_step: Callable[[int, int], None] | None = None) -> StepRun:
    """:func:`generate` one engine step at a time (:func:`run_steps`): the prompts rendered as LLM.generate renders
    them (LLM._preprocess_cmpl_one, one at a time as they are added: vllm/entrypoints/offline_utils.py:306-316), with
    DELTA outputs so that every step returns the requests' new tokens."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA)
    return run_steps(llm.llm_engine, (llm._preprocess_cmpl_one(p) for p in ps), sp, echo, on_step)


def generate_stepwise(llm: Any, ps: list[Any], tokens: int) -> tuple[float, list[list[int]]]:
    """:func:`generate` one engine step at a time, printing each step's wall time and finished requests."""
    run = generate_steps(llm, ps, tokens, echo=True)
    return run.wall_s, run.tokens


def shutdown(llm: Any) -> None:
    import torch

    del llm
    gc.collect()
    torch.cuda.empty_cache()


def save(out: Path, key: str, value: dict[str, Any]) -> None:
    data = json.loads(out.read_text()) if out.exists() else {}
    data[key] = value
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(out)
    print(json.dumps({key: {k: v for k, v in value.items() if k != "step_log"}}), flush=True)  # the log: in the file


def smoke(args: argparse.Namespace, model: str, dummy: bool, artifact: str | None) -> None:
    ps = prompts(1, 700, args.vocab, 1) + prompts(1, 100, args.vocab, 2)  # one past S0 + W, one shorter
    args.chunk = 256  # the 700-token prompt prefills in 3 chunks: later ones attend through the INT2 history
    res: dict[str, Any] = {}
    backends = [b.strip() for b in args.backends.split(",")]
    if not backends or any(b not in KV_DTYPES for b in backends):
        raise SystemExit(f"--backends: expected a comma list of {sorted(KV_DTYPES)}, got {args.backends!r}")
    if args.debug_steps:  # inherited by the engine-core process (oscar_cli/vllm/debug.py)
        os.environ["OSCAR_VLLM_DEBUG_STEPS"] = "1"
        os.environ["OSCAR_VLLM_STACKS_EVERY"] = str(args.stacks_every)
    for backend in backends:
        llm = engine(model, dummy, backend, artifact, args, 2048, 0.3)
        wall, toks = (generate_stepwise if args.debug_steps else generate)(llm, ps, 8)
        res[backend] = {"tokens": toks, "generate_s": wall, **engine_facts(llm)}
        print(f"[{backend}] {toks}  kv_tokens={res[backend]['kv_tokens']} graphs={res[backend]['cudagraph_mode']} "
              f"generate {wall:.2f} s")
        shutdown(llm)
    if set(backends) != {"oscar", "bf16"}:
        save(args.out, f"{args.model_name}/smoke/{'+'.join(backends)}", res)
        return
    agree = [sum(a == b for a, b in zip(x, y, strict=True)) for x, y in zip(res["oscar"]["tokens"],
                                                                             res["bf16"]["tokens"], strict=True)]
    res["agreement"] = {"matching_tokens": agree, "of": 8}
    print(f"oscar vs bf16: {agree} of 8 tokens equal per prompt (random weights: near-ties flip easily)")
    save(args.out, f"{args.model_name}/smoke", res)


def eos_token_ids(model_dir: Path, tok: Any) -> list[int]:
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    for name in ("config.json", "generation_config.json"):
        f = model_dir / name
        if f.exists():
            e = json.loads(f.read_text()).get("eos_token_id")
            ids |= set(e if isinstance(e, list) else [] if e is None else [e])
    return sorted(int(i) for i in ids)


def ruler(args: argparse.Namespace, llm: Any, model_dir: Path, ctxs: list[int], base: str) -> None:
    """RULER NIAH samples from oscar's generator, answered by the vLLM engine, scored by oscar's scorer."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from oscar_cli.eval.niah import parse_tasks
    from oscar_cli.eval.ruler import RulerConfig, build_samples
    from oscar_cli.eval.scoring import match_all, postprocess

    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = RulerConfig(lengths=ctxs, tasks=parse_tasks(args.tasks), methods=[], samples=args.samples)
    sp = SamplingParams(max_tokens=cfg.max_new_tokens, temperature=0.0, stop_token_ids=eos_token_ids(model_dir, tok))
    for (task, length), items in build_samples(cfg, tok).items():
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for _, ids in items], sp, use_tqdm=False)
        preds = [postprocess(str(tok.decode(o.outputs[0].token_ids, skip_special_tokens=True))) for o in outs]
        scores = [100.0 * match_all(p, sample.answers) for (sample, _), p in zip(items, preds, strict=True)]
        save(args.out, f"{base}/ruler/{task}/{length}", {"score": sum(scores) / len(scores), "samples": len(scores),
                                                         "scores": scores, "seconds": time.perf_counter() - t,
                                                         "seed": cfg.seed, "indices": [s.index for s, _ in items],
                                                         "prompt_tokens": [len(ids) for _, ids in items],
                                                         "preds": preds})


def stepwise_record(n: int, ctx: int, run: StepRun, bytes_per_token: int | None,
                    exclude: frozenset[int] = frozenset()) -> dict[str, Any]:
    """The issue's figures (wall, output tok/s, prefill included) and the step log's windows for ``n`` requests."""
    s = summarize_steps(n, run.log, ctx * bytes_per_token if bytes_per_token else None, exclude)
    rec: dict[str, Any] = {"batch": n, "prompt_tokens": ctx, "wall_s": run.wall_s, "add_s": run.add_s,
                           "output_tokens": sum(len(t) for t in run.tokens), "bytes_per_token": bytes_per_token}
    rec["output_tok_per_s"] = rec["output_tokens"] / run.wall_s
    rec |= {k: v for k, v in s.items() if k not in ("wall_s", "output_tokens", "output_tok_per_s")}
    rec["step_log"] = encode_steps(run.log)
    return rec


def window_line(name: str, w: dict[str, Any] | None) -> str:
    if w is None:
        return f"{name}: none"
    bw = f", {w['kv_tb_per_s']:.2f} TB/s of pages" if w.get("kv_tb_per_s") else ""
    return (f"{name}: {w['tok_per_s']:.0f} tok/s over {w['steps']} steps, batch {w['mean_batch']:.1f}, "
            f"{w['mean_step_ms']:.2f} ms/step{bw}")


def graph_batch(llm: Any, n: int, max_num_seqs: int) -> int | None:
    """The FULL decode graph a batch of ``n`` decodes in (None: none; the engine's configured mode and sizes)."""
    cc = llm.llm_engine.vllm_config.compilation_config
    mode = getattr(cc, "cudagraph_mode", None)
    if mode is not None and mode.decode_mode().name != "FULL":
        return None
    return decode_graph_batch(n, max_num_seqs, cc.cudagraph_capture_sizes or [])


def throughput(args: argparse.Namespace, llm: Any, facts: dict[str, Any], ctxs: list[int], base: str,
               bytes_per_token: int | None) -> None:
    for ctx in ctxs:
        n = max(1, min(args.max_num_seqs, facts["kv_tokens"] // (ctx + args.out_tokens)))
        run = generate_steps(llm, prompts(n, ctx, args.vocab, ctx), args.out_tokens)
        rec = stepwise_record(n, ctx, run, bytes_per_token) | {"decode_graph_batch": graph_batch(llm, n, args.max_num_seqs)}
        print(f"[throughput {ctx}] batch {n}: {rec['output_tok_per_s']:.0f} tok/s over {run.wall_s:.1f} s; "
              + "; ".join(window_line(k, rec[k]) for k in ("decode_phase", "full_batch")), flush=True)
        save(args.out, f"{base}/throughput/{ctx}", facts | rec)


def decode(args: argparse.Namespace, llm: Any, facts: dict[str, Any], ctxs: list[int], base: str,
           bytes_per_token: int | None, ttft: dict[int, float]) -> None:
    """Decode throughput at capacity (:func:`plan_decode` from the engine's pool): the full-batch window's tokens/s."""
    for ctx in ctxs:
        where = f"--stage decode at {ctx} tokens"
        try:
            plan = plan_decode(facts["kv_blocks"], facts["block_size"], ctx, args.chunk, args.decode_window)
            full = plan.n  # recorded next to the capped run's
            if 0 < args.decode_max_requests < full:
                plan = plan_decode(facts["kv_blocks"], facts["block_size"], ctx, args.chunk, args.decode_window,
                                   args.decode_max_requests)
                print(f"[decode {ctx}] --decode-max-requests {args.decode_max_requests}: {plan.n} of the {full} "
                      "requests the pool holds", flush=True)
        except ValueError as e:
            raise SystemExit(f"{where}: {e}") from None
        if plan.n > args.max_num_seqs:
            raise SystemExit(f"{where}: the pool ({facts['kv_tokens']:,} tokens) holds {plan.n} requests of "
                             f"{plan.out_tokens} output tokens but --max-num-seqs is {args.max_num_seqs}: pass "
                             f"--max-num-seqs {capture_size_at_least(plan.n)}, or auto with --kv-tokens-hint "
                             f"{facts['kv_tokens']}")
        if ctx + plan.out_tokens > facts["max_model_len"]:
            raise SystemExit(f"{where}: {ctx} + {plan.out_tokens} output tokens exceed max_model_len "
                             f"{facts['max_model_len']} (leave --max-model-len unset)")
        est = plan.n * ttft[ctx] if ctx in ttft else None
        print(f"[decode {ctx}] {plan.n} requests x {plan.out_tokens} output tokens (first tokens in steps "
              f"{plan.first_token_steps[0]}..{plan.first_token_steps[1]}, then a {plan.window}-step full batch); "
              + (f"estimated prefill {est:.0f} s ({plan.n} x TTFT {ttft[ctx]:.2f} s)" if est is not None else
                 "no TTFT measured at this length in this call (the tpot stage first gives one): no estimate"),
              flush=True)
        if args.decode_max_prefill_s and est is not None and est > args.decode_max_prefill_s:
            print(f"[decode {ctx}] skipped: estimated prefill {est:.0f} s > --decode-max-prefill-s "
                  f"{args.decode_max_prefill_s:g}", flush=True)
            continue
        prof = (ProfileWindow(args.decode_profile_steps, llm.start_profile, llm.stop_profile)
                if args.decode_profile_steps else None)
        run = generate_steps(llm, prompts(plan.n, ctx, args.vocab, ctx), plan.out_tokens, on_step=prof)
        if prof is not None:
            prof.finish()
        traced = prof.traced if prof is not None else frozenset()
        rec = stepwise_record(plan.n, ctx, run, bytes_per_token, traced)
        if prof is not None:  # 1-based step numbers, as the windows' first_step
            rec["profiled_steps"] = [min(traced) + 1, max(traced) + 1] if traced else None
            rec["profile_dir"] = str(args.profile_dir)
        rec |= {"out_tokens": plan.out_tokens, "window": plan.window, "planned_first_token_steps":
                list(plan.first_token_steps), "blocks_per_request": plan.blocks_per_request,
                "decode_graph_batch": graph_batch(llm, plan.n, args.max_num_seqs), "estimated_prefill_s": est,
                "requests_that_fit": full}
        fb = rec["full_batch"]
        print(f"[decode {ctx}] batch {plan.n}, {plan.out_tokens} out: prefill phase {rec['prefill_s']:.1f} s; "
              + window_line("full batch", fb) + "; " + window_line("decode phase", rec["decode_phase"]), flush=True)
        save(args.out, f"{base}/decode/{ctx}", facts | rec)


def tpot_of(log: StepLog) -> tuple[float, float, int]:
    """One request's ``(TTFT s, TPOT ms, tokens after the first)`` from its own run's step log (:func:`run_steps`):
    TTFT is the time to the end of the step that gave the first token (adding the request included), TPOT the time
    of every later step over the tokens they gave. Both from the same run, so nothing that happens in another run
    (a kernel compiled on a length's first request) enters one and not the other."""
    first = next((i for i, t in enumerate(log.tokens) if t), None)
    if first is None:
        raise ValueError("the run gave no token")
    later = sum(log.tokens[first + 1:])
    if later <= 0:
        raise ValueError("the run gave no token after its first: no TPOT")
    return sum(log.ms[:first + 1]) / 1e3, sum(log.ms[first + 1:]) / later, later


def tpot(args: argparse.Namespace, llm: Any, facts: dict[str, Any], ctxs: list[int], base: str) -> dict[int, float]:
    """TPOT per ctx at batch 1; returns the TTFTs (the decode stage's prefill estimate).

    Each length runs twice: once for one token (``ttft_first_s``: a length's first request, which pays for any kernel
    variant the engine's warm-up did not compile), then the timed request of ``--out-tokens + 1`` tokens stepped one
    engine step at a time, its TTFT and TPOT both from that run's steps (:func:`tpot_of`), so a compile in the cold
    request cannot enter the TPOT (docs/VLLM.md, "TurboQuant `k3v4` and 3-bit against BF16 and oscar at batch 1")."""
    generate(llm, prompts(1, 64, args.vocab, 7), 8)  # warm-up
    # and a prompt of more than one chunk: later chunks attend through the cache's history (oscar: its Triton
    # dequantization kernel), whose first launch compiles
    generate(llm, prompts(1, min(2 * args.chunk + 64, max(ctxs)), args.vocab, 8), 2)
    ttft = {}
    for ctx in ctxs:
        p = prompts(1, ctx, args.vocab, ctx)
        t_first, _ = generate(llm, p, 1)
        run = generate_steps(llm, p, args.out_tokens + 1)
        t1, ms, later = tpot_of(run.log)
        ttft[ctx] = t1
        save(args.out, f"{base}/tpot/{ctx}", facts | {"prompt_tokens": ctx, "ttft_first_s": t_first, "ttft_s": t1,
                                                      "total_s": run.wall_s, "tpot_ms": ms,
                                                      "output_tokens": len(run.tokens[0]), "tpot_tokens": later,
                                                      "tpot_method": "one run, step times"})
    return ttft


def profile(args: argparse.Namespace, llm: Any, ctxs: list[int], base: str) -> None:
    """A torch-profiler trace (and vLLM's table of CUDA time per op) of one request of --profile-ctx tokens (default:
    the first --ctx) generating --profile-tokens tokens, written under --profile-dir by the engine's worker: the
    prompt's prefill and ``output_tokens - 1`` decode steps (``scripts/trace_summary.py DIR --steps N``)."""
    ctx = args.profile_ctx or ctxs[0]
    p = prompts(1, ctx, args.vocab, ctx)
    generate(llm, p, 2)  # compile / warm every shape first
    llm.start_profile()
    wall, toks = generate(llm, p, args.profile_tokens)
    llm.stop_profile()
    save(args.out, f"{base}/profile/{ctx}", {"prompt_tokens": ctx, "output_tokens": len(toks[0]),
                                                 "wall_s": wall, "dir": str(args.profile_dir),
                                                 "decode_steps_traced": len(toks[0]) - 1})


STAGES = ("smoke", "capacity", "throughput", "tpot", "decode", "ruler", "profile")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", required=True,
                    help="smoke, or a comma list of capacity, throughput, tpot, decode, ruler, profile (run in order "
                    "on one engine)")
    ap.add_argument("--backend", choices=sorted(KV_DTYPES), default="oscar")
    ap.add_argument("--model", default="qwen3-8b-dummy",
                    help="qwen3-8b-dummy, a local HF model directory, or a GGUF file / oscar alias (its converted copy)")
    ap.add_argument("--artifact", help="oscar artifact (path or hf://); default for dummy models: a Hadamard one")
    ap.add_argument("--dummy-int4-keys", type=int, default=0,
                    help="dummy models' Hadamard artifact: this many layers (evenly spaced) with INT4 keys")
    ap.add_argument("--dummy-meta-bits", type=int, choices=(8, 16), default=16,
                    help="dummy models' Hadamard artifact: bits of each scale and zero")
    ap.add_argument("--dummy-key-mean", choices=("constant", "rope"), default="constant",
                    help="dummy models' Hadamard artifact: rope centres keys by position (the Qwen recipe's format)")
    ap.add_argument("--ctx", default="32k", help="prompt lengths, e.g. 32k or 4k,32k,128k")
    ap.add_argument("--out-tokens", type=int, default=256)
    ap.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--max-num-seqs", default="64",
                    help="an integer, or auto: the largest batch this call's throughput / decode stages need at any "
                    "--ctx for a pool of --kv-tokens-hint tokens, rounded up to a CUDA-graph capture size")
    ap.add_argument("--kv-tokens-hint", type=int,
                    help="for --max-num-seqs auto: the KV capacity (tokens) an earlier run reported at the same "
                    "--gpu-mem; Qwen3-8B shape at 0.85 and --max-num-seqs 64: oscar 5150656, bf16 742512 "
                    "(docs/VLLM.md runs 2-3; oscar's pool is smaller at a larger --max-num-seqs: the stages re-plan "
                    "from the engine's count)")
    ap.add_argument("--decode-profile-steps", type=int, default=0,
                    help="--stage decode: trace this many full-batch steps with the torch profiler (needs "
                         "--profile-dir; 8 steps after the last prefill; those steps are left out of the windows)")
    ap.add_argument("--decode-window", type=int, default=128,
                    help="--stage decode: full-batch pure-decode steps after the last prefill")
    ap.add_argument("--decode-max-requests", type=int, default=0,
                    help="--stage decode: at most this many requests (0: as many as the pool holds; the record "
                    "keeps both counts): for a length whose prefill at capacity would outlast the call")
    ap.add_argument("--decode-max-prefill-s", type=float, default=0.0,
                    help="--stage decode: skip a ctx whose estimated prefill (n x the TTFT the tpot stage measured "
                    "earlier in this call) exceeds this many seconds (0: never skip)")
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens (prefill chunk)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="default: the largest --ctx + out tokens + 64 (with --stage decode: + the decode stage's "
                    "output tokens at --max-num-seqs requests)")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (diagnosis only: no CUDA graphs)")
    ap.add_argument("--cudagraph-mode", help="vLLM's compilation_config.cudagraph_mode (default: vLLM's choice)")
    ap.add_argument("--backends", default="oscar,bf16", help="smoke: the engines to run, in order")
    ap.add_argument("--debug-steps", action="store_true",
                    help="smoke: per-step timings and the backend's step log, periodic stack dumps")
    ap.add_argument("--stacks-every", type=float, default=60.0, help="with --debug-steps: seconds between dumps")
    ap.add_argument("--no-pdl", action="store_true",
                    help="oscar: decode kernels without programmatic dependent launches (OSCAR_VLLM_PDL=0)")
    ap.add_argument("--unfused-write", action="store_true",
                    help="oscar: a step's K, V and tier writes as three launches, not one (OSCAR_VLLM_FUSED_WRITE=0); "
                         "results under BACKEND+unfused")
    ap.add_argument("--gather", action="store_true",
                    help="oscar: the decode's q rotation in its own launch, not the tier gather's "
                         "(OSCAR_VLLM_FUSED_GATHER=0); results under BACKEND+gather")
    ap.add_argument("--direct-tiers", action="store_true",
                    help="oscar: no tier gather in any decode step: stage 1 reads the tiers in place and the q rotation "
                         "runs in the K/V rotation's launch (OSCAR_VLLM_DIRECT_TIERS=1; by default only steps of 8+ "
                         "decodes do: core.DIRECT_TIERS_FROM_BATCH); results under BACKEND+direct")
    ap.add_argument("--tier-gather", action="store_true",
                    help="oscar: the tier gather in every decode step, large batches too (OSCAR_VLLM_DIRECT_TIERS=0); "
                         "results under BACKEND+tiergather")
    ap.add_argument("--runner", choices=["auto", "v1", "v2"], default="auto",
                    help="vLLM's model runner (VLLM_USE_V2_MODEL_RUNNER; auto: vLLM's choice)")
    ap.add_argument("--profile-dir", type=Path, help="--stage profile: where the engine writes its torch trace")
    ap.add_argument("--profile-tokens", type=int, default=32, help="--stage profile: output tokens traced")
    ap.add_argument("--profile-ctx", help="--stage profile: the traced prompt's length (default: the first --ctx)")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "oscar-vllm-bench")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    stages = [x.strip() for x in args.stage.split(",") if x.strip()]
    bad = [x for x in stages if x not in STAGES] + (["smoke (alone)"] if "smoke" in stages and len(stages) > 1 else [])
    if not stages or bad:
        raise SystemExit(f"--stage: expected smoke or a comma list of {', '.join(STAGES[1:])}; got {args.stage!r}")
    if args.no_pdl:
        os.environ["OSCAR_VLLM_PDL"] = "0"
    if args.unfused_write:
        if args.backend != "oscar":
            raise SystemExit("--unfused-write: oscar's switch (--backend oscar)")
        os.environ["OSCAR_VLLM_FUSED_WRITE"] = "0"
    if args.direct_tiers:
        if args.backend != "oscar":
            raise SystemExit("--direct-tiers: oscar's switch (--backend oscar)")
        os.environ["OSCAR_VLLM_DIRECT_TIERS"] = "1"
    if args.tier_gather:
        if args.backend != "oscar" or args.direct_tiers:
            raise SystemExit("--tier-gather: oscar's switch (--backend oscar), not with --direct-tiers")
        os.environ["OSCAR_VLLM_DIRECT_TIERS"] = "0"
    if args.gather:
        if args.backend != "oscar":
            raise SystemExit("--gather: oscar's switch (--backend oscar)")
        os.environ["OSCAR_VLLM_FUSED_GATHER"] = "0"
    if args.runner != "auto":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    expose_plugin()
    ctxs = parse_ctx(args.ctx)
    try:
        auto = args.max_num_seqs == "auto"
        args.max_num_seqs = resolve_max_num_seqs(args.max_num_seqs, stages, ctxs, args.kv_tokens_hint,
                                                 args.block_size, args.out_tokens, args.chunk, args.decode_window)
        out_bound = max(decode_out_bound(args.max_num_seqs, c, args.chunk, args.decode_window)
                        for c in ctxs) if "decode" in stages else 0
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if auto:
        print(f"--max-num-seqs auto: {args.max_num_seqs} (pool hint {args.kv_tokens_hint:,} tokens)", flush=True)
    args.profile_ctx = parse_ctx(args.profile_ctx)[0] if args.profile_ctx else None
    smoke_only = stages == ["smoke"]
    dummy = args.model == "qwen3-8b-dummy" or smoke_only and not Path(args.model).exists()
    max_len = args.max_model_len or max([*ctxs, args.profile_ctx or 0]) + max(args.out_tokens, 128, out_bound) + 64
    if dummy:
        shape = TINY if smoke_only else QWEN3_8B
        name = "qwen3-tiny-dummy" if smoke_only else "qwen3-8b-dummy"
        model_dir = write_qwen3_config(args.work / name, shape, max(262144, max_len))
        args.vocab = shape["vocab_size"]
        model_cfg: dict[str, Any] = dict(shape)
    else:  # a model directory, or a GGUF / alias: oscar's converted copy of it (safetensors + tokenizer)
        from oscar_cli.model import model_directory

        model_dir = Path(args.model) if Path(args.model).is_dir() else model_directory(args.model)
        name = Path(args.model).stem if Path(args.model).is_file() else Path(args.model).name
        model_cfg = json.loads((model_dir / "config.json").read_text())
        args.vocab = int(model_cfg["vocab_size"])
    args.model_name = name
    artifact = args.artifact
    tag = ""  # the dummy artifact's format, in its directory name and in the results' keys
    if artifact is None and dummy:
        tag = f"-i4x{args.dummy_int4_keys}" * bool(args.dummy_int4_keys) + "-m8" * (args.dummy_meta_bits == 8) + \
            "-rope" * (args.dummy_key_mean == "rope")
        artifact = str(write_hadamard_artifact(model_dir, args.work / f"{name}-hadamard{tag}", args.dummy_int4_keys,
                                               args.dummy_meta_bits, args.dummy_key_mean))
    if smoke_only:
        smoke(args, str(model_dir), dummy, artifact)
        return
    if args.decode_profile_steps and args.profile_dir is None:
        raise SystemExit("--decode-profile-steps needs --profile-dir DIR")
    if "profile" in stages and args.profile_dir is None:
        raise SystemExit("--stage profile needs --profile-dir DIR")
    if "ruler" in stages and dummy:
        raise SystemExit("--stage ruler needs --model DIR (a model with a tokenizer and real weights)")
    llm = engine(str(model_dir), dummy, args.backend, artifact, args, max_len, args.gpu_mem)
    facts = engine_facts(llm) | {"gpu_memory_utilization": args.gpu_mem, "max_num_seqs": args.max_num_seqs,
                                 "chunk": args.chunk, "max_model_len": max_len}
    base = f"{name}/{args.backend}{tag}" + ("+unfused" if args.unfused_write else "") + \
        ("+gather" if args.gather else "") + ("+direct" if args.direct_tiers else "") + \
        ("+tiergather" if args.tier_gather else "")
    head_dim = model_cfg.get("head_dim") or model_cfg["hidden_size"] // model_cfg["num_attention_heads"]
    bpt = kv_bytes_per_token(args.backend, int(model_cfg["num_hidden_layers"]),
                             int(model_cfg.get("num_key_value_heads", model_cfg["num_attention_heads"])), int(head_dim))
    ttft: dict[int, float] = {}
    for stage in stages:
        if stage == "capacity":
            save(args.out, f"{base}/capacity", facts)
        elif stage == "ruler":
            ruler(args, llm, model_dir, ctxs, base)
        elif stage == "throughput":
            throughput(args, llm, facts, ctxs, base, bpt)
        elif stage == "decode":
            decode(args, llm, facts, ctxs, base, bpt, ttft)
        elif stage == "profile":
            profile(args, llm, ctxs, base)
        else:
            ttft |= tpot(args, llm, facts, ctxs, base)
    shutdown(llm)


if __name__ == "__main__":
    main()
