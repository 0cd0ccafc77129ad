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
  throughput  output tokens/s for a batch of --ctx-token prompts (random ids), 256 output tokens each; the batch is
              as many as the backend's KV capacity holds (at most --max-num-seqs)
  tpot        time per output token at batch 1 for each --ctx (4k,32k,128k): (t(257 tokens) - t(1 token)) / 256
  profile     a torch-profiler trace of one --ctx request generating --profile-tokens tokens (--profile-dir; vLLM
              writes the trace and a table of CUDA time per op there): where a decode step's time goes
  ruler       RULER NIAH through vLLM (oscar's sample generator and scoring: the samples `oscar eval-ruler` builds for
              the same --tasks/--samples/--ctx and seed), greedy, 128 new tokens; needs --model DIR with a tokenizer

Backends: bf16, tq3 (turboquant_3bit_nc), tqk3v4 (turboquant_k3v4_nc), oscar (CUSTOM + --artifact; for the
random-weight Qwen3-8B model a data-free Hadamard artifact is written when --artifact is not given).

Models: qwen3-8b-dummy (36 layers, 32 q / 8 KV heads, head_dim 128, random bf16 weights, load_format=dummy) or a
local HF model directory.

GPU machine (vLLM from staged wheels; see scripts/ and ../shared/tools/README.md):
  export PYTHONPATH=/tmp/vsite:$PWD
  python3 scripts/gpu_vllm_bench.py --stage smoke --out $OUT/vllm.json
  python3 scripts/gpu_vllm_bench.py --stage smoke --debug-steps --backends oscar --runner v1 --out $OUT/vllm.json
  python3 scripts/gpu_vllm_bench.py --stage capacity --backend oscar --out $OUT/vllm.json
  python3 scripts/gpu_vllm_bench.py --stage throughput --backend bf16 --ctx 32k --out $OUT/vllm.json
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


def write_qwen3_config(out: Path, shape: dict[str, int], max_pos: int) -> Path:
    """A Qwen3ForCausalLM config directory (no weights: vLLM's load_format=dummy fills them at random)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", torch_dtype="bfloat16", rms_norm_eps=1e-6,
               rope_theta=1_000_000.0, max_position_embeddings=max_pos, tie_word_embeddings=False,
               hidden_act="silu", attention_bias=False, bos_token_id=1, eos_token_id=2, **shape)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def write_hadamard_artifact(model_dir: Path, out: Path) -> Path:
    """A data-free oscar artifact (Sylvester Hadamard rotations, no centring, no clipping; S0 = 64, W = 256) for the
    model's architecture: speed does not depend on the values, and a random-weight model has nothing to calibrate."""
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
    m = Manifest(oscar_version="0.1.0", model={"reference": str(model_dir), "resolved": "sha256:" + "0" * 64},
                 architecture=architecture_fingerprint(cfg), method="hadamard", recipe={},
                 quant={"group_size": None, "meta_dtype": "bfloat16", "sink": 64, "recent": 256}, data={}, seed=0)
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


