"""``calibrate``: model → data → capture → solve → clip search → artifact (the library behind ``oscar calibrate``).

Phases and what they produce:

1. **data**: ``data.tokens`` tokens as ``[N, seq_len]`` sequences; the last ``ceil(holdout_tokens/seq_len)`` are
   held out of the statistics for the clip search.
2. **capture**: one unpadded forward per batch through :func:`capture.capture_attention`; per-layer streaming
   statistics (:mod:`covariance`), then the held-out q/k/v (:class:`capture.HoldoutStore`).
3. **solve**: per layer (or per KV head) targets → ``R = U·H·P`` (:mod:`rotation`), rotated means; with
   ``statistics.v_metric`` the value target is first weighed by ``o_proj`` (:mod:`wo_metric`).
4. **clip**: per-layer ratio search on the held-out tokens (:mod:`clipping`), or the global ratios; then each
   layer is scored against simple schemes on the same tokens and a failed layer is served by one of them
   (:mod:`schemes`; ``manifest.calibration.layers[i].scheme``), with a warning (``strict``: an error) when the
   artifact is worse than the KIVI baseline.
5. **write**: the artifact, atomically (:func:`oscar_cli.artifact.write_artifact`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from oscar_cli.artifact import Manifest, build_manifest, check_output, model_slug, write_artifact
from oscar_cli.artifact.card import bpe_table
from oscar_cli.calibration.capture import HoldoutStore, capture_attention, run_forward
from oscar_cli.calibration.clipping import (
    ClipChoice,
    LayerClipProblem,
    evaluate_clip,
    search_clip,
)
from oscar_cli.calibration.copy_score import COPY_QUERIES, CopyScore, choose_key_layers, copy_flips, served_keys
from oscar_cli.calibration.covariance import LayerStatistics, reservoir_plan
from oscar_cli.calibration.data import CalibrationData, check_source, prepare_data
from oscar_cli.calibration.rotation import build_rotations, is_power_of_two, orthogonality_error
from oscar_cli.calibration.schemes import (
    BPE_CONTEXT,
    LayerScheme,
    SchemeReport,
    check_fallback,
    choose_schemes,
    scheme_bpe,
    score_layer,
    served_transform,
)
from oscar_cli.calibration.wo_metric import model_output_metrics, wo_target
from oscar_cli.errors import CalibrationError
from oscar_cli.model.geometry import ModelGeometry
from oscar_cli.quant.key_mean import RopeTable, position_means, pre_rope_mean
from oscar_cli.quant.key_subspace import subspace_basis
from oscar_cli.recipe import Recipe, check_layout
from oscar_cli.transform import LayerTransform

logger = logging.getLogger(__name__)

PHASES = ("data", "capture", "solve", "clip", "write")
# (phase, completed, total) — the CLI draws progress bars from it; the library default ignores it.
Progress = Callable[[str, int, int], None]


@dataclass
class LayerSummary:
    """Per-layer numbers for the summary table and the manifest."""

    index: int
    k_spread: float  # λ_max / λ_mean of the key target (1 = isotropic)
    v_spread: float
    k_clip: float
    v_clip: float
    clip_error: float | None  # held-out relative output error at the chosen clips (None: not evaluated)
    scheme: str = "oscar"  # how the artifact serves the layer (calibration.schemes)
    scheme_errors: dict[str, float] = field(default_factory=dict)  # held-out error per scheme (empty: not scored)
    copy_score: float | None = None  # flips of focused heads per (query, head) row (calibration.copy_score)


@dataclass
class CalibrationResult:
    """What ``calibrate`` returns (``--json`` prints ``to_dict()``)."""

    artifact_path: Path
    manifest: Manifest
    layers: list[LayerSummary]
    timings: dict[str, float]
    data: dict[str, Any]
    generation_tokens_per_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    schemes: SchemeReport | None = None  # the per-layer fallback (None: layers not scored)

    def to_dict(self) -> dict[str, Any]:
        return {
            "artifact": str(self.artifact_path),
            "model": self.manifest.model,
            "method": self.manifest.method,
            "recipe": self.manifest.recipe.get("name"),
            "data": self.data,
            "generation_tokens_per_s": round(self.generation_tokens_per_s, 1),
            "timings_s": {k: round(v, 3) for k, v in self.timings.items()},
            "layers": [vars(s) for s in self.layers],
            "schemes": self.schemes.to_dict() if self.schemes else None,
            "bf16_keys": self.manifest.calibration.get("bf16_keys"),
            "int4_keys": self.manifest.calibration.get("int4_keys"),
        }


def _noop(phase: str, done: int, total: int) -> None:
    return None


def plan_budget(recipe: Recipe, head_dim: int) -> tuple[int, int]:
    """``(statistics sequences, held-out sequences)`` for the recipe; CalibrationError when too small."""
    d, c, q = recipe.data, recipe.clip, recipe.quant
    n_seq = d.tokens // d.seq_len
    hold = math.ceil(c.holdout_tokens / d.seq_len) if c.holdout_tokens > 0 else 0
    if c.mode == "search" and hold == 0:
        raise CalibrationError(
            "clip.mode search needs held-out tokens: set clip.holdout_tokens > 0", hint="or use clip.mode: global"
        )
    min_stats = max(4 * head_dim, 256)
    stats = n_seq - hold
    if stats < 1 or stats * d.seq_len < min_stats:
        raise CalibrationError(
            f"token budget {d.tokens} is too small: the statistics need at least {min_stats} tokens "
            f"(whole sequences of {d.seq_len}) besides {hold * d.seq_len} held-out tokens",
            hint=f"raise --tokens to at least {(math.ceil(min_stats / d.seq_len) + hold) * d.seq_len} "
            "or lower --seq-len (recipe data.seq_len)",
        )
    if hold and c.mode == "search" and d.seq_len <= q.sink + q.recent:
        raise CalibrationError(
            f"held-out sequences of {d.seq_len} tokens are no longer than sink + recent "
            f"({q.sink} + {q.recent}): nothing would be INT2 in the clip search",
            hint="raise --seq-len (recipe data.seq_len), or use clip.mode: global",
        )
    return stats, hold


def check_model(config: Any, recipe: Recipe) -> ModelGeometry:
    """Supported architecture and a head_dim the recipe's rotation can handle (before any work).

    ``config``: a transformers config or its :class:`ModelGeometry`. Returns the geometry.
    """
    geo = ModelGeometry.of(config)
    geo.check()
    d = geo.head_dim
    needs_pow2 = recipe.method == "hadamard" or (recipe.method == "oscar" and recipe.rotation.composition != "plain")
    if needs_pow2 and not is_power_of_two(d):
        raise CalibrationError(
            f"head_dim {d} is not a power of two: the Hadamard/bit-reversal factors of "
            f"{recipe.method} ({recipe.rotation.composition}) need a power-of-two size",
            hint="use a recipe with method: identity or rotation.composition: plain",
        )
    check_layout(recipe.quant, d)
    return geo


def _capture(
    model: Any,
    geo: ModelGeometry,
    data: CalibrationData,
    recipe: Recipe,
    n_stats: int,
    device: torch.device,
    report: Progress,
    table: RopeTable | None = None,
) -> tuple[list[LayerStatistics], HoldoutStore]:
    n_layers, h_kv, d = geo.num_layers, geo.num_key_value_heads, geo.head_dim
    s, q = recipe.statistics, recipe.quant
    reservoir = min(s.sst_max_tokens, n_stats * recipe.data.seq_len)  # never larger than the data
    stats = [
        LayerStatistics(h_kv, d, s.k_target, s.v_target, q.sink, s.exclude_sink, reservoir, device)
        for _ in range(n_layers)
    ]
    gen = torch.Generator().manual_seed(recipe.data.seed)
    plan: list[tuple[torch.Tensor, torch.Tensor] | None] = [None]

    def observe(
        layer: int, qq: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scaling: float
    ) -> None:
        stats[layer].update(qq, k, v, out, scaling, plan[0])
        if table is not None:  # quant.key_mean rope: unpadded sequences at positions 0..T-1
            cos, sin = _positions(table, int(k.shape[2]), k.device)
            stats[layer].add_pre_rope(pre_rope_mean(k, cos, sin), int(k.shape[0] * k.shape[2]))

    seqs = data.sequences
    bs, seen = recipe.data.batch_size, 0
    total = seqs.shape[0]
    with capture_attention(model, observe):
        for start in range(0, n_stats, bs):
            batch = seqs[start : min(start + bs, n_stats)]
            if s.v_target == "sst":
                slots, idx = reservoir_plan(seen, batch.numel(), reservoir, gen)
                plan[0] = (slots.to(device), idx.to(device))
            run_forward(model, batch.to(device))
            seen += batch.numel()
            report("capture", start + batch.shape[0], total)
    # the copy score reads more of each held-out sequence's last queries than the clip search (sliced in _clip)
    copy = COPY_QUERIES if recipe.method == "oscar" else 0
    store = HoldoutStore(n_layers, max(recipe.clip.holdout_queries, copy))
    with capture_attention(model, store):
        for i in range(n_stats, total):
            run_forward(model, seqs[i : i + 1].to(device))
            report("capture", i + 1, total)
    return stats, store


def _positions(table: RopeTable, t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[1, t, D]`` of positions ``0..t-1`` (calibration's sequences are unpadded)."""
    return table(torch.arange(t, device=device)[None])


