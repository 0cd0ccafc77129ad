"""docs/RESULTS.md tables and the heatmap from an eval-ruler samples file (and eval-kl results next to it).

    python3 scripts/ruler_table.py .stage/qsweep [--samples 25] [--heatmap docs/results/X.png]

FOLDER holds ``samples.jsonl`` (every eval-ruler run of a sweep appended to one file, e.g. ``gpu_session.sh
qsweep``) and optionally ``kl-*.json`` (``oscar --json eval-kl`` outputs). Printed as Markdown:

- RULER: mean ``string_match_all`` over the 8 NIAH tasks per method and length (each task's mean first, as
  eval-ruler's summary does); a cell with fewer than ``tasks × samples`` records is marked ``*`` with its count;
  lengths that ran under YaRN are labelled with the factor; the last column is the measured BPE at the shortest
  and longest length;
- GPU seconds per cell: the sum of ``batch_seconds`` over the cell's batches (prefill + decode as timed by
  eval-ruler; model loads and prompt building are not in it), and the total;
- eval-kl: KL and top-1 agreement per method and length, with the windows.

The heatmap is eval-ruler's own (:func:`oscar_cli.eval.heatmap.plot_heatmap`, ``*`` on partial cells).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from oscar_cli.eval.ruler import prompt_set, read_records

ORDER = ("bf16", "oscar", "kivi-2", "naive-int2", "quarot-int2")


def _ctx(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def _dedupe(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per eval-ruler resume key (the first): method, source, RoPE, task, length, index, and the prompt
    set's seed (42 where unrecorded) and essay haystack digest; another seed's samples count as more samples."""
    seen, out = set(), []
    for r in records:
        k = (r["method"], r.get("method_source", ""), r.get("rope", ""), r["task"], int(r["length"]), int(r["index"]),
             *prompt_set(r))
        if k not in seen:
            seen.add(k)
            out.append(r)
    return out


def check_one_config(records: list[dict[str, Any]]) -> None:
    """Refuse records a table cannot mix: one method from two sources (e.g. two artifacts, or one artifact path
    rewritten with other serving settings: ``artifact_serving``), or one length run under two RoPE settings."""
    sources: dict[str, set[str]] = defaultdict(set)
    ropes: dict[int, set[str]] = defaultdict(set)
    for r in records:
        serving = r.get("artifact_serving")
        sources[r["method"]].add(r.get("method_source", "") + (f" [serving {serving[7:19]}]" if serving else ""))
        ropes[int(r["length"])].add(r.get("rope", ""))
    for m, s in sources.items():
        if len(s) > 1:
            raise SystemExit(f"ruler_table: {m} has records from {len(s)} sources ({'; '.join(sorted(s))}); "
                             "filter the samples file to one")
    for L, s in ropes.items():
        if len(s) > 1:
            raise SystemExit(f"ruler_table: length {L} ran under {len(s)} RoPE settings {sorted(s)}")


def tables(records: list[dict[str, Any]], samples: int) -> dict[str, Any]:
    """Per-task scores and counts, per-cell means, partial flags, BPE, GPU seconds (see the module docstring)."""
    from oscar_cli.eval.niah import TASK_NAMES

    records = _dedupe(records)
    check_one_config(records)
    tasks = [t for t in TASK_NAMES if any(r["task"] == t for r in records)]
    tasks += sorted({r["task"] for r in records} - set(tasks))
    lengths = sorted({int(r["length"]) for r in records})
    methods = [m for m in ORDER if any(r["method"] == m for r in records)]
    methods += sorted({r["method"] for r in records} - set(methods))
    rope = {int(r["length"]): r.get("rope", "") for r in records}
    vals: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    bpe: dict[tuple[str, int], list[float]] = defaultdict(list)
    batches: dict[tuple[str, int], set[tuple[float, int]]] = defaultdict(set)
    for r in records:
        m, L = r["method"], int(r["length"])
        vals[(m, r["task"], L)].append(float(r["score"]))
        b = r.get("bpe_measured_batch")
        if isinstance(b, int | float) and b == b:
            bpe[(m, L)].append(float(b))
        if "batch_seconds" in r:  # a batch: its records share batch_seconds and batch_size
            batches[(m, L)].add((float(r["batch_seconds"]), int(r.get("batch_size", 0))))
    scores = {m: {t: {L: sum(v) / len(v) if (v := vals.get((m, t, L))) else math.nan for L in lengths}
                  for t in tasks} for m in methods}
    counts = {m: {t: {L: len(vals.get((m, t, L), [])) for L in lengths} for t in tasks} for m in methods}
    mean: dict[str, dict[int, float]] = {}
    n: dict[str, dict[int, int]] = {}
    for m in methods:
        mean[m], n[m] = {}, {}
        for L in lengths:
            per_task = [scores[m][t][L] for t in tasks if counts[m][t][L]]
            mean[m][L] = sum(per_task) / len(per_task) if per_task else math.nan
            n[m][L] = sum(counts[m][t][L] for t in tasks)
    seconds = {m: {L: sum(s for s, _ in batches.get((m, L), ())) for L in lengths} for m in methods}
    return {"tasks": tasks, "lengths": lengths, "methods": methods, "rope": rope, "scores": scores,
            "counts": counts, "mean": mean, "n": n, "want": len(TASK_NAMES) * samples,
            "bpe": {m: {L: sum(v) / len(v) for L in lengths if (v := bpe.get((m, L)))} for m in methods},
            "seconds": seconds}


