"""An ablation: calibrate one artifact per recipe variant, evaluate every one on the same prompts, tabulate.

For a loaded model, a base recipe and variants that each change one lever (:mod:`oscar_cli.eval.variants`),
:func:`run_ablation` calibrates the base and every variant in turn (:func:`~oscar_cli.calibration.run.
calibrate_model`, same data and seed), then evaluates each artifact on the same held-out text with the
eval-kl protocol (:mod:`oscar_cli.eval.kl`: the same windows, teacher-forced decode steps against bf16, which
is computed once per length) and, optionally, on the same RULER NIAH prompts (:func:`~oscar_cli.eval.ruler.
run_ruler`, fixed tasks, samples, seeds and haystack). Reference methods that need no artifact (``kivi-2``) get a row
on the same prompts.

Everything lands in ``OUT/ablation.json`` after each step (atomic): the rows, their recipes, bits per
element (sink, recent, metadata and per-layer fallbacks counted, :meth:`~oscar_cli.quant.QuantMethod.
bits_per_element`), calibration and evaluation seconds. A rerun with the same ``OUT`` skips finished rows
(a calibrated-but-unevaluated row keeps its artifact) and refuses when the model, base recipe or evaluation
settings differ from the stored ones. :func:`markdown_table` prints one row per variant with deltas vs base.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from oscar_cli.errors import EvalError
from oscar_cli.eval.variants import Variant, format_change, recipe_diff, safe_name
from oscar_cli.recipe import Recipe

FORMAT = "oscar-ablation/1"
STATE_FILE = "ablation.json"
BPE_CONTEXT = 32768
Log = Callable[[str], None]


@dataclass
class AblationConfig:
    """The evaluation every row shares (lengths in tokens)."""

    text: str  # held-out prose for eval-kl (never the calibration data)
    ctx: list[int]
    out: str
    kl_tokens: int = 64
    windows: int = 4
    chunk_size: int = 4096
    backend: str = "auto"
    references: list[str] = field(default_factory=lambda: ["kivi-2"])
    ruler_ctx: list[int] = field(default_factory=list)  # empty: no RULER
    ruler_tasks: list[str] = field(default_factory=list)
    ruler_samples: int = 0
    ruler_seeds: list[int] = field(default_factory=lambda: [42])  # one prompt set per seed, same samples each
    ruler_haystack_dir: str | None = None  # None: the shipped haystack
    budget_s: float | None = None  # no new row starts when the estimate says it would end after this

    def eval_key(self, text_sha: str, haystack: str = "") -> dict[str, Any]:
        """What must match for stored rows to be comparable with new ones (``haystack``: the essay haystack's
        digest when ``ruler_haystack_dir`` is set). One seed is stored as ``ruler_seed``, the key's form before
        several seeds and another haystack were possible, so earlier state files still resume."""
        keep = ("ctx", "kl_tokens", "windows", "chunk_size", "backend", "ruler_ctx", "ruler_tasks", "ruler_samples")
        key: dict[str, Any] = {"text_sha256": text_sha, **{k: v for k, v in asdict(self).items() if k in keep}}
        if len(self.ruler_seeds) == 1:
            key["ruler_seed"] = self.ruler_seeds[0]
        else:
            key["ruler_seeds"] = list(self.ruler_seeds)
        if haystack:
            key["ruler_haystack"] = haystack
        return key


def check_held_out(text: str, source: str) -> None:
    """Refuse an evaluation text that is (or lies inside) the calibration data: it would not be held out."""
    t = Path(text).expanduser().resolve()
    if source in ("self", "random") or source.startswith("hf:"):
        return
    s = Path(source).expanduser().resolve()
    if t == s or s in t.parents:
        raise EvalError(f"--text {text} is part of the calibration data {source}: the evaluation would not be held out",
                        hint="evaluate on a file that is not in the calibration data")


class _State:
    """``OUT/ablation.json``: loaded, checked against this run, saved after every step."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        from oscar_cli._files import atomic_write_json

        self.path, self._write = path, atomic_write_json
        self.data: dict[str, Any] = {**header, "rows": {}, "references": {}}
        if path.exists():
            import json

            try:
                stored = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise EvalError(f"{path} is not an ablation state file ({exc})", hint="use another --out") from None
            for key in ("format", "model", "base_recipe", "eval"):
                if stored.get(key) != header[key]:
                    raise EvalError(f"{path} was made with a different {key.replace('_', ' ')}: its rows would not "
                                    "compare with this run's", hint="use another --out, or delete the file")
            self.data["rows"] = stored.get("rows", {})
            self.data["references"] = stored.get("references", {})

    def save(self) -> None:
        self._write(self.path, self.data)