def generate_stepwise(llm: Any, ps: list[Any], tokens: int) -> tuple[float, list[list[int]]]:
    """:func:`generate` one engine step at a time, printing each step's wall time and finished requests."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, sp)
    done: dict[str, list[int]] = {}
    t = time.perf_counter()
    step = 0
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = eng.step()
        step += 1
        fin = [o for o in outs if o.finished]
        done.update({o.request_id: list(o.outputs[0].token_ids) for o in fin})
        print(f"[step {step}] {1e3 * (time.perf_counter() - t0):.1f} ms, {len(outs)} outputs, "
              f"{len(fin)} finished", flush=True)
    return time.perf_counter() - t, [done[str(i)] for i in range(len(ps))]


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
    print(json.dumps({key: value}), flush=True)


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
        scores = [100.0 * match_all(postprocess(str(tok.decode(o.outputs[0].token_ids, skip_special_tokens=True))),
                                    sample.answers) for (sample, _), o in zip(items, outs, strict=True)]
        save(args.out, f"{base}/ruler/{task}/{length}", {"score": sum(scores) / len(scores), "samples": len(scores),
                                                         "scores": scores, "seconds": time.perf_counter() - t,
                                                         "seed": cfg.seed})


def throughput(args: argparse.Namespace, llm: Any, facts: dict[str, Any], ctxs: list[int], base: str) -> None:
    for ctx in ctxs:
        n = max(1, min(args.max_num_seqs, facts["kv_tokens"] // (ctx + args.out_tokens)))
        wall, toks = generate(llm, prompts(n, ctx, args.vocab, ctx), args.out_tokens)
        out_tok = sum(len(t) for t in toks)
        save(args.out, f"{base}/throughput/{ctx}", facts | {"batch": n, "prompt_tokens": ctx, "wall_s": wall,
                                                            "output_tokens": out_tok,
                                                            "output_tok_per_s": out_tok / wall})


def tpot(args: argparse.Namespace, llm: Any, facts: dict[str, Any], ctxs: list[int], base: str) -> None:
    generate(llm, prompts(1, 64, args.vocab, 7), 8)  # warm-up
    # and a prompt of more than one chunk: later chunks attend through the cache's history (oscar: its Triton
    # dequantization kernel), whose first launch compiles; without this the first multi-chunk ctx's TTFT holds the
    # compile and its TPOT (from the two runs' difference) comes out low (2026-12-02: 32K "1.91 ms")
    generate(llm, prompts(1, min(2 * args.chunk + 64, max(ctxs)), args.vocab, 8), 2)
    for ctx in ctxs:
        p = prompts(1, ctx, args.vocab, ctx)
        t1, _ = generate(llm, p, 1)
        t2, toks = generate(llm, p, args.out_tokens + 1)
        save(args.out, f"{base}/tpot/{ctx}", facts | {"prompt_tokens": ctx, "ttft_s": t1, "total_s": t2,
                                                      "tpot_ms": 1e3 * (t2 - t1) / args.out_tokens,
                                                      "output_tokens": len(toks[0])})


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


STAGES = ("smoke", "capacity", "throughput", "tpot", "ruler", "profile")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", required=True,
                    help="smoke, or a comma list of capacity, throughput, tpot, ruler (run in order on one engine)")
    ap.add_argument("--backend", choices=sorted(KV_DTYPES), default="oscar")
    ap.add_argument("--model", default="qwen3-8b-dummy",
                    help="qwen3-8b-dummy, a local HF model directory, or a GGUF file / oscar alias (its converted copy)")
    ap.add_argument("--artifact", help="oscar artifact (path or hf://); default for dummy models: a Hadamard one")
    ap.add_argument("--ctx", default="32k", help="prompt lengths, e.g. 32k or 4k,32k,128k")
    ap.add_argument("--out-tokens", type=int, default=256)
    ap.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--gpu-mem", type=float, default=0.85)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens (prefill chunk)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=0, help="default: the largest --ctx + out tokens + 64")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (diagnosis only: no CUDA graphs)")
    ap.add_argument("--cudagraph-mode", help="vLLM's compilation_config.cudagraph_mode (default: vLLM's choice)")
    ap.add_argument("--backends", default="oscar,bf16", help="smoke: the engines to run, in order")
    ap.add_argument("--debug-steps", action="store_true",
                    help="smoke: per-step timings and the backend's step log, periodic stack dumps")
    ap.add_argument("--stacks-every", type=float, default=60.0, help="with --debug-steps: seconds between dumps")
    ap.add_argument("--no-pdl", action="store_true",
                    help="oscar: decode kernels without programmatic dependent launches (OSCAR_VLLM_PDL=0)")
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
    if args.runner != "auto":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if args.runner == "v2" else "0"
    expose_plugin()
    ctxs = parse_ctx(args.ctx)
    args.profile_ctx = parse_ctx(args.profile_ctx)[0] if args.profile_ctx else None
    smoke_only = stages == ["smoke"]
    dummy = args.model == "qwen3-8b-dummy" or smoke_only and not Path(args.model).exists()
    max_len = args.max_model_len or max([*ctxs, args.profile_ctx or 0]) + max(args.out_tokens, 128) + 64
    if dummy:
        shape = TINY if smoke_only else QWEN3_8B
        name = "qwen3-tiny-dummy" if smoke_only else "qwen3-8b-dummy"
        model_dir = write_qwen3_config(args.work / name, shape, max(262144, max_len))
        args.vocab = shape["vocab_size"]
    else:  # a model directory, or a GGUF / alias: oscar's converted copy of it (safetensors + tokenizer)
        from oscar_cli.model import model_directory

        model_dir = Path(args.model) if Path(args.model).is_dir() else model_directory(args.model)
        name = Path(args.model).stem if Path(args.model).is_file() else Path(args.model).name
        args.vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    args.model_name = name
    artifact = args.artifact
    if artifact is None and dummy:
        artifact = str(write_hadamard_artifact(model_dir, args.work / f"{name}-hadamard"))
    if smoke_only:
        smoke(args, str(model_dir), dummy, artifact)
        return
    if "profile" in stages and args.profile_dir is None:
        raise SystemExit("--stage profile needs --profile-dir DIR")
    if "ruler" in stages and dummy:
        raise SystemExit("--stage ruler needs --model DIR (a model with a tokenizer and real weights)")
    llm = engine(str(model_dir), dummy, args.backend, artifact, args, max_len, args.gpu_mem)
    facts = engine_facts(llm) | {"gpu_memory_utilization": args.gpu_mem, "max_num_seqs": args.max_num_seqs,
                                 "chunk": args.chunk, "max_model_len": max_len}
    base = f"{name}/{args.backend}"
    for stage in stages:
        if stage == "capacity":
            save(args.out, f"{base}/capacity", facts)
        elif stage == "ruler":
            ruler(args, llm, model_dir, ctxs, base)
        elif stage == "throughput":
            throughput(args, llm, facts, ctxs, base)
        elif stage == "profile":
            profile(args, llm, ctxs, base)
        else:
            tpot(args, llm, facts, ctxs, base)
    shutdown(llm)


if __name__ == "__main__":
    main()
