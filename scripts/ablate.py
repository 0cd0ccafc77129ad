#!/usr/bin/env python
"""Ablation driver: one artifact per recipe variant (one lever each), all evaluated on the same prompts.

Calibrates the base recipe and each variant on the same data and seed, evaluates each artifact with eval-kl on
the same held-out windows (and optionally RULER NIAH on a fixed task/sample set), writes OUT/ablation.json after
every step (a rerun with the same --out skips finished rows) and prints a markdown table on stdout, one row per
variant with deltas vs base; progress lines go to stderr. Library: oscar_cli.eval.ablation / .variants.

Examples:

  # CPU, the embedded SmolLM2-135M, default variants (7), small scale (~90 s a row on 2 cores)
  python scripts/ablate.py smollm2-135m --data ../shared/data/corpus/austen_pride_and_prejudice.txt \\
      --tokens 6k --seq-len 1024 --text ../shared/data/corpus/austen_persuasion.txt --ctx 2k --windows 3 \\
      --kl-tokens 32 --threads 1 --out ablation-cpu
  # GPU: a model's own recipe, default variants, stop starting rows after ~7 minutes (rerun to continue)
  python scripts/ablate.py qwen2.5-coder-1.5b --data prose/ --text held_out.txt --ctx 4k,16k \\
      --backend reference --budget 420 --out ablation-qwen
  # held-out prompts and prose: two RULER seeds in another haystack (#21: tune for generality)
  python scripts/ablate.py smollm2-135m --data ../shared/data/corpus/austen_pride_and_prejudice.txt \\
      --text ../shared/data/corpus/austen_persuasion.txt --ctx 1k --windows 2 --kl-tokens 32 \\
      --variant keys-bf16:quant.keep.fraction/quant.keep.side=1.0/keys --references bf16 --ruler-ctx 1k \\
      --ruler-tasks niah_single_3 --ruler-samples 12 --ruler-seed 7,8 --ruler-haystack-dir HAY --out abl --device cpu
  # two named variants, RULER too
  python scripts/ablate.py MODEL --data calib/ --text held_out.txt --ctx 4k,16k \\
      --variant heads:rotation.grouping=head --variant sink/recent=32/288 \\
      --ruler-ctx 4k --ruler-tasks niah_single_1,niah_multikey_1 --ruler-samples 10 --out abl --budget 420
  python scripts/ablate.py --list-defaults smollm2-135m     # the default variants for a model's recipe

Variants: [NAME:]KEY=VALUE or K1/K2=V1/V2 (KEY a dotted recipe path or a unique leaf name; VALUE as YAML).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="smollm2-135m", help="model alias, path or GGUF file")
    p.add_argument("--recipe", help="base recipe: a shipped name or a YAML file (default: the model's)")
    p.add_argument("--data", help="calibration data for every row (overrides data.source)")
    p.add_argument("--tokens", help="calibration token budget of the base, e.g. 6k (data.tokens)")
    p.add_argument("--seq-len", type=int, help="calibration sequence length of the base (data.seq_len)")
    p.add_argument("--variant", action="append", default=[], help="a variant (repeat); default: --list-defaults")
    p.add_argument("--list-defaults", action="store_true", help="print the default variants and exit")
    p.add_argument("--text", help="held-out prose for eval-kl (not part of --data)")
    p.add_argument("--ctx", default="2k", help="eval-kl context lengths, e.g. 1k,2k")
    p.add_argument("--kl-tokens", type=int, default=64, help="teacher-forced positions scored per window")
    p.add_argument("--windows", type=int, default=4, help="eval-kl windows per length")
    p.add_argument("--references", default="kivi-2", help="methods without an artifact to add as rows ('' = none)")
    p.add_argument("--ruler-ctx", default="", help="RULER lengths (empty: no RULER)")
    p.add_argument("--ruler-tasks", default="niah_single_1,niah_multikey_1", help="RULER tasks")
    p.add_argument("--ruler-samples", type=int, default=10, help="RULER samples per task, length and seed")
    p.add_argument("--ruler-seed", default="42",
                   help="RULER prompt seeds, e.g. 7,8 (eval-ruler --seed; each adds --ruler-samples per task)")
    p.add_argument("--ruler-haystack-dir",
                   help="RULER essay haystack: a folder of .txt prose (eval-ruler --haystack-dir)")
    p.add_argument("--out", default="ablation", help="folder: ablation.json, artifacts/, ruler/")
    p.add_argument("--budget", type=float, help="seconds: no new row starts when it would likely end after this")
    p.add_argument("--device", help="cpu, cuda, cuda:N (default: CUDA when available)")
    p.add_argument("--dtype", help="model dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--backend", default="auto", help="auto | reference | triton")
    p.add_argument("--chunk-size", type=int, default=4096, help="prefill chunk")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; 1 is faster on a busy machine)")
    return p


def _seeds(text: str) -> list[int]:
    """``7,8`` -> [7, 8]: distinct non-negative integers (a ValueError, caught as a one-line error, otherwise)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"--ruler-seed: expected non-negative integers separated by commas, got {text!r}")
    seeds = [int(p) for p in parts]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--ruler-seed: a seed is repeated in {text!r}")
    return seeds