def _bpe(method: Any, lengths: list[int], head_dim: int) -> dict[str, float]:
    return {str(L): round(method.bits_per_element(L, head_dim), 4) for L in sorted({*lengths, BPE_CONTEXT})}


class _Evaluator:
    """The shared evaluation: windows cut once, bf16 log-probs computed once per length (on first use)."""

    def __init__(self, loaded: Any, cfg: AblationConfig, ids: list[int], log: Log) -> None:
        from oscar_cli.eval.kl import cut_windows

        self.loaded, self.cfg, self.log = loaded, cfg, log
        self.batches = {L: cut_windows(ids, L, cfg.kl_tokens, cfg.windows) for L in cfg.ctx}
        self._ref: dict[int, torch.Tensor] = {}

    def _reference(self, length: int) -> torch.Tensor:
        from oscar_cli.eval.kl import method_logprobs
        from oscar_cli.quant.methods import bf16_method

        if length not in self._ref:
            t0 = time.perf_counter()
            batch = self.batches[length].to(self.loaded.device)
            self._ref[length] = method_logprobs(self.loaded.model, bf16_method(), batch, length, self.cfg.chunk_size,
                                                self.cfg.backend)
            self.log(f"bf16 reference at {length}: {time.perf_counter() - t0:.1f} s")
        return self._ref[length]

    def kl(self, method: Any) -> dict[str, dict[str, Any]]:
        from oscar_cli.eval.kl import compare, method_logprobs

        out = {}
        for length, cpu_batch in self.batches.items():
            ref = self._reference(length)
            batch = cpu_batch.to(self.loaded.device)
            lp = method_logprobs(self.loaded.model, method, batch, length, self.cfg.chunk_size, self.cfg.backend)
            per_window = (ref.exp() * (ref - lp)).sum(-1).mean(-1)  # the paired deltas' spread is over these
            out[str(length)] = {**compare(ref, lp, batch[:, length:]),
                                "kl_windows": [round(float(x), 6) for x in per_window]}
        return out

    def ruler(self, method_name: str, artifact: str | None, where: Path) -> dict[str, float]:
        from oscar_cli.eval.ruler import RulerConfig, run_ruler

        cfg = self.cfg
        per_seed = []
        for seed in cfg.ruler_seeds:  # the same --out: records carry their seed, so each set resumes its own
            rc = RulerConfig(lengths=cfg.ruler_ctx, tasks=cfg.ruler_tasks, methods=[method_name],
                             samples=cfg.ruler_samples, artifact=artifact, out=str(where), auto_rope=False,
                             chunk_size=cfg.chunk_size, seed=seed, haystack_dir=cfg.ruler_haystack_dir,
                             backend=cfg.backend, model=self.loaded.identity.reference)
            per_seed.append(run_ruler(rc, self.loaded).mean[method_name])
        # every seed scores the same tasks x samples, so the mean over all prompts is the mean of the seeds' means
        return {str(L): round(sum(m[L] for m in per_seed) / len(per_seed), 2) for L in per_seed[0]}


def _calibrate(loaded: Any, variant: Variant, path: Path, log: Log) -> dict[str, Any]:
    from oscar_cli.calibration.run import calibrate_model, check_model

    finished: set[str] = set()

    def report(phase: str, done: int, total: int) -> None:
        if done == total and phase not in finished:
            finished.add(phase)
            log(f"  {variant.name}: {phase} done ({time.perf_counter() - t0:.1f} s)")

    t0 = time.perf_counter()
    geo = check_model(loaded.model.config, variant.recipe)
    res = calibrate_model(loaded.model, loaded.tokenizer, variant.recipe, reference=loaded.identity.reference,
                          resolved=loaded.identity.resolved, out=path, overwrite=True, report=report, geometry=geo)
    schemes = res.schemes.to_dict() if res.schemes else None
    errors = [s.clip_error for s in res.layers if s.clip_error is not None]
    return {
        "artifact": str(path),
        "calibration_s": round(time.perf_counter() - t0, 2),
        "timings_s": {k: round(v, 2) for k, v in res.timings.items()},
        "statistics_tokens": res.manifest.calibration.get("statistics_tokens"),
        "holdout_tokens": res.manifest.calibration.get("holdout_tokens"),
        "holdout_error": schemes["artifact_error"] if schemes else (sum(errors) / len(errors) if errors else None),
        "fixed_layers": schemes["fixed_layers"] if schemes else [],
    }