def _solve(
    stats: list[LayerStatistics], recipe: Recipe, report: Progress, wo: list[torch.Tensor] | None = None
) -> list[LayerTransform]:
    """Per layer: rotations from the targets and rotated means (clip ratios are set later by :func:`_clip`).

    ``wo``: per layer the W_O metric ``M [H_kv, D, D]`` (:mod:`wo_metric`) that ``statistics.v_metric`` combines
    with each KV head's value target before the heads are averaged (None: the plain value target)."""
    out = []
    for i, st in enumerate(stats):
        t = st.finalize()
        per_head = recipe.rotation.grouping == "head"
        v_heads = t.v_target if wo is None else wo_target(t.v_target, wo[i], recipe.statistics.v_metric)
        kt = t.k_target if per_head else t.k_target.mean(0, keepdim=True)
        vt = v_heads if per_head else v_heads.mean(0, keepdim=True)
        rk, lk = build_rotations(kt, recipe.method, recipe.rotation.composition, recipe.rotation.dc)
        m = recipe.quant.key_subspace
        sub = subspace_basis(kt, rk, m) if m else None
        rv, lv = build_rotations(vt, recipe.method, recipe.rotation.composition, recipe.rotation.dc)
        h = t.k_mean.shape[0]
        km = torch.einsum("hd,hde->he", t.k_mean, rk.double().expand(h, -1, -1)).float()
        vm = torch.einsum("hd,hde->he", t.v_mean, rv.double().expand(h, -1, -1)).float()
        out.append(
            LayerTransform(
                k_rotation=rk,
                v_rotation=rv,
                k_mean=km if recipe.rotation.center_keys else torch.zeros_like(km),
                v_mean=vm if recipe.rotation.center_values else torch.zeros_like(vm),
                k_eigenvalues=lk,
                v_eigenvalues=lv,
                k_subspace=sub,
                k_mean_pre=None if t.k_mean_pre is None else (
                    t.k_mean_pre.float() if recipe.rotation.center_keys else torch.zeros_like(t.k_mean_pre.float())),
            )
        )
        report("solve", i + 1, len(stats))
    return out


