#!/usr/bin/env python
"""Where a cold start of the embedded model goes (docs/BENCHMARKS.md "Cold start"). Not a test.

  # load_model() with each step timed (wall and process CPU) by wrapping the transformers / gguf-py function
  # that does it; a fresh cache directory is cold, the same one again warm
  python scripts/bench_cold_start.py load --cache-dir "$(mktemp -d)" [--device cuda]
  # `oscar eval-ruler --ctx 128k` as typed, from process start to its first stderr line (then exits)
  OSCAR_CACHE_DIR=$(mktemp -d) /usr/bin/time -f "%e s wall, %U+%S s CPU" python scripts/bench_cold_start.py cli

The wrappers only time; nothing they wrap changes behaviour. Steps transformers does not run (a warm start, a
version without the function) print 0. Nested calls of one function count once (the outermost).
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import os
import sys
import time
from typing import Any

WALL: dict[str, float] = collections.defaultdict(float)
CPU: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()
_DEPTH: collections.Counter[str] = collections.Counter()


def _wrap(owner: Any, name: str, label: str) -> None:
    f = getattr(owner, name, None) if owner is not None else None
    if f is None:
        return

    @functools.wraps(f)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t, c = time.perf_counter(), time.process_time()
        _DEPTH[label] += 1
        try:
            return f(*args, **kwargs)
        finally:
            _DEPTH[label] -= 1
            if _DEPTH[label] == 0:
                WALL[label] += time.perf_counter() - t
                CPU[label] += time.process_time() - c
                CALLS[label] += 1

    setattr(owner, name, timed)


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def load(cache_dir: str, device: str | None) -> None:
    os.environ["OSCAR_CACHE_DIR"] = cache_dir
    t, c = time.perf_counter(), time.process_time()
    import gguf
    import transformers

    import oscar_cli.model.load as oload
    from oscar_cli.model import cache, loaders, resolve

    WALL["imports"], CPU["imports"] = time.perf_counter() - t, time.process_time() - c
    mg = _module("transformers.modeling_gguf_pytorch_utils")
    tok_map = _module("transformers.integrations.gguf.gguf_tokenizer_mapping")
    for owner, name, label in [
        (resolve, "_embedded_gguf", "locate"), (cache, "file_sha256", "identity"),
        (gguf.GGUFReader, "__init__", "parse"), (mg, "load_gguf_checkpoint", "checkpoint"),
        (mg, "get_gguf_hf_weights_map", "name_map"), (gguf, "dequantize", "dequantize"),
        (tok_map, "get_gguf_tokenizer", "tokenizer"), (tok_map, "convert_gguf_tokenizer", "tokenizer"),
        (loaders, "_read_gguf", "read_gguf"), (transformers.PreTrainedModel, "save_pretrained", "write"),
        (transformers.PreTrainedTokenizerBase, "save_pretrained", "write"), (cache, "sha256_file", "hash_files"),
        (oload, "load_directory", "load_directory"),
    ]:
        _wrap(owner, name, label)
    t, c = time.perf_counter(), time.process_time()
    lm = oload.load_model(device=device)
    if lm.device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    WALL["total"], CPU["total"] = time.perf_counter() - t, time.process_time() - c

    def diff(a: str, *bs: str) -> tuple[float, float]:
        return WALL[a] - sum(WALL[b] for b in bs), CPU[a] - sum(CPU[b] for b in bs)

    rows = [
        ("imports (torch, transformers, gguf, oscar_cli.model), before load_model", WALL["imports"], CPU["imports"]),
        ("locate the GGUF + its sha256 (hash index)", WALL["locate"] + WALL["identity"], CPU["locate"] + CPU["identity"]),
        (f"gguf.GGUFReader parse (x{CALLS['parse']})", WALL["parse"], CPU["parse"]),
        ("tensor-name map (get_gguf_hf_weights_map)", WALL["name_map"], CPU["name_map"]),
        (f"dequantize (gguf-py, {CALLS['dequantize']} tensors)", WALL["dequantize"], CPU["dequantize"]),
        (f"rest of load_gguf_checkpoint x{CALLS['checkpoint']} (metadata walks, tensor copies)",
         *diff("checkpoint", "parse", "name_map", "dequantize")),
        ("tokenizer from the GGUF (vocab read + conversion)", WALL["tokenizer"], CPU["tokenizer"]),
        ("config/model/tokenizer objects (rest of from_pretrained)", *diff("read_gguf", "checkpoint", "tokenizer")),
        ("save_pretrained (model + tokenizer)", WALL["write"], CPU["write"]),
        (f"sha256 of cache-entry files (x{CALLS['hash_files']}: after writing, or re-checking)",
         WALL["hash_files"], CPU["hash_files"]),
        (f"entry -> model on {lm.device} (load_directory)", WALL["load_directory"], CPU["load_directory"]),
        (f"load_model total (source: {lm.source})", WALL["total"], CPU["total"]),
    ]
    print("| step | wall s | process CPU s |\n|---|---:|---:|")
    for label, wall, cpu in rows:
        print(f"| {label} | {wall:.2f} | {cpu:.2f} |")


def cli() -> None:
    t0 = time.perf_counter()
    real = sys.stderr

    class FirstLine:
        def write(self, s: str) -> int:
            if "eval-ruler:" in s:
                real.write(f"eval-ruler's first line after {time.perf_counter() - t0:.1f} s: {s.strip()[:80]}\n")
                real.flush()
                os._exit(0)
            return real.write(s)

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    sys.stderr = FirstLine()  # type: ignore[assignment]
    from oscar_cli.main import main

    main(["eval-ruler", "--ctx", "128k"])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("load")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--device", default=None)
    sub.add_parser("cli")
    a = ap.parse_args()
    if a.what == "load":
        load(a.cache_dir, a.device)
    else:
        cli()