def _log(text: str) -> None:
    print(f"ablate: {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None, loaded: Any = None) -> int:
    """Run the driver; ``loaded`` (an already loaded model) skips loading ``model`` (tests)."""
    from oscar_cli._options import parse_ctx, parse_ctx_list
    from oscar_cli.artifact import model_slug
    from oscar_cli.errors import OscarError
    from oscar_cli.eval.ablation import AblationConfig, markdown_table, run_ablation
    from oscar_cli.eval.niah import parse_tasks
    from oscar_cli.eval.variants import default_variants, parse_variant
    from oscar_cli.recipe import load_recipe, recipe_for_model

    args = _parser().parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        over: dict[str, Any] = {}
        if args.data is not None:
            over.setdefault("data", {})["source"] = args.data
        if args.tokens is not None:
            over.setdefault("data", {})["tokens"] = parse_ctx(args.tokens)
        if args.seq_len is not None:
            over.setdefault("data", {})["seq_len"] = args.seq_len
        base = load_recipe(args.recipe or recipe_for_model(model_slug(args.model)), over)
        if loaded is None and args.list_defaults:
            from oscar_cli.model import load_config

            config = load_config(args.model)[1]
        else:
            if loaded is None:
                from oscar_cli.model import load_model

                _log(f"loading {args.model}")
                loaded = load_model(args.model, device=args.device, dtype=args.dtype)
            config = loaded.model.config
        from oscar_cli.model.geometry import ModelGeometry

        native = int(getattr(config, "max_position_embeddings", 0) or 0) or 1 << 20
        specs = args.variant or default_variants(base, native, ModelGeometry.of(config).head_dim)
        variants = [parse_variant(s, base) for s in specs]
        if args.list_defaults:
            print("\n".join(specs))
            return 0
        if not args.text:
            raise OscarError("--text is required: held-out prose for eval-kl", hint="e.g. --text held_out.txt")
        cfg = AblationConfig(
            text=args.text, ctx=parse_ctx_list(args.ctx), out=args.out, kl_tokens=args.kl_tokens,
            windows=args.windows, chunk_size=args.chunk_size, backend=args.backend,
            references=[r for r in args.references.split(",") if r.strip()],
            ruler_ctx=parse_ctx_list(args.ruler_ctx) if args.ruler_ctx.strip() else [],
            ruler_tasks=parse_tasks(args.ruler_tasks) if args.ruler_ctx.strip() else [],
            ruler_samples=args.ruler_samples, ruler_seeds=_seeds(args.ruler_seed),
            ruler_haystack_dir=args.ruler_haystack_dir, budget_s=args.budget,
        )
        state = run_ablation(loaded, base, variants, cfg, _log)
    except OscarError as exc:
        if os.environ.get("OSCAR_DEBUG") == "1":
            raise
        print(f"ablate: error: {exc.message}" + (f"\n  hint: {exc.hint}" if exc.hint else ""), file=sys.stderr)
        return 1
    except ValueError as exc:  # parse_ctx / parse_ctx_list
        print(f"ablate: error: {exc}", file=sys.stderr)
        return 1
    print(markdown_table(state))
    return 0


if __name__ == "__main__":
    sys.exit(main())
