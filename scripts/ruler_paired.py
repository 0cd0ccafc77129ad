"""Paired RULER comparison of eval-ruler samples files: per length, each row's mean over the samples every row has,
and its paired difference to the first row (mean of per-sample differences ± its standard error).

    python3 scripts/ruler_paired.py FILE:METHOD [FILE:METHOD ...]

FILE is an eval-ruler ``samples.jsonl`` (or ``.jsonl.gz``); METHOD picks its records (``oscar``, ``bf16``, ...).
FILE may also be a ``.json`` from ``scripts/gpu_vllm_bench.py --stage ruler`` (records ``MODEL/BACKEND/ruler/TASK/
LENGTH`` with per-sample ``scores`` and ``indices``); METHOD is then the backend (``oscar``, ``tq3``, ``bf16``): its
prompts are eval-ruler's for the same task, length, index and seed.
Samples pair on (task, length, index, seed): eval-ruler builds the same prompt for the same four and haystack, so
rows from different runs pair as long as the haystack is the same too. Records carry their seed and (essay tasks)
their haystack's digest; one without a seed was built with 42, one without a digest pairs with any haystack, and
a sample whose rows name two different haystacks is left out (a line says how many). Used for docs/RESULTS.md's and
docs/VLLM.md's paired columns.
"""

from __future__ import annotations

import gzip
import json
import math
import sys
from typing import IO

Key = tuple[str, int, int, int]  # (task, length, index, seed)


def load(spec: str, haystacks: dict[Key, set[str]] | None = None) -> dict[Key, float]:
    """``FILE:METHOD``'s per-sample scores; each sample's haystack digest (when recorded) is added to ``haystacks``."""
    path, _, method = spec.rpartition(":")
    if not path:
        raise SystemExit(f"ruler_paired: {spec!r} is not FILE:METHOD")
    if path.endswith(".json"):
        return load_vllm(path, method)
    opener: IO[str] = gzip.open(path, "rt") if path.endswith(".gz") else open(path)  # noqa: SIM115
    with opener as f:
        rows = [json.loads(line) for line in f if line.strip()]
    out: dict[Key, float] = {}
    for r in rows:
        if r.get("method") != method:
            continue
        key = (r["task"], int(r["length"]), int(r["index"]), int(r.get("seed", 42)))
        out[key] = float(r["score"])
        if haystacks is not None and r.get("haystack"):
            haystacks.setdefault(key, set()).add(r["haystack"])
    return out


def load_vllm(path: str, backend: str) -> dict[Key, float]:
    """The per-sample scores of ``backend``'s ruler records in a ``gpu_vllm_bench.py`` output (eval-ruler's prompts
    for seed 42 and the shipped haystack)."""
    from vllm_ruler_compare import ruler_records  # scripts/vllm_ruler_compare.py

    with open(path) as f:
        records = json.load(f)
    out: dict[Key, float] = {}
    for task, length, rec in ruler_records(records, backend):
        if "indices" not in rec or len(rec["indices"]) != len(rec["scores"]):
            raise SystemExit(f"ruler_paired: {path}: {task} at {length} has no per-sample indices to pair on")
        for i, score in zip(rec["indices"], rec["scores"], strict=True):
            out[(task, length, int(i), 42)] = float(score)
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
    haystacks: dict[Key, set[str]] = {}
    sets = [load(s, haystacks) for s in argv]
    for spec, s in zip(argv, sets, strict=True):
        if not s:
            raise SystemExit(f"ruler_paired: no {spec.rpartition(':')[2]!r} records in {spec.rpartition(':')[0]}")
    common = sorted(set.intersection(*(set(s) for s in sets)))
    mixed = {k for k in common if len(haystacks.get(k, ())) > 1}
    common = [k for k in common if k not in mixed]
    print(f"{len(common)} samples common to all {len(sets)} rows"
          + (f" ({len(mixed)} left out: their rows were built on different haystacks)" if mixed else ""))
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
