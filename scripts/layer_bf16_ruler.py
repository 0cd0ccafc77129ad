#!/usr/bin/env python
"""Which layers' INT2 caches cost RULER answers: one artifact, variants serving chosen layers in BF16.

    PYTHONSAFEPATH=1 python scripts/layer_bf16_ruler.py [MODEL] (--data TEXT | --artifact ART) [--tokens 24k]
        [--seq-len 8192] [--groups 0-4,5-9,...] [--split auto|none|A-B] [--task niah_multikey_2] [--ctx 2k]
        [--samples 50] [--threads 2] [--device cpu] --out DIR

1. The base artifact: ``--artifact`` as given, or calibrated here (``calibrate_model``, MODEL's recipe,
   ``--data``/``--tokens``/``--seq-len``) into ``DIR/artifacts/base``.
2. One variant artifact per layer group (``--groups``, default: groups of 5 over every layer), written with the
   library's own writer (:func:`oscar_cli.artifact.write_artifact`): the base's manifest, recipe and tensors,
   except that the group's layers get ``calibration.layers[i].scheme = "bf16"`` and the tensors
   :func:`oscar_cli.calibration.schemes.served_transform` stores for a BF16 layer (what ``oscar calibrate``
   writes when its fallback keeps a layer in BF16); ``calibration.variant`` records the layers and the base's
   digest. The writer verifies the folder, and eval-ruler's loader verifies it again.
3. RULER (:func:`oscar_cli.eval.ruler.run_ruler`, one loaded model, one task at one length, the same prompts):
   ``bf16``, the base and every variant, each in ``DIR/ruler/<name>/samples.jsonl`` (a rerun resumes).
4. ``--split auto``: when the group with the fewest chimeras removes at least ``--split-min`` of the base's
   chimeras, each of its layers alone is a further variant (``--split A-B``: that group; ``none``: no split).
5. Every wrong answer is classified with ``scripts/ruler_errors.py``'s :func:`classify` (ok / partial /
   other-needle / garbled / chimera / no-answer). ``DIR/layer_bf16_ruler.json`` gets, per variant, its BF16
   layers, score, bits per element at ``--ctx`` and at 32K (:meth:`QuantMethod.bits_per_element`, the formula
   eval-ruler reports) and the class counts; ``DIR/layer_bf16_ruler.md`` and stdout the Markdown table.

Layer groups: comma-separated; a group is ``A-B`` (inclusive), one index, or indices joined by ``+`` (``3+7``).

Example (CPU, SmolLM2-135M: ~3 min to calibrate, ~4-5 min per variant of 50 samples at 2K on 2 cores)::

    PYTHONSAFEPATH=1 .venv/bin/python scripts/layer_bf16_ruler.py smollm2-135m \\
        --data ../shared/data/corpus/austen_pride_and_prejudice.txt --device cpu --out /tmp/lbr/mk2
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

CLASSES = ("ok", "partial", "other-needle", "garbled", "chimera", "no-answer", "prompt-differs")
BPE_LONG = 32768
RESULT_FILE = "layer_bf16_ruler.json"
TABLE_FILE = "layer_bf16_ruler.md"


def log(text: str) -> None:
    print(f"layer_bf16_ruler: {text}", file=sys.stderr, flush=True)


def ruler_errors() -> ModuleType:
    """``scripts/ruler_errors.py`` as a module (scripts/ is not a package; PYTHONSAFEPATH keeps it off sys.path)."""
    path = Path(__file__).resolve().parent / "ruler_errors.py"
    spec = importlib.util.spec_from_file_location("ruler_errors", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_group(text: str) -> list[int]:
    """``"5-9"`` -> [5..9], ``"3+7"`` -> [3, 7], ``"4"`` -> [4]."""
    out: set[int] = set()
    for part in text.split("+"):
        a, sep, b = part.strip().partition("-")
        out.update(range(int(a), int(b) + 1) if sep else [int(a)])
    return sorted(out)


def group_name(layers: list[int]) -> str:
    """``bf16-L5-9`` for a contiguous range, ``bf16-L3+7`` otherwise, ``bf16-L4`` for one layer."""
    if len(layers) > 1 and layers == list(range(layers[0], layers[-1] + 1)):
        return f"bf16-L{layers[0]}-{layers[-1]}"
    return "bf16-L" + "+".join(map(str, layers))


def default_groups(n_layers: int, size: int = 5) -> list[list[int]]:
    return [list(range(i, min(i + size, n_layers))) for i in range(0, n_layers, size)]


def make_variant(base_path: Path, bf16_layers: list[int], out: Path) -> Path:
    """Write the base artifact with ``bf16_layers`` served as ``bf16`` (module docstring, step 2) to ``out``.

    An existing ``out`` made from the same base and layers is kept; any other is replaced."""
    from oscar_cli.artifact import load_artifact, write_artifact
    from oscar_cli.artifact.manifest import RECIPE_NAME
    from oscar_cli.calibration.schemes import scheme_bpe, served_transform
    from oscar_cli.errors import ArtifactError
    from oscar_cli.quant.methods import artifact_schemes
    from oscar_cli.recipe import recipe_from_dict

    base = load_artifact(base_path)
    m = base.manifest
    tag = {"bf16_layers": bf16_layers, "base_digest": m.digest, "by": "scripts/layer_bf16_ruler.py"}
    if out.exists():
        try:
            if load_artifact(out).manifest.calibration.get("variant") == tag:
                return out
        except ArtifactError:
            pass
    n, d = m.num_layers, m.head_dim
    bad = [i for i in bf16_layers if not 0 <= i < n]
    if bad:
        raise SystemExit(f"layer {bad[0]} is not one of the model's {n} layers")
    schemes = artifact_schemes(m.calibration, n, str(base_path))
    new_schemes = ["bf16" if i in bf16_layers else s for i, s in enumerate(schemes)]
    layers = [served_transform("bf16", t, d) if i in bf16_layers and s != "bf16" else t
              for i, (t, s) in enumerate(zip(base.layers, schemes, strict=True))]
    rows = m.calibration.get("layers") or [{"index": i, "scheme": s, "reason": "", "errors": {}}
                                           for i, s in enumerate(schemes)]
    rows = [{**row, "scheme": "bf16", "reason": f"forced BF16 by {tag['by']}"} if i in bf16_layers else row
            for i, row in enumerate(rows)]
    cal: dict[str, Any] = {**m.calibration, "layers": rows, "variant": tag}
    if isinstance(cal.get("schemes"), dict):  # keep the fallback summary consistent with the layers
        bpe = scheme_bpe(recipe_from_dict(m.recipe), d)
        s = dict(cal["schemes"])
        s["fixed_layers"] = [i for i, x in enumerate(new_schemes) if x != "oscar"]
        s["bits_per_element"] = {**s.get("bits_per_element", {}), "artifact": round(bpe(new_schemes), 4)}
        errors = [row.get("errors", {}).get(x) for row, x in zip(rows, new_schemes, strict=True)]
        if all(isinstance(e, float | int) for e in errors):  # held-out error of the schemes now served
            s["artifact_error"] = round(sum(errors) / len(errors), 6)
        cal["schemes"] = s
    recipe_yaml = (base_path / RECIPE_NAME).read_text(encoding="utf-8")
    write_artifact(out, replace(m, calibration=cal), layers, recipe_yaml, overwrite=out.exists())
    return out


def classify_records(records: list[dict[str, Any]], texts: dict[int, tuple[str, int]], re_mod: ModuleType) -> Counter[str]:
    """Class counts of one variant's records (``texts``: sample index -> (prompt text, prompt tokens))."""
    counts: Counter[str] = Counter()
    for r in records:
        text, n_ids = texts[int(r["index"])]
        if int(r.get("prompt_tokens", n_ids)) != n_ids:
            counts["prompt-differs"] += 1
        elif float(r["score"]) >= 100:
            counts["ok"] += 1
        else:
            kind, _ = re_mod.classify(r["pred"], list(r["answers"]), text, re_mod.value_pattern(r["task"]))
            counts[kind] += 1
    return counts