def _clip(
    solved: list[LayerTransform], store: HoldoutStore, recipe: Recipe, report: Progress,
    table: RopeTable | None = None,
) -> tuple[list[ClipChoice], list[LayerScheme]]:
    """Per layer: the clip choice and, where it was scored, the errors of the fallback schemes (:mod:`schemes`).

    ``table``: the model's RoPE (recipe ``quant.key_mean: rope``): held-out keys are centred by
    ``RoPE_p(k_mean_pre)·R_K`` at their positions, as the cache centres them."""
    c, q = recipe.clip, recipe.quant

    def key_mean(s: LayerTransform, k: torch.Tensor) -> torch.Tensor | None:
        return held_out_key_mean(s, k, table)

    choices, scored = [], []
    for i, s in enumerate(solved):
        problems = [
            LayerClipProblem(
                qq[:, :, -c.holdout_queries:],
                k,
                v,
                s.k_rotation,
                s.v_rotation,
                key_mean(s, k),
                s.v_mean,
                store.scaling,
                q.sink,
                q.recent,
                q.group_size,
                q.meta_dtype,
                c.objective,
                c.topk_keys,
                q.levels,
                s.k_subspace,
            )
            for qq, k, v in store.layers[i]
        ]
        problems = [p for p in problems if p.has_int2]
        if not problems:
            choices.append(ClipChoice(c.k_ratio, c.v_ratio))
        elif c.mode == "search":
            choices.append(search_clip(problems, c.k_grid, c.v_grid))
        else:
            choices.append(evaluate_clip(problems, c.k_ratio, c.v_ratio))
        err = choices[-1].error
        if err is not None and recipe.method == "oscar":
            held_out = [(qq[:, :, -c.holdout_queries:], k, v) for qq, k, v in store.layers[i]]
            scored.append(score_layer(i, held_out, err, store.scaling, q.sink, q.recent, q.group_size,
                                      q.meta_dtype, q.levels))
            scored[-1].copy = _copy_score(s, choices[-1].k_ratio, store.layers[i], store.scaling, recipe, key_mean)
        store.layers[i] = []  # free as we go
        report("clip", i + 1, len(solved))
    return choices, scored


