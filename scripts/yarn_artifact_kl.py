"""Two OSCAR artifacts against BF16 under the same YaRN, window by window: which artifact to serve beyond a model's positions.

    PYTHONPATH=. python3 scripts/yarn_artifact_kl.py --text held-out.txt --artifact native=ART_A --artifact yarn=ART_B \\
        --ctx 12k,16k --tokens 64 --windows 6 --rope-factor 2 --out docs/results/X.json [--time-budget 3000]

The model is loaded once and switched to YaRN (:func:`oscar_cli.model.rope.yarn_for_run`, as ``oscar eval-kl``
does beyond the positions); each window of ``L + M`` tokens of the text (:func:`oscar_cli.eval.kl.cut_windows`)
is prefilled and teacher-forced through BF16 once and through each artifact's ``oscar`` method
(:func:`oscar_cli.eval.kl.method_logprobs`), so every artifact is scored on the same windows against the same
reference. An artifact calibrated without RoPE scaling is accepted the way eval-ruler/eval-kl accept it
(:func:`oscar_cli.eval.prepare.build_methods`). Per window: KL(bf16 || artifact), top-1 agreement and NLL over
the ``M`` scored positions; per length: their means over windows, and for the first two artifacts the paired
difference of KL per window (``first - second``) with its standard error (sd of the differences / sqrt(n)).
The JSON is rewritten after every window, so ``--time-budget`` (seconds; no new window starts after it) leaves
a complete record of the windows that ran, and ``--resume`` continues it (same setup, e.g. fewer lengths).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _summary(rows: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"windows": len(rows)}
    for n in names:
        out[n] = {k: round(statistics.fmean(r[n][k] for r in rows), 6) for k in ("kl", "top1", "nll")}
    if len(names) >= 2 and rows:
        d = [r[names[0]]["kl"] - r[names[1]]["kl"] for r in rows]
        se = round(statistics.stdev(d) / math.sqrt(len(d)), 6) if len(d) > 1 else None  # None: one window
        wins = sum(x < 0 for x in d)
        out["paired_kl"] = {"diff": f"{names[0]} - {names[1]}", "mean": round(statistics.fmean(d), 6),
                            "se": se, f"{names[0]}_lower_in": wins}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", required=True)
    ap.add_argument("--artifact", action="append", required=True, help="NAME=PATH (repeat; the first two are paired)")
    ap.add_argument("--ctx", default="12k,16k")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--rope-factor", type=float, default=None)
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--time-budget", type=float, default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", action="store_true", help="keep the windows --out already holds for the same setup")
    a = ap.parse_args(argv)

    from oscar_cli._options import parse_ctx_list
    from oscar_cli.environment import environment
    from oscar_cli.eval.kl import compare, cut_windows, method_logprobs
    from oscar_cli.eval.prepare import build_methods, read_text_file
    from oscar_cli.model import load_model
    from oscar_cli.model.rope import yarn_for_run

    arts = dict(s.split("=", 1) for s in a.artifact)
    names = list(arts)
    lengths = parse_ctx_list(a.ctx)
    loaded = load_model(a.model, device=a.device)
    model = loaded.model
    factor, note = yarn_for_run(model, max(lengths) + a.tokens, "yarn" if a.rope_factor else None, a.rope_factor,
                                what="--ctx + --tokens")  # fmt: skip
    notes = [note] if note else []
    methods = build_methods(["bf16"], model.config, None, None)[0]
    for n, path in arts.items():
        built, more = build_methods(["oscar"], model.config, path, None, resolved=loaded.identity.resolved)
        methods[n] = built["oscar"]
        notes += [f"{n}: {m}" for m in more]
    for m in notes:
        print(m, file=sys.stderr)
    ids = list(loaded.tokenizer(read_text_file(a.text), add_special_tokens=False)["input_ids"])
    out = Path(a.out)
    record: dict[str, Any] = {
        "config": {**vars(a), "rope_factor": factor, "artifacts": arts},
        "model": {"reference": loaded.identity.reference, "resolved": loaded.identity.resolved,
                  "dtype": str(loaded.dtype).removeprefix("torch.")},  # fmt: skip
        "notes": notes,
        "per_window": {},
        "summary": {},
        "environment": environment(),
    }
    t0 = time.perf_counter()
    stopped = False
    batches = {L: cut_windows(ids, L, a.tokens, a.windows) for L in lengths}
    rows: dict[int, list[dict[str, Any]]] = {L: [] for L in lengths}
    if a.resume and out.exists():
        same = ("model", "text", "tokens", "windows", "rope_factor", "chunk_size", "artifacts")
        before = json.loads(out.read_text())
        if any(before["config"].get(k) != record["config"].get(k) for k in same):
            raise SystemExit(f"--resume: {out} was written for another setup (one of {', '.join(same)} differs)")
        for L in lengths:
            rows[L] = before["per_window"].get(str(L), [])
            if rows[L]:
                record["summary"][str(L)] = _summary(rows[L], names)
        record["resumed_seconds"] = before.get("seconds", 0) + before.get("resumed_seconds", 0)
    record["per_window"] = {str(L): rows[L] for L in lengths}
    for w in range(a.windows):  # window by window over the lengths: a time budget leaves every length measured
        for L in lengths:
            if w < len(rows[L]):
                continue
            if a.time_budget is not None and time.perf_counter() - t0 > a.time_budget:
                stopped = True
                break
            one = batches[L][w : w + 1].to(loaded.device)
            t1 = time.perf_counter()
            ref = method_logprobs(model, methods["bf16"], one, L, a.chunk_size, "reference")
            row: dict[str, Any] = {"window": w}
            for n in names:
                row[n] = compare(ref, method_logprobs(model, methods[n], one, L, a.chunk_size, "reference"), one[:, L:])
            row["bf16_nll"] = compare(ref, ref, one[:, L:])["nll"]
            row["seconds"] = round(time.perf_counter() - t1, 1)
            rows[L].append(row)
            record["summary"][str(L)] = _summary(rows[L], names)
            record["seconds"] = round(time.perf_counter() - t0, 1)
            out.write_text(json.dumps(record, indent=1) + "\n")
            print(f"L={L} window {w}: " + ", ".join(f"{n} kl {row[n]['kl']:.4f}" for n in names)
                  + f" ({row['seconds']} s)", file=sys.stderr, flush=True)  # fmt: skip
        if stopped:
            break
    record["stopped_by_time_budget"] = stopped
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