def markdown(rows: list[dict[str, Any]], ctx_label: str, task: str) -> str:
    head = (f"| variant (layers in BF16) | BPE {ctx_label} | BPE 32k | {task} @ {ctx_label} score | "
            + " | ".join(CLASSES[:-1]) + " |")
    lines = [head, "|---|" + "---:|" * (3 + len(CLASSES) - 1)]
    for r in rows:
        layers = "all (bf16 method)" if r["method"] == "bf16" else (
            ",".join(map(str, r["bf16_layers"])) or "none (all INT2)")
        c = r["classes"]
        lines.append(f"| {r['name']}: {layers} | {r['bpe_ctx']:.3f} | {r['bpe_32k']:.3f} | {r['score']:.1f} | "
                     + " | ".join(str(c.get(k, 0)) for k in CLASSES[:-1]) + " |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("model", nargs="?", default="smollm2-135m")
    p.add_argument("--artifact", help="the base artifact (default: calibrate one into OUT/artifacts/base)")
    p.add_argument("--data", help="calibration text (file or folder) when no --artifact is given")
    p.add_argument("--tokens", help="calibration token budget (default: the recipe's)")
    p.add_argument("--seq-len", type=int, help="calibration sequence length (default: the recipe's)")
    p.add_argument("--groups", default="", help="layer groups, e.g. 0-4,5-9 or 3+7,12 (default: groups of 5)")
    p.add_argument("--split", default="auto", help="auto | none | A-B: single-layer variants of that group")
    p.add_argument("--split-min", type=float, default=0.5,
                   help="auto split: the best group must remove at least this share of the base's chimeras")
    p.add_argument("--task", default="niah_multikey_2")
    p.add_argument("--ctx", default="2k")
    p.add_argument("--samples", type=int, default=50)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--no-bf16", action="store_true", help="skip the bf16 reference row")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--out", required=True, help="folder: artifacts/, ruler/, layer_bf16_ruler.json/.md")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from oscar_cli._files import atomic_write_json
    from oscar_cli._options import format_ctx, parse_ctx
    from oscar_cli.artifact import model_slug
    from oscar_cli.eval.niah import parse_tasks
    from oscar_cli.eval.ruler import SAMPLES_FILE, RulerConfig, build_samples, read_records, run_ruler
    from oscar_cli.model import load_model
    from oscar_cli.quant.methods import oscar_from_artifact

    task = parse_tasks(args.task)[0]
    length = parse_ctx(args.ctx)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    re_mod = ruler_errors()
    t_start = time.perf_counter()
    log(f"loading {args.model}")
    loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    n_layers, head_dim = loaded.geometry.num_layers, loaded.geometry.head_dim

    calib: dict[str, Any] = {}
    if args.artifact:
        base_path = Path(args.artifact)
    else:
        from oscar_cli.calibration.run import calibrate_model, check_model
        from oscar_cli.recipe import load_recipe, recipe_for_model

        if not args.data:
            raise SystemExit("give --artifact or --data (calibration text)")
        base_path = out / "artifacts" / "base"
        over: dict[str, Any] = {"data": {"source": args.data}}
        if args.tokens:
            over["data"]["tokens"] = parse_ctx(args.tokens)
        if args.seq_len:
            over["data"]["seq_len"] = args.seq_len
        recipe = load_recipe(recipe_for_model(model_slug(args.model)), over)
        calib = {"recipe": recipe.name, "data": args.data, "tokens": recipe.data.tokens, "seq_len": recipe.data.seq_len}
        if not (base_path / "manifest.json").exists():
            t0 = time.perf_counter()
            log(f"calibrating {args.model} ({recipe.name}, {recipe.data.tokens} tokens x {recipe.data.seq_len})")
            calibrate_model(loaded.model, loaded.tokenizer, recipe, reference=loaded.identity.reference,
                            resolved=loaded.identity.resolved, out=base_path,
                            geometry=check_model(loaded.model.config, recipe))
            calib["seconds"] = round(time.perf_counter() - t0, 1)

    from oscar_cli.artifact import load_artifact

    bm = load_artifact(base_path).manifest
    calib.update({"base_digest": bm.digest, "base_recipe": bm.recipe.get("name"), "base_data": bm.data,
                  "base_clip_errors": [round(float(c["error"]), 6) if c.get("error") is not None else None
                                       for c in bm.calibration.get("clip", {}).get("layers", [])]})

    # the prompts, rebuilt once for the classifier (ruler_errors' way: same generator, seed and tokenizer)
    pcfg = RulerConfig(lengths=[length], tasks=[task], methods=[], samples=args.samples, seed=args.seed)
    texts = {s.index: (s.text, len(ids)) for s, ids in build_samples(pcfg, loaded.tokenizer)[(task, length)]}

    rows: list[dict[str, Any]] = []
    result_path = out / RESULT_FILE

    def run(name: str, method: str, bf16_layers: list[int], artifact: Path | None) -> dict[str, Any]:
        t0 = time.perf_counter()
        where = out / "ruler" / name
        cfg = RulerConfig(lengths=[length], tasks=[task], methods=[method], samples=args.samples,
                          model=loaded.identity.reference, artifact=str(artifact) if artifact else None,
                          out=str(where), auto_rope=False, seed=args.seed, device=args.device, dtype=args.dtype)
        res = run_ruler(cfg, loaded)
        source = res.config.get("artifact")
        meth = oscar_from_artifact(str(artifact), loaded.model.config) if artifact else None
        records = [r for r in read_records(where / SAMPLES_FILE)
                   if r["method"] == method and r["task"] == task and int(r["length"]) == length
                   and int(r["index"]) < args.samples
                   and (meth is None or r.get("method_source") == meth.source)]
        counts = classify_records(records, texts, re_mod)
        row: dict[str, Any] = {"name": name, "method": method, "bf16_layers": bf16_layers, "artifact": source,
               "score": res.scores[method][task][length], "n": res.counts[method][task][length],
               "bpe_ctx": res.bpe[method][length]["formula"],
               "bpe_32k": round(meth.bits_per_element(BPE_LONG, head_dim), 4) if meth else 16.0,
               "classes": {k: counts.get(k, 0) for k in CLASSES}, "seconds": round(time.perf_counter() - t0, 1),
               "resumed": res.resumed,
               # generation time of the records, whichever run made them (each record holds its batch's time)
               "generate_seconds": round(sum(float(r["batch_seconds"]) / int(r["batch_size"]) for r in records), 1)}
        rows.append(row)
        c = row["classes"]
        log(f"{name}: score {row['score']:.1f}, chimera {c['chimera']}, other-needle {c['other-needle']}, "
            f"garbled {c['garbled']} ({row['seconds']:.0f} s)")
        save()
        return row

    def save() -> None:
        atomic_write_json(result_path, {
            "model": {"reference": loaded.identity.reference, "resolved": loaded.identity.resolved,
                      "dtype": str(loaded.dtype).removeprefix("torch.")},
            "base_artifact": str(base_path), "calibration": calib, "task": task, "length": length,
            "samples": args.samples, "seed": args.seed, "threads": args.threads, "bpe_long_context": BPE_LONG,
            "classifier": "scripts/ruler_errors.py classify", "rows": rows,
            "seconds": round(time.perf_counter() - t_start, 1)})

    if not args.no_bf16:
        run("bf16", "bf16", list(range(n_layers)), None)
    base = run("base", "oscar", [], base_path)
    groups = [parse_group(g) for g in args.groups.split(",") if g.strip()] or default_groups(n_layers)
    group_rows = []
    for g in groups:
        name = group_name(g)
        art = make_variant(base_path, g, out / "artifacts" / name)
        group_rows.append(run(name, "oscar", g, art))

    split: list[int] | None = None
    if args.split not in ("auto", "none"):
        split = parse_group(args.split)
    elif args.split == "auto" and group_rows:
        best = min(group_rows, key=lambda r: (r["classes"]["chimera"], -r["score"]))
        removed = base["classes"]["chimera"] - best["classes"]["chimera"]
        if base["classes"]["chimera"] and removed >= args.split_min * base["classes"]["chimera"]:
            split = best["bf16_layers"]
            log(f"splitting {best['name']}: it removes {removed} of the base's {base['classes']['chimera']} chimeras")
        else:
            log(f"no split: the best group ({best['name']}) removes {removed} of the base's "
                f"{base['classes']['chimera']} chimeras (< {args.split_min:g})")
    if split and len(split) > 1:
        for layer in split:
            name = group_name([layer])
            run(name, "oscar", [layer], make_variant(base_path, [layer], out / "artifacts" / name))

    table = markdown(rows, format_ctx(length), task)
    (out / TABLE_FILE).write_text(table + "\n", encoding="utf-8")
    print(table)
    log(f"done in {time.perf_counter() - t_start:.0f} s: {result_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