def run_ablation(loaded: Any, base: Recipe, variants: list[Variant], cfg: AblationConfig,
                 log: Log = lambda _: None) -> dict[str, Any]:
    """Calibrate and evaluate ``base`` and each of ``variants`` (module docstring); returns the state dict."""
    from oscar_cli.eval.prepare import build_methods, read_text_file

    names = ["base"] + [v.name for v in variants]
    if len(set(names)) != len(names):
        raise EvalError(f"variant names must be distinct (and not 'base'): {', '.join(names[1:])}")
    for recipe in [base, *(v.recipe for v in variants)]:
        check_held_out(cfg.text, recipe.data.source)
    text = read_text_file(cfg.text)
    ids = list(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])
    native = int(getattr(loaded.model.config, "max_position_embeddings", 0) or 0)
    longest = max([L + cfg.kl_tokens for L in cfg.ctx] + cfg.ruler_ctx)
    if native and longest > native:
        raise EvalError(f"context {longest} is beyond the model's {native} positions (an ablation runs without YaRN)")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    header = {"format": FORMAT, "model": {"reference": loaded.identity.reference,
                                          "resolved": loaded.identity.resolved,
                                          "dtype": str(loaded.dtype).removeprefix("torch.")},
              "base_recipe": base.to_dict(),
              "eval": cfg.eval_key(hashlib.sha256(text.encode()).hexdigest(), _haystack(cfg))}
    state = _State(out / STATE_FILE, header)
    state.data["order"] = names  # the table lists this run's rows (a stored row not asked for stays in the file)
    state.data["reference_order"] = list(cfg.references)
    evaluator = _Evaluator(loaded, cfg, ids, log)  # checks every length's windows fit before any work
    head_dim = loaded.geometry.head_dim
    base_variant = Variant("base", "base", {}, base)
    todo = [v for v in [base_variant, *variants] if state.data["rows"].get(v.name, {}).get("status") != "done"
            or state.data["rows"][v.name].get("recipe") != v.recipe.to_dict()]
    refs = [r for r in cfg.references if r not in state.data["references"]]
    log(f"{len(names)} rows ({len(names) - len(todo)} already in {state.path}) and {len(cfg.references)} reference "
        f"methods; eval-kl at {', '.join(map(str, cfg.ctx))} on {cfg.windows} windows x {cfg.kl_tokens} tokens"
        + (f", RULER {len(cfg.ruler_tasks)} tasks x {cfg.ruler_samples} at {cfg.ruler_ctx}" if cfg.ruler_ctx else ""))
    t_run, costs = time.perf_counter(), list[float]()

    def over_budget(left: list[str]) -> bool:
        spent = time.perf_counter() - t_run
        if cfg.budget_s is None or not costs or spent + sum(costs) / len(costs) <= cfg.budget_s:
            return False
        log(f"budget: {spent:.0f} s spent, a row takes ~{sum(costs) / len(costs):.0f} s; stopping before "
            f"{', '.join(left)} (rerun with the same --out to continue)")
        return True

    for i, variant in enumerate(todo):
        if over_budget([v.name for v in todo[i:]] + refs):
            return state.data
        t0 = time.perf_counter()
        row = _run_row(loaded, variant, base, state, evaluator, cfg, head_dim, out, log)
        costs.append(time.perf_counter() - t0)
        left = len(todo) - i - 1
        log(f"[{i + 1}/{len(todo)}] {variant.name}: calibrate {row['calibration_s']:.1f} s, eval {row['eval_s']:.1f} s; "
            + ", ".join(f"KL@{L} {m['kl']:.4f}" for L, m in row["kl"].items())
            + (f"; ~{left * sum(costs) / len(costs):.0f} s left" if left else ""))
    for j, name in enumerate(refs):
        if over_budget(refs[j:]):
            break
        t0 = time.perf_counter()
        methods, _ = build_methods([name], loaded.model.config, None, None)
        ref_row: dict[str, Any] = {"bpe": _bpe(methods[name], cfg.ctx, head_dim), "kl": evaluator.kl(methods[name])}
        if cfg.ruler_ctx:
            ref_row["ruler"] = evaluator.ruler(name, None, out / "ruler" / safe_name(name))
        ref_row["eval_s"] = round(time.perf_counter() - t0, 2)
        state.data["references"][name] = ref_row
        state.save()
        costs.append(ref_row["eval_s"])
        log(f"reference {name}: eval {ref_row['eval_s']:.1f} s")
    return state.data


def _haystack(cfg: AblationConfig) -> str:
    """The digest of ``cfg.ruler_haystack_dir``'s essay haystack ("" when unset or without RULER)."""
    if not cfg.ruler_ctx or cfg.ruler_haystack_dir is None:
        return ""
    from oscar_cli.eval.niah import essay_digest, load_essay_words

    return essay_digest(load_essay_words(cfg.ruler_haystack_dir))