def held_out_key_mean(s: LayerTransform, k: torch.Tensor, table: RopeTable | None) -> torch.Tensor | None:
    """The rotated-space key mean the cache centres held-out keys ``k [B, H_kv, T, D]`` by: the layer's constant
    mean, or with ``table`` (recipe ``quant.key_mean: rope``) ``RoPE_p(k_mean_pre)·R_K`` at positions 0..T-1."""
    if table is None or s.k_mean_pre is None:
        return s.k_mean
    cos, sin = _positions(table, int(k.shape[2]), k.device)
    return position_means(s.k_mean_pre, s.k_rotation, cos, sin)


def _copy_score(
    s: LayerTransform, k_ratio: float, held_out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    scaling: float, recipe: Recipe, key_mean: Callable[[LayerTransform, torch.Tensor], torch.Tensor | None],
) -> CopyScore:
    """The layer's copy score (:mod:`copy_score`) on its held-out sequences, keys as the clip search serves them."""
    q = recipe.quant
    quantize = served_keys(k_ratio, q, s.k_subspace)
    total = CopyScore()
    for qq, k, _ in held_out:
        total = total.add(copy_flips(qq[:, :, -COPY_QUERIES:], k, s.k_rotation, key_mean(s, k), scaling, q.sink,
                                     q.recent, quantize))
    return total