def ruler_markdown(t: dict[str, Any]) -> str:
    """The RULER table and the GPU-seconds table as Markdown."""
    lengths, want = t["lengths"], t["want"]
    head = [_ctx(L) + (f" ({t['rope'][L].replace('yarn', 'YaRN')})" if t["rope"][L] else "") for L in lengths]
    lo, hi = lengths[0], lengths[-1]
    out = ["| method | " + " | ".join(head) + f" | BPE at {_ctx(lo)} / {_ctx(hi)} |",
           "|---|" + "---:|" * len(lengths) + "---|"]
    partial = False
    for m in t["methods"]:
        cells = []
        for L in lengths:
            v, k = t["mean"][m][L], t["n"][m][L]
            if k == 0:
                cells.append("—")
            elif k < want:
                partial = True
                cells.append(f"{v:.1f}* ({k}/{want})")
            else:
                cells.append(f"{v:.1f}")
        b = t["bpe"][m]
        bpe = " / ".join(f"{b[L]:.2f}" if L in b else "—" for L in (lo, hi))
        out.append(f"| {m} | " + " | ".join(cells) + f" | {bpe} |")
    if partial:
        out.append("")
        out.append(f"\\* partial: samples scored / {want} asked (mean over the tasks that have samples).")
    out += ["", "GPU seconds (sum of eval-ruler's `batch_seconds`: prefill and decode, no model loads):", "",
            "| method | " + " | ".join(_ctx(L) for L in lengths) + " | total |",
            "|---|" + "---:|" * (len(lengths) + 1)]
    total = 0.0
    for m in t["methods"]:
        row = [t["seconds"][m][L] for L in lengths]
        total += sum(row)
        out.append(f"| {m} | " + " | ".join(f"{s:.0f}" if s else "—" for s in row) + f" | {sum(row):.0f} |")
    out.append("| all | " + " | ".join(f"{sum(t['seconds'][m][L] for m in t['methods']):.0f}" for L in lengths)
               + f" | **{total:.0f}** |")
    return "\n".join(out)


def kl_markdown(files: list[Path]) -> str:
    """eval-kl results (one or more ``--json`` outputs) as one table: KL (top-1) per method and length."""
    metrics: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
    windows: dict[int, int] = {}
    for f in files:
        r = json.loads(f.read_text(encoding="utf-8"))
        for m, per in r["metrics"].items():
            for L, v in per.items():
                metrics[m][int(L)] = v
                windows[int(L)] = int(r["config"]["windows"])
    lengths = sorted(windows)
    methods = [m for m in ORDER if m in metrics and m != "bf16"] + sorted(set(metrics) - set(ORDER))
    out = ["| method | " + " | ".join(f"{_ctx(L)} ({windows[L]} windows)" for L in lengths) + " |",
           "|---|" + "---:|" * len(lengths)]
    for m in methods:
        out.append(f"| {m} | " + " | ".join(
            f"{metrics[m][L]['kl']:.4f} ({metrics[m][L]['top1']:.3f})" if L in metrics[m] else "—" for L in lengths
        ) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--samples", type=int, default=25, help="samples per task and length asked (partial marks)")
    ap.add_argument("--heatmap", type=Path, help="write the task x length heatmap here (PNG)")
    ap.add_argument("--title", default="Qwen2.5-Coder-1.5B-Instruct")
    a = ap.parse_args(argv)
    path = a.folder / "samples.jsonl" if a.folder.is_dir() else a.folder
    t = tables(read_records(path), a.samples)
    print(ruler_markdown(t))
    kl = sorted((a.folder if a.folder.is_dir() else a.folder.parent).glob("kl-*.json"))
    if kl:
        print()
        print(kl_markdown(kl))
    if a.heatmap:
        from oscar_cli.eval.heatmap import plot_heatmap

        yarn = sorted({r for r in t["rope"].values() if r})
        title = a.title + (f" ({', '.join(_ctx(L) for L in t['lengths'] if t['rope'][L])} under "
                           f"{', '.join(yarn).replace('yarn', 'YaRN')})" if yarn else "")
        plot_heatmap(t["scores"], t["tasks"], t["lengths"], t["methods"], a.heatmap, title, t["counts"], a.samples)
        print(f"\nheatmap: {a.heatmap}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