def _run_row(loaded: Any, variant: Variant, base: Recipe, state: _State, evaluator: _Evaluator,
             cfg: AblationConfig, head_dim: int, out: Path, log: Log) -> dict[str, Any]:
    from oscar_cli.eval.prepare import build_methods

    rows = state.data["rows"]
    row = rows.get(variant.name, {})
    path = out / "artifacts" / safe_name(variant.name)
    if row.get("recipe") != variant.recipe.to_dict() or not Path(row.get("artifact", "")).is_dir():
        log(f"{variant.name}: calibrating ({format_change(recipe_diff(base.to_dict(), variant.recipe.to_dict()))})")
        row = {"spec": variant.spec, "recipe": variant.recipe.to_dict(),
               "change": {k: list(v) for k, v in recipe_diff(base.to_dict(), variant.recipe.to_dict()).items()},
               **_calibrate(loaded, variant, path, log), "status": "calibrated"}
        rows[variant.name] = row
        state.save()
    t0 = time.perf_counter()
    methods, _ = build_methods(["oscar"], loaded.model.config, row["artifact"], None,
                               resolved=loaded.identity.resolved)
    row["bpe"] = _bpe(methods["oscar"], cfg.ctx, head_dim)
    row["kl"] = evaluator.kl(methods["oscar"])
    if cfg.ruler_ctx:
        row["ruler"] = evaluator.ruler("oscar", row["artifact"], out / "ruler" / safe_name(variant.name))
    row["eval_s"] = round(time.perf_counter() - t0, 2)
    row["status"] = "done"
    state.save()
    return row


def _delta(value: float | None, base: float | None, fmt: str) -> str:
    """``value`` and, against a base, its difference (``fmt``: a format spec such as ``.4g``)."""
    if value is None:
        return "—"
    if base is None:
        return format(value, fmt)
    return f"{format(value, fmt)} ({format(value - base, '+' + fmt)})"


def _paired_se(row: dict[str, Any], base: dict[str, Any] | None, length: str) -> str:
    """`` ± SE`` of the KL delta vs base over the shared windows (paired: the same text), or nothing."""
    a = row.get("kl", {}).get(length, {}).get("kl_windows")
    b = (base or {}).get("kl", {}).get(length, {}).get("kl_windows")
    if not a or not b or len(a) != len(b) or len(a) < 2:
        return ""
    d = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    return f" ± {float(d.std() / len(a) ** 0.5):.2g}"


def markdown_table(state: dict[str, Any]) -> str:
    """One row per variant (base first, then references), KL / top-1 / RULER with the delta vs base (KL: ± the
    standard error of the paired per-window differences, the windows being the same text for every row)."""
    ev = state["eval"]
    ctx = [str(L) for L in ev["ctx"]]
    rctx = [str(L) for L in ev.get("ruler_ctx") or []]
    head = (["variant", "change vs base", f"BPE @{BPE_CONTEXT // 1024}K", "calib s", "held-out err"]
            + [f"KL @{L}" for L in ctx] + [f"top-1 @{L}" for L in ctx] + [f"RULER @{L}" for L in rctx] + ["eval s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
    rows = state["rows"]
    base = rows.get("base", {})
    order = state.get("order") or ["base"] + [n for n in rows if n != "base"]

    def metric(row: dict[str, Any], kind: str, L: str, key: str) -> float | None:
        return row.get(kind, {}).get(L, {}).get(key) if kind == "kl" else row.get(kind, {}).get(L)

    def cells(row: dict[str, Any], is_base: bool) -> list[str]:
        ref = None if is_base else base
        kl = [_delta(metric(row, "kl", L, "kl"), ref and metric(ref, "kl", L, "kl"), ".3g")
              + _paired_se(row, ref, L) for L in ctx]
        top = [_delta(metric(row, "kl", L, "top1"), ref and metric(ref, "kl", L, "top1"), ".3f") for L in ctx]
        rul = [_delta(metric(row, "ruler", L, ""), ref and metric(ref, "ruler", L, ""), ".1f") for L in rctx]
        return kl + top + rul

    for name in order:
        if name not in rows:
            continue
        row = rows[name]
        change = format_change({k: tuple(v) for k, v in row.get("change", {}).items()})
        if row.get("status") != "done":
            change += " (not evaluated)"
        bpe = row.get("bpe", {}).get(str(BPE_CONTEXT))
        err = row.get("holdout_error")
        lines.append("| " + " | ".join([name, change, "—" if bpe is None else f"{bpe:.3f}",
                                         f"{row.get('calibration_s', 0):.1f}", "—" if err is None else f"{err:.4f}",
                                         *cells(row, name == "base"), f"{row.get('eval_s', 0):.1f}"]) + " |")
    refs = state.get("references", {})
    for name in state.get("reference_order", list(refs)):
        if name not in refs:
            continue
        row = refs[name]
        bpe = row["bpe"].get(str(BPE_CONTEXT))
        lines.append("| " + " | ".join([name, "reference method", f"{bpe:.3f}", "—", "—", *cells(row, False),
                                         f"{row.get('eval_s', 0):.1f}"]) + " |")
    return "\n".join(lines)