def default_output(
    reference: str, recipe: Recipe, resolved: str, data_sha: str, root: Path = Path("artifacts")
) -> Path:
    """``artifacts/<model-slug>/<recipe>-<short-hash>``: the hash covers model, recipe and data identity."""
    key = json.dumps({"model": resolved, "recipe": recipe.to_dict(), "data": data_sha}, sort_keys=True)
    return root / model_slug(reference) / f"{recipe.name}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def calibrate_model(
    model: Any,
    tokenizer: Any,
    recipe: Recipe,
    *,
    reference: str,
    resolved: str,
    out: Path | str | None = None,
    overwrite: bool = False,
    report: Progress | None = None,
    geometry: ModelGeometry | None = None,
    strict: bool = False,
) -> CalibrationResult:
    """Calibrate a loaded model (any device/dtype) and write its artifact. See the module docstring.

    ``geometry``: the model's geometry already passed through :func:`check_model` (None: checked here).
    ``strict``: raise CalibrationError (and write nothing) when the artifact's held-out error is worse than the
    baseline's (:mod:`oscar_cli.calibration.schemes`); without it a warning is logged.
    """
    report = report or _noop
    geo = geometry if geometry is not None else check_model(model.config, recipe)
    d = geo.head_dim
    n_stats, n_hold = plan_budget(recipe, d)
    check_output(out, overwrite)  # refuse before spending minutes
    device = next(model.parameters()).device
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    data = prepare_data(
        recipe.data.source,
        recipe.data,
        model=model,
        tokenizer=tokenizer,
        device=device,
        n_seq=n_stats + n_hold,
        on_tokens=lambda n: report("data", n, recipe.data.tokens),
    )
    report("data", recipe.data.tokens, recipe.data.tokens)
    timings["data"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    table = RopeTable(model) if recipe.quant.key_mean == "rope" else None
    stats, store = _capture(model, geo, data, recipe, n_stats, device, report, table)
    _sync(device)
    timings["capture"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    # the W_O metric only shapes a calibrated R_V (identity / hadamard ignore the targets)
    use_wo = recipe.method == "oscar" and recipe.statistics.v_metric != "none"
    wo = model_output_metrics(model, geo.num_key_value_heads, d) if use_wo else None
    with _cpu_threads(1 if device.type == "cpu" else None):  # small ops: OpenMP threads only add overhead
        solved = _solve(stats, recipe, report, wo)
        del stats
        timings["solve"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        choices, scored = _clip(solved, store, recipe, report, table)
    _sync(device)
    timings["clip"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    # the fallback applies to calibrated artifacts whose every layer was scored (identity / hadamard recipes
    # are baselines by choice; without held-out scores there is nothing to choose from)
    use_fallback = recipe.method == "oscar" and len(scored) == len(solved)
    fallback = choose_schemes(scored, scheme_bpe(recipe, d)) if use_fallback else None
    schemes = [x.scheme for x in fallback.layers] if fallback else ["oscar"] * len(solved)
    check_fallback(fallback, strict)
    layers, summaries = [], []
    for i, (s, ch, scheme) in enumerate(zip(solved, choices, schemes, strict=True)):
        layers.append(served_transform(scheme, replace(s, k_clip=ch.k_ratio, v_clip=ch.v_ratio), d))
        summaries.append(
            LayerSummary(i, _spread(s.k_eigenvalues), _spread(s.v_eigenvalues), ch.k_ratio, ch.v_ratio, ch.error,
                         scheme, fallback.layers[i].errors if fallback else {},
                         _copy_of(fallback.layers[i].copy if fallback else None))
        )
    manifest = build_manifest(
        recipe,
        reference=reference,
        resolved=resolved,
        architecture=geo.fingerprint(),
        data=data.identity,
        clip_layers=[c.to_dict() for c in choices],
        orthogonality_error=max(
            orthogonality_error(r) for x in layers for r in (x.k_rotation, x.v_rotation) if r is not None
        ),
        statistics_tokens=n_stats * recipe.data.seq_len,
        holdout_tokens=n_hold * recipe.data.seq_len,
        timings=timings,
        device=device,
        dtype=next(model.parameters()).dtype,
    )
    key_layers = _key_layers(recipe.quant.bf16_keys, "quant.bf16_keys", "keys in BF16", fallback)
    if key_layers:
        keep = {"fraction": 1.0, "score": "knorm", "side": "keys", "layers": key_layers}
        manifest = replace(manifest, quant={**manifest.quant, "keep": keep})
    int4_layers = _key_layers(recipe.quant.int4_keys, "quant.int4_keys", "keys in INT4", fallback)
    if int4_layers:
        manifest = replace(manifest, quant={**manifest.quant, "int4_keys": int4_layers})
    if fallback is not None:
        if key_layers or int4_layers:
            fallback.bits_per_element["artifact"] = bpe_table(manifest.to_dict() | {
                "calibration": {"layers": [x.to_dict() for x in fallback.layers]}})[f"{BPE_CONTEXT // 1024}k"]
        manifest = replace(manifest, calibration={**manifest.calibration, "schemes": fallback.to_dict(),
                                                  "layers": [x.to_dict() for x in fallback.layers],
                                                  **({"bf16_keys": key_layers} if recipe.quant.bf16_keys else {}),
                                                  **({"int4_keys": int4_layers} if recipe.quant.int4_keys else {})})
    path = Path(out) if out is not None else default_output(reference, recipe, resolved, data.identity["sha256"])
    write_artifact(path, manifest, layers, recipe.to_yaml(), overwrite=overwrite)
    timings["write"] = time.perf_counter() - t0
    report("write", 1, 1)
    logger.info("wrote %s", path)
    return CalibrationResult(path, manifest, summaries, timings, data.identity, data.tokens_per_second,
                             schemes=fallback)


def _copy_of(c: CopyScore | None) -> float | None:
    return None if c is None else round(c.score, 6)


def _key_layers(n: int, knob: str, what: str, fallback: SchemeReport | None) -> list[int]:
    """The ``n`` layers whose keys the artifact stores with more precision (recipe ``knob``: ``quant.bf16_keys``
    or ``quant.int4_keys``), by copy score."""
    if not n:
        return []
    if fallback is None:
        raise CalibrationError(f"{knob} needs every layer's held-out scores; some layer had no INT2 "
                               "history in the held-out sequences", hint="raise data.seq_len or clip.holdout_tokens")
    chosen = choose_key_layers([x.copy for x in fallback.layers], n, [x.scheme for x in fallback.layers])
    logger.info("%s (%s %d, by copy score): layers %s", what, knob, n,
                ", ".join(map(str, chosen)) or "none (no layer's INT2 keys flipped a focused head)")
    return chosen


def _spread(lam: torch.Tensor | None) -> float:
    if lam is None:  # a data-free transform: no target, nothing to report
        return 1.0
    lam = lam.double().clamp_min(0)
    return float(lam.max() / lam.mean().clamp_min(1e-30))


@contextmanager
def _cpu_threads(n: int | None) -> Iterator[None]:
    """Temporarily run torch CPU ops on ``n`` threads (None: unchanged). 64×64 eigh and the clip search's
    small matmuls are 10-100x slower with 2 OpenMP threads on a busy 2-core machine than with one."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calibrate(
    model_ref: str,
    *,
    recipe: Recipe,
    device: str | None = None,
    dtype: str | None = None,
    revision: str | None = None,
    out: Path | str | None = None,
    overwrite: bool = False,
    report: Progress | None = None,
    rope_scaling: str | None = None,
    rope_factor: float | None = None,
    strict: bool = False,
) -> CalibrationResult:
    """Load ``model_ref`` (:func:`oscar_cli.model.load_model`) and :func:`calibrate_model` it.

    ``rope_scaling="yarn"`` with ``rope_factor`` calibrates under YaRN (:mod:`oscar_cli.model.rope`), as
    ``oscar eval-ruler`` runs beyond the model's positions; the artifact's fingerprint then says ``yarn``.
    """
    from oscar_cli.model import load_config, load_model

    if (rope_scaling is None) != (rope_factor is None):
        from oscar_cli.errors import RecipeError

        raise RecipeError("calibrating under YaRN needs both --rope-scaling yarn and --rope-factor F")
    check_source(recipe.data.source)  # a missing --data file is the first thing to fix
    _, config = load_config(model_ref, revision=revision)
    geo = check_model(config, recipe)  # fail fast, before loading weights
    plan_budget(recipe, geo.head_dim)
    check_output(out, overwrite)
    if rope_scaling is not None:
        from oscar_cli.model.rope import native_positions, plan_yarn

        plan_yarn(native_positions(config), recipe.data.seq_len, rope_scaling, rope_factor, what="--seq-len")
    loaded = load_model(model_ref, device=device, dtype=dtype, revision=revision)
    if rope_scaling is not None and rope_factor is not None:
        from oscar_cli.model.rope import apply_yarn

        apply_yarn(loaded.model, rope_factor)
        geo = ModelGeometry.from_config(loaded.model.config)  # the fingerprint records the YaRN RoPE
    return calibrate_model(
        loaded.model,
        loaded.tokenizer,
        recipe,
        reference=loaded.identity.reference,
        resolved=loaded.identity.resolved,
        out=out,
        overwrite=overwrite,
        report=report,
        geometry=geo,
        strict=strict,
    )
