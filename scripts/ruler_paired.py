"""Paired RULER comparison of eval-ruler samples files: per length, each row's mean over the samples every row has,
and its paired difference to the first row (mean of per-sample differences ± its standard error).

    python3 scripts/ruler_paired.py FILE:METHOD [FILE:METHOD ...]

FILE is an eval-ruler ``samples.jsonl`` (or ``.jsonl.gz``); METHOD picks its records (``oscar``, ``bf16``, ...).
FILE may also be a ``.json`` from ``scripts/gpu_vllm_bench.py --stage ruler`` (records ``MODEL/BACKEND/ruler/TASK/
LENGTH`` with per-sample ``scores`` and ``indices``); METHOD is then the backend (``oscar``, ``tq3``, ``bf16``): its
prompts are eval-ruler's for the same task, length, index and seed.
Samples pair on (task, length, index): eval-ruler builds the same prompt for the same triple and seed, so rows
from different runs pair as long as the haystack and seed are the same. Used for docs/RESULTS.md's and
docs/VLLM.md's paired columns.
"""

from __future__ import annotations

import gzip
import json
import math
import sys
from typing import IO


def load(spec: str) -> dict[tuple[str, int, int], float]:
    path, _, method = spec.rpartition(":")
    if not path:
        raise SystemExit(f"ruler_paired: {spec!r} is not FILE:METHOD")
    if path.endswith(".json"):
        return load_vllm(path, method)
    opener: IO[str] = gzip.open(path, "rt") if path.endswith(".gz") else open(path)  # noqa: SIM115
    with opener as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {(r["task"], int(r["length"]), int(r["index"])): float(r["score"]) for r in rows if r.get("method") == method}


def load_vllm(path: str, backend: str) -> dict[tuple[str, int, int], float]:
    """The per-sample scores of ``backend``'s ruler records in a ``gpu_vllm_bench.py`` output."""
    from vllm_ruler_compare import ruler_records  # scripts/vllm_ruler_compare.py

    with open(path) as f:
        records = json.load(f)
    out: dict[tuple[str, int, int], float] = {}
    for task, length, rec in ruler_records(records, backend):
        if "indices" not in rec or len(rec["indices"]) != len(rec["scores"]):
            raise SystemExit(f"ruler_paired: {path}: {task} at {length} has no per-sample indices to pair on")
        for i, score in zip(rec["indices"], rec["scores"], strict=True):
            out[(task, length, int(i))] = float(score)
    return out


def paired(base: dict, other: dict, keys: list) -> tuple[float, float]:
    """Mean and standard error of ``other - base`` over ``keys``."""
    d = [other[k] - base[k] for k in keys]
    m = sum(d) / len(d)
    se = math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d)) if len(d) > 1 else 0.0
    return m, se


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    sets = [load(s) for s in argv]
    for spec, s in zip(argv, sets, strict=True):
        if not s:
            raise SystemExit(f"ruler_paired: no {spec.rpartition(':')[2]!r} records in {spec.rpartition(':')[0]}")
    common = sorted(set.intersection(*(set(s) for s in sets)))
    print(f"{len(common)} samples common to all {len(sets)} rows")
    print("| length | n | " + " | ".join(argv) + " |")
    print("|---|---:|" + "---:|" * len(sets))
    for length in sorted({k[1] for k in common}) + [0]:
        keys = [k for k in common if not length or k[1] == length]
        cells = [f"{sum(sets[0][k] for k in keys) / len(keys):.2f}"]
        for s in sets[1:]:
            m, se = paired(sets[0], s, keys)
            cells.append(f"{sum(s[k] for k in keys) / len(keys):.2f} ({m:+.2f} ± {se:.2f})")
        print(f"| {length or 'all'} | {len(keys)} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
