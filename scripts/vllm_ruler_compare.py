"""RULER through vLLM against oscar's own path, cell by cell, on the same prompts.

    python3 scripts/vllm_ruler_compare.py VLLM.json SAMPLES.jsonl[.gz] [--backend oscar] [--method oscar]

VLLM.json is ``scripts/gpu_vllm_bench.py --stage ruler``'s output (records ``MODEL/BACKEND/ruler/TASK/LENGTH``
with per-sample ``scores``, and, since they were added, ``indices``, ``prompt_tokens`` and ``preds``); SAMPLES is an
``oscar eval-ruler`` samples file of the same model, tasks, lengths and seed (the generator makes sample ``i`` the
same whatever the run). Per length: both means over the tasks present in both, their difference, and how many
samples scored the same; with ``preds`` also how many answers are identical. A sample whose prompt length differs
between the two (another tokenizer or generator) is counted and left out.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read_samples(path: Path, method: str) -> dict[tuple[str, int, int], dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    out: dict[tuple[str, int, int], dict[str, Any]] = {}
    with opener(path, "rt") as f:  # type: ignore[operator]
        for line in f:
            if line.strip():
                r = json.loads(line)
                if r["method"] == method:
                    out.setdefault((r["task"], int(r["length"]), int(r["index"])), r)
    return out


def ruler_records(vllm: dict[str, Any], backend: str) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """``(task, length, record)`` of ``backend``'s ruler records (keys ``MODEL/BACKEND/ruler/TASK/LENGTH``)."""
    for key, rec in vllm.items():
        parts = key.split("/")
        if len(parts) == 5 and parts[1] == backend and parts[2] == "ruler":
            yield parts[3], int(parts[4]), rec


def compare(vllm: dict[str, Any], ref: dict[tuple[str, int, int], dict[str, Any]], backend: str) -> dict[int, Any]:
    """``{length: {"tasks": {task: (vllm mean, ref mean, n)}, "same_score", "same_pred", "with_pred", "differs"}}``."""
    cells: dict[int, Any] = defaultdict(lambda: {"tasks": {}, "same_score": 0, "same_pred": 0, "with_pred": 0,
                                                 "differs": 0, "n": 0})
    for task, length, rec in ruler_records(vllm, backend):
        idx = rec.get("indices") or list(range(len(rec["scores"])))
        c = cells[length]
        mine, theirs = [], []
        for j, i in enumerate(idx):
            r = ref.get((task, length, i))
            if r is None:
                continue
            if "prompt_tokens" in rec and rec["prompt_tokens"][j] != r.get("prompt_tokens", rec["prompt_tokens"][j]):
                c["differs"] += 1
                continue
            mine.append(rec["scores"][j])
            theirs.append(r["score"])
            c["n"] += 1
            c["same_score"] += rec["scores"][j] == r["score"]
            if "preds" in rec:
                c["with_pred"] += 1
                c["same_pred"] += rec["preds"][j] == r["pred"]
        if mine:
            c["tasks"][task] = (sum(mine) / len(mine), sum(theirs) / len(theirs), len(mine))
    return dict(cells)


def markdown(cells: dict[int, Any]) -> str:
    lines = ["| length | vLLM | oscar's path | vLLM − path | per task (vLLM / path) | same score | same answer |",
             "|---|---:|---:|---:|---|---:|---:|"]
    for length in sorted(cells):
        c = cells[length]
        t = c["tasks"]
        if not t:
            continue
        v = sum(x[0] for x in t.values()) / len(t)
        r = sum(x[1] for x in t.values()) / len(t)
        per = ", ".join(f"{k.removeprefix('niah_')} {a:.0f}/{b:.0f}" for k, (a, b, _) in t.items())
        same = f"{c['same_pred']}/{c['with_pred']}" if c["with_pred"] else "—"
        extra = f" ({c['differs']} prompts differ)" if c["differs"] else ""
        lines.append(f"| {length} | {v:.2f} | {r:.2f} | {v - r:+.2f} | {per} | {c['same_score']}/{c['n']}{extra} "
                     f"| {same} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("vllm", type=Path)
    ap.add_argument("samples", type=Path)
    ap.add_argument("--backend", default="oscar", help="the vLLM run's backend (its records' second field)")
    ap.add_argument("--method", default="oscar", help="the samples file's method")
    args = ap.parse_args(argv)
    cells = compare(json.loads(args.vllm.read_text()), read_samples(args.samples, args.method), args.backend)
    if not cells:
        print("no vLLM ruler record matches a sample of the file", file=sys.stderr)
        return 1
    print(markdown(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
