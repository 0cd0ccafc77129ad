"""``oscar eval-ruler``: RULER NIAH accuracy of each KV-cache method, resumable, on one loaded model.

Flow: load the model once → (YaRN beyond its positions) → lengths outer, methods inner: attach the method
(:func:`oscar_cli.quant.use_method`) and run the samples not yet in ``samples.jsonl`` in batches (left-padded,
chunked prefill, greedy decode of up to 128 tokens, stop at EOS), each task's in turn, a batch possibly spanning
two tasks → score with ``string_match_all`` → append one JSON line per sample as soon as its batch finishes (a
rerun skips what is there) → aggregate everything in the file that matches this run. A ``(task, length)``'s
samples (deterministic, :mod:`oscar_cli.eval.niah`) are built when its first batch needs them, only for the
indices still pending, and kept for the other methods of that length (:class:`LazySamples`): a 128K task's
prompts take seconds to tokenize, and building all of them first delayed the first result by minutes. Unless
``--batch-size`` is given, the first batch the process runs holds one sample (the rest of what would have been its
batch runs next): the first record and ETA come after one sample's time, not a batch's (~40 s of prefill for 8 ×
128K on an H200)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, overload

import torch

from oscar_cli._files import atomic_write_json
from oscar_cli.environment import environment
from oscar_cli.errors import EvalError
from oscar_cli.eval.niah import (
    TASKS,
    NiahSample,
    PromptBuilder,
    check_length,
    essay_digest,
    fit_haystack,
    haystack_files,
    load_essay_words,
    make_samples,
)
from oscar_cli.eval.progress import RunProgress, chunk_progress, fmt_seconds
from oscar_cli.eval.scoring import match_all, postprocess

logger = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
DEFAULT_SEED = 42  # eval-ruler's --seed default: every committed samples file was built with it
SUMMARY_FILE = "summary.json"
HEATMAP_FILE = "heatmap.png"


@dataclass
class RulerConfig:
    """Everything ``oscar eval-ruler`` takes (lengths in tokens)."""

    lengths: list[int]
    tasks: list[str]
    methods: list[str]  # empty: the default list (every method, oscar only with an artifact)
    samples: int
    model: str = "smollm2-135m"
    artifact: str | None = None
    haystack_dir: str | None = None  # None: the public-domain books shipped in oscar_cli/eval/haystack
    out: str = "ruler-results"
    rope_scaling: str | None = None  # None: YaRN when a length is beyond the model's positions (auto_rope)
    rope_factor: float | None = None  # filled in with the factor applied
    auto_rope: bool = True  # False (--no-rope-scaling): refuse lengths beyond the model's positions
    batch_size: int | None = None
    device: str | None = None
    dtype: str | None = None
    chunk_size: int = 4096
    max_new_tokens: int = 128
    seed: int = DEFAULT_SEED  # with the haystack, fixes every prompt; part of the resume key
    haystack: str = ""  # filled in: essay_digest of the essay haystack ("" when no chosen task has one)
    time_budget: float | None = None  # seconds; no new batch starts after it (the run stays resumable)
    bf16_windows: tuple[int, int] | None = None  # (S0, W) override for the per-token INT2 methods
    backend: str = "auto"  # auto | reference | triton (quant.runtime.attach: triton on CUDA where the kernels serve it)


@dataclass
class RulerResult:
    """Aggregated scores: ``scores[method][task][length]`` (RULER ``string_match_all``, 0-100)."""

    config: dict[str, Any]
    model: dict[str, Any]
    scores: dict[str, dict[str, dict[int, float]]]
    counts: dict[str, dict[str, dict[int, int]]]
    mean: dict[str, dict[int, float]]
    bpe: dict[str, dict[int, dict[str, float]]]
    evaluated: int
    resumed: int
    seconds: float
    complete: bool
    prompt_tokens: dict[int, float]
    environment: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def default_batch_size(length: int, device: torch.device) -> int:
    """4 on CPU; on GPU about 1M prompt tokens per batch (at most 512 rows)."""
    if device.type != "cuda":
        return 4
    return max(1, min(512, (1 << 20) // length))


def rope_tag(cfg: RulerConfig) -> str:
    """The RoPE a sample ran under, part of its resume key: ``""`` (native) or ``"yarn x4"``."""
    return f"{cfg.rope_scaling} x{cfg.rope_factor:g}" if cfg.rope_scaling and cfg.rope_factor else ""


def resume_key(rec: dict[str, Any]) -> tuple[str, str, str, str, int, int]:
    """A record's resume key: (method, method_source, rope, task, length, index)."""
    return (
        rec["method"],
        rec.get("method_source", ""),
        rec.get("rope", ""),
        rec["task"],
        int(rec["length"]),
        int(rec["index"]),
    )


def prompt_set(rec: dict[str, Any]) -> tuple[int, str]:
    """The ``(seed, essay haystack digest)`` a record's prompt was built from; a record written before these fields
    were kept gives 42 (the only seed then) and ``""`` (unknown haystack, as for a task without an essay)."""
    return int(rec.get("seed", DEFAULT_SEED)), rec.get("haystack") or ""


def same_prompts(rec: dict[str, Any], cfg: RulerConfig) -> bool:
    """Whether a record's prompt is the one this run builds for its (task, length, index): the same ``seed`` and,
    for an essay task, the same haystack (:attr:`RulerConfig.haystack`). So another ``--seed`` or
    ``--haystack-dir`` in the same ``--out`` runs its own prompts instead of resuming another set's answers.
    A record without a haystack digest (:func:`prompt_set`) matches any haystack."""
    seed, haystack = prompt_set(rec)
    return seed == cfg.seed and (not haystack or TASKS[rec["task"]].haystack != "essay" or haystack == cfg.haystack)


def same_artifact(rec: dict[str, Any], digests: dict[str, str]) -> bool:
    """Whether a record was produced by the artifact its method serves now: its ``artifact_serving`` equals the
    method's :attr:`~oscar_cli.quant.methods.QuantMethod.digest`. The source label alone names the artifact's
    path and rotations file, so an artifact rewritten in place with other quant settings or per-layer schemes
    would otherwise resume another artifact's answers. Records of an oscar before this field match by label."""
    have = rec.get("artifact_serving")
    return have is None or have == digests.get(rec["method"], "")


def read_records(path: Path) -> list[dict[str, Any]]:
    """Finished samples from ``samples.jsonl`` (a truncated last line — a killed run — is ignored)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("ignoring a truncated line in %s", path)
    return out


def _append(path: Path, records: list[dict[str, Any]]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


Item = tuple[NiahSample, list[int]]  # a sample and its prompt ids


class LazySamples:
    """The samples of each ``(task, length)`` with their prompt ids, built when first asked for and kept until
    :meth:`forget`: a long length's prompts cost seconds per task, so a run builds each one just before its
    first batch, and the methods after the first reuse them.

    Args:
        cfg: the run (tasks, lengths, samples, seed, haystack).
        tokenizer: the model's tokenizer.
        indices: the sample indices to build per ``(task, length)`` (default: ``range(cfg.samples)``); a sample is
            the same whichever others are built with it (its own RNG; the haystack is fitted on sample 0).
        progress_cb: called after each build with ``"TASK @ LENGTH"`` and the seconds it took.
        essay: the essay haystack's words when the caller has read them (default: read on first need).
    """

    def __init__(
        self,
        cfg: RulerConfig,
        tokenizer: Any,
        indices: dict[tuple[str, int], list[int]] | None = None,
        progress_cb: Callable[[str, float], None] | None = None,
        essay: list[str] | None = None,
    ) -> None:
        self.cfg, self.indices, self.progress_cb = cfg, indices, progress_cb
        self.builder = PromptBuilder(tokenizer)
        self._essay = essay
        self._built: dict[tuple[str, int], dict[int, Item]] = {}

    def _essay_words(self) -> list[str]:
        if self._essay is None:
            self._essay = load_essay_words(self.cfg.haystack_dir)
        return self._essay

    def get(self, task: str, length: int) -> dict[int, Item]:
        """``{index: (sample, prompt ids)}`` of ``(task, length)``, built on the first call."""
        key = (task, length)
        if key not in self._built:
            t0 = time.perf_counter()
            cfg = self.cfg
            essay = self._essay_words() if TASKS[task].haystack == "essay" else None
            wanted = list(range(cfg.samples)) if self.indices is None else self.indices.get(key, [])
            n_hay = fit_haystack(TASKS[task], length, self.builder, essay, cfg.seed)
            items = make_samples(task, length, wanted, n_hay, self.builder, essay, cfg.seed)
            self._built[key] = {it[0].index: it for it in items}
            if self.progress_cb:
                self.progress_cb(f"{task} @ {length}", time.perf_counter() - t0)
        return self._built[key]

    def check(self) -> None:
        """Refuse, before anything is built, a length too short for a task (:func:`check_length`, one short prompt
        each), so a lazily built run fails where an eager one did: before its first batch."""
        keys = self.indices or {(t, n): [] for n in self.cfg.lengths for t in self.cfg.tasks}
        for task, length in keys:
            essay = self._essay_words() if TASKS[task].haystack == "essay" else None
            check_length(TASKS[task], length, self.builder, essay, self.cfg.seed)

    def forget(self, length: int) -> None:
        """Drop the samples of ``length`` (a 128K prompt's ids are megabytes; a run is done with a length at once)."""
        for key in [k for k in self._built if k[1] == length]:
            del self._built[key]


def build_samples(
    cfg: RulerConfig, tokenizer: Any, progress_cb: Callable[[str], None] | None = None
) -> dict[tuple[str, int], list[Item]]:
    """Every requested sample with its prompt ids, per ``(task, length)``; ``progress_cb`` after each."""
    samples = LazySamples(cfg, tokenizer, progress_cb=(lambda what, _s: progress_cb(what)) if progress_cb else None)
    return {(task, length): list(samples.get(task, length).values()) for length in cfg.lengths for task in cfg.tasks}


class PendingSamples(Sequence[Item]):
    """The samples one method still has to run at one length, in order, without building them up front.

    ``groups`` holds, per ``(task, length)`` in task order, how many items it contributes and a function that
    returns them (building the task's prompts on the first call): reading an item builds its group only, so a
    batch that reaches into the next task builds that task then, and ``len()`` costs nothing.
    """

    def __init__(self, groups: list[tuple[int, Callable[[], list[Item]]]]) -> None:
        self.groups = [g for g in groups if g[0]]
        self._loaded: dict[int, list[Item]] = {}

    def __len__(self) -> int:
        return sum(n for n, _ in self.groups)

    def _item(self, i: int) -> Item:
        for g, (n, load) in enumerate(self.groups):
            if i < n:
                if g not in self._loaded:
                    self._loaded[g] = load()
                    assert len(self._loaded[g]) == n, (len(self._loaded[g]), n)
                return self._loaded[g][i]
            i -= n
        raise IndexError(i)

    @overload
    def __getitem__(self, i: int) -> Item: ...
    @overload
    def __getitem__(self, i: slice) -> list[Item]: ...
    def __getitem__(self, i: int | slice) -> Item | list[Item]:
        if isinstance(i, slice):
            return [self._item(j) for j in range(*i.indices(len(self)))]
        return self._item(i if i >= 0 else len(self) + i)


def pending_samples(
    samples: LazySamples, length: int, tasks: list[str], indices: Callable[[str], list[int]]
) -> PendingSamples:
    """The samples ``indices(task)`` of each task at ``length``, task by task, each task's sorted by prompt length
    (less left padding in a batch) — built only when read."""

    def group(task: str, wanted: list[int]) -> Callable[[], list[Item]]:
        def load() -> list[Item]:
            built = samples.get(task, length)
            return sorted((built[i] for i in wanted), key=lambda it: len(it[1]))

        return load

    return PendingSamples([(len(idx), group(t, idx)) for t in tasks for idx in [indices(t)]])


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every end-of-sequence id the generation config, tokenizer and model config name (sorted)."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tokenizer, model.config):
        e = getattr(src, "eos_token_id", None)
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, list | tuple):
            ids.update(int(x) for x in e)
    return sorted(ids)


def _batches(
    items: Sequence[Item], size: Callable[[int], int], deadline: float | None, alone_first: bool = False
) -> Iterator[tuple[list[Item], bool]]:
    """``(batch, alone)``: consecutive items of one length, at most ``size(length)`` per batch, read (and so built)
    one batch at a time; stops before reading a batch once ``time.perf_counter()`` passes ``deadline``.

    ``alone_first``: the first batch is cut after its first sample (where it would hold more) and the rest of it is
    the next batch, so the batches after those two are the ones without the cut; only the first sample is read
    before the first batch runs. ``alone`` is True for that lone sample when a cut happened (more items follow)."""

    def take(i: int, limit: int) -> list[Item]:
        batch, length = [items[i]], items[i][0].length
        while len(batch) < limit and i + len(batch) < len(items):
            nxt = items[i + len(batch)]
            if nxt[0].length != length:
                break
            batch.append(nxt)
        return batch

    i, rest = 0, 0  # rest: what is left of the first batch once its first sample ran alone
    while i < len(items):
        if deadline is not None and time.perf_counter() > deadline:
            return
        if rest and items[i][0].length == items[0][0].length:
            limit, rest = rest, 0
        elif alone_first and i == 0 and (full := size(items[0][0].length)) > 1:
            limit, rest = 1, full - 1
        else:
            limit, rest = size(items[i][0].length), 0
        batch = take(i, limit)
        i += len(batch)
        yield batch, bool(rest) and i < len(items)


def run_method_samples(
    loaded: Any,
    method: Any,
    pending: Sequence[Item],
    cfg: RulerConfig,
    sink: Callable[[list[dict[str, Any]]], None],
    report: RunProgress | None = None,
    deadline: float | None = None,
    alone_first: bool = False,
) -> bool:
    """Generate, score and hand over (``sink``) the records of ``pending`` samples for one attached method.

    Batches take the samples in the order given (consecutive samples of one length; :func:`pending_samples` sorts
    each task's by prompt length) and read them one batch at a time, so a :class:`PendingSamples` builds a task's
    prompts only when its first batch needs them. Returns False when ``deadline`` (``time.perf_counter()``
    value) passed before every batch ran.

    ``alone_first`` (:func:`run_ruler`: the run's first batch, batch size not given): the first sample runs alone
    and the rest of its batch next (:func:`_batches`), so its record and the first ETA come after one sample's
    time. The batches after those two are the ones of an uncut run; the records of the split batch differ in
    ``batch_size``, ``batch_seconds`` and ``bpe_measured_batch``, and its rows in left padding (the lone sample
    has none), which bf16 rounding and a quantized method's BF16 sink window can see, as with any batch size.
    """
    from oscar_cli._options import format_ctx
    from oscar_cli.quant import greedy_generate, left_pad, use_method

    model, tok = loaded.model, loaded.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (eos_ids(model, tok) or [0])[0]
    eos = eos_ids(model, tok)
    head_dim = loaded.geometry.head_dim
    rope = rope_tag(cfg)
    ran = 0

    def size(length: int) -> int:
        return cfg.batch_size or default_batch_size(length, loaded.device)

    with use_method(model, method, backend=cfg.backend) as session:
        for batch, alone in _batches(pending, size, deadline, alone_first):  # alone: cut so as to report early
            length = batch[0][0].length
            what = f"{method.name} @ {format_ctx(length)}"
            cache = session.new_cache()
            ids, mask = left_pad([b[1] for b in batch], pad_id, loaded.device)
            t0 = time.perf_counter()
            chunks = chunk_progress(model, report, ids.shape[1], what) if report else nullcontext()
            with chunks:
                outs = greedy_generate(model, cache, ids, mask, cfg.max_new_tokens, eos, cfg.chunk_size)
            dt = time.perf_counter() - t0
            measured = cache.measured_bits_per_element()
            records = []
            for (sample, prompt_ids), out in zip(batch, outs, strict=True):
                pred = postprocess(tok.decode(out, skip_special_tokens=True))
                records.append(
                    {
                        "method": method.name,
                        "method_source": method.source,
                        "artifact_serving": method.digest,
                        "rope": rope,
                        "seed": cfg.seed,
                        "haystack": cfg.haystack if TASKS[sample.task].haystack == "essay" else "",
                        "task": sample.task,
                        "length": sample.length,
                        "index": sample.index,
                        "score": 100.0 * match_all(pred, sample.answers),
                        "pred": pred,
                        "answers": list(sample.answers),
                        "depths": list(sample.depths),
                        "prompt_tokens": len(prompt_ids),
                        "output_tokens": len(out),
                        "bpe_formula": method.bits_per_element(len(prompt_ids), head_dim),
                        "bpe_measured_batch": measured,
                        "batch_seconds": dt,
                        "batch_size": len(batch),
                    }
                )
            sink(records)
            if report:
                report.batch_done(len(batch), length, dt, what, alone=alone)
            ran += len(batch)
    return ran == len(pending)


def aggregate(
    records: list[dict[str, Any]], cfg: RulerConfig, sources: dict[str, str], head_dim: int, methods: dict[str, Any],
    digests: dict[str, str],
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any], dict[int, float]]:
    """Scores, counts, per-length means and BPE from the records that belong to this run's configuration."""
    rope = rope_tag(cfg)
    wanted = {
        (m, sources[m], rope, t, L, i)
        for m in cfg.methods
        for t in cfg.tasks
        for L in cfg.lengths
        for i in range(cfg.samples)
    }
    cell: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    bpe_meas: dict[tuple[str, int], list[float]] = defaultdict(list)
    ptoks: dict[int, list[int]] = defaultdict(list)
    for r in records:
        if resume_key(r) in wanted and same_artifact(r, digests) and same_prompts(r, cfg):
            cell[(r["method"], r["task"], int(r["length"]))].append(float(r["score"]))
            bpe_meas[(r["method"], int(r["length"]))].append(float(r.get("bpe_measured_batch", float("nan"))))
            ptoks[int(r["length"])].append(int(r["prompt_tokens"]))
    scores: dict[str, dict[str, dict[int, float]]] = {}
    counts: dict[str, dict[str, dict[int, int]]] = {}
    mean: dict[str, dict[int, float]] = {}
    bpe: dict[str, dict[int, dict[str, float]]] = {}
    for m in cfg.methods:
        scores[m], counts[m], mean[m], bpe[m] = {}, {}, {}, {}
        for t in cfg.tasks:
            scores[m][t], counts[m][t] = {}, {}
            for L in cfg.lengths:
                vals = cell.get((m, t, L), [])
                scores[m][t][L] = round(sum(vals) / len(vals), 2) if vals else float("nan")
                counts[m][t][L] = len(vals)
        for L in cfg.lengths:
            per_task = [scores[m][t][L] for t in cfg.tasks if counts[m][t][L]]
            mean[m][L] = round(sum(per_task) / len(per_task), 2) if per_task else float("nan")
            meas = [x for x in bpe_meas.get((m, L), []) if x == x]
            bpe[m][L] = {
                "formula": round(methods[m].bits_per_element(L, head_dim), 4),
                "measured": round(sum(meas) / len(meas), 4) if meas else float("nan"),
            }
    prompt_tokens = {L: round(sum(v) / len(v), 1) for L, v in ptoks.items()}
    return scores, counts, mean, bpe, prompt_tokens


def _announce(text: str) -> None:
    """A note on stderr, also under ``--json`` (stdout carries only the result)."""
    print(f"eval-ruler: {text}", file=sys.stderr, flush=True)


def check_config(cfg: RulerConfig) -> None:
    """Everything that can be checked before the model loads (one line each)."""
    from oscar_cli.eval.prepare import check_backend, check_out_dir

    if cfg.samples <= 0:
        raise EvalError("--samples must be at least 1")
    if not cfg.lengths:
        raise EvalError("no context lengths given (--ctx 1k,2k,...)")
    check_out_dir(cfg.out)
    check_backend(cfg.backend, cfg.device)
    if cfg.haystack_dir is not None:
        haystack_files(cfg.haystack_dir)
        if not any(TASKS[t].haystack == "essay" for t in cfg.tasks):
            logger.warning("--haystack-dir is not used: none of the chosen tasks has an essay haystack")


def _cost_note(loaded: Any, todo: list[int]) -> str:
    """``N samples, about X of prefill on cpu`` for the samples still to run (lengths in ``todo``)."""
    from oscar_cli.eval.cost import measured_flops_per_second, prefill_flops

    flops = prefill_flops(loaded.model, todo)
    rate = measured_flops_per_second(loaded.device, loaded.dtype)
    return (
        f"on {loaded.device.type} this is about {flops:.2g} FLOPs of prefill: at least "
        f"{fmt_seconds(flops / rate)} at the {rate / 1e9:.0f} GFLOP/s measured here "
        "(--time-budget S stops early; rerunning resumes)"
    )


def run_ruler(cfg: RulerConfig, loaded: Any | None = None) -> RulerResult:
    """Run (or resume) a RULER NIAH evaluation; writes ``samples.jsonl``, ``summary.json``, ``heatmap.png``.

    Args:
        cfg: the run's configuration (``methods`` empty: :func:`oscar_cli.eval.prepare.default_methods`;
            ``rope_scaling``/``rope_factor`` are filled in with what was applied).
        loaded: an already loaded model (:class:`oscar_cli.model.LoadedModel`); loaded from ``cfg.model``
            when None.
    """
    from oscar_cli._output import progress, progress_enabled
    from oscar_cli.eval.heatmap import plot_heatmap
    from oscar_cli.eval.prepare import build_methods, default_methods
    from oscar_cli.model.rope import yarn_for_run

    notes: list[str] = []
    if not cfg.methods:
        cfg.methods, note = default_methods(cfg.artifact)
        notes += [note] if note else []
    check_config(cfg)
    essay = load_essay_words(cfg.haystack_dir) if any(TASKS[t].haystack == "essay" for t in cfg.tasks) else None
    if essay is not None:
        cfg.haystack = essay_digest(essay)
    t0 = time.perf_counter()
    if loaded is None:
        from oscar_cli.model import load_model

        loaded = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    model = loaded.model
    factor, yarn_note = yarn_for_run(model, max(cfg.lengths), cfg.rope_scaling, cfg.rope_factor, auto=cfg.auto_rope)
    if factor is not None:
        cfg.rope_scaling, cfg.rope_factor = "yarn", factor
        notes += [yarn_note] if yarn_note else []
    else:
        cfg.rope_scaling = cfg.rope_factor = None
    methods, method_notes = build_methods(
        cfg.methods, model.config, cfg.artifact, cfg.bf16_windows, resolved=loaded.identity.resolved
    )
    notes += method_notes
    for note in notes:
        _announce(note)
    sources = {m: meth.source for m, meth in methods.items()}
    digests = {m: meth.digest for m, meth in methods.items()}
    head_dim = loaded.geometry.head_dim

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / SAMPLES_FILE
    done = {resume_key(r) for r in read_records(path) if same_artifact(r, digests) and same_prompts(r, cfg)}
    rope = rope_tag(cfg)
    wanted = [
        (length, m, t, i) for length in cfg.lengths for m in cfg.methods for t in cfg.tasks for i in range(cfg.samples)
    ]
    pending_keys = {k for k in wanted if (k[1], sources[k[1]], rope, k[2], k[0], k[3]) not in done}
    pending_lengths = [k[0] for k in wanted if k in pending_keys]
    total, resumed = len(wanted), len(wanted) - len(pending_keys)
    _announce(
        f"{len(cfg.tasks)} tasks × {cfg.samples} samples × {len(cfg.lengths)} lengths × {len(cfg.methods)} "
        f"methods = {total} samples" + (f" ({resumed} already in {path})" if resumed else "")
    )
    if pending_lengths and loaded.device.type != "cuda":
        _announce(_cost_note(loaded, pending_lengths))
    # a (task, length) is built just before its first batch, for the indices any method still needs
    need: dict[tuple[str, int], set[int]] = defaultdict(set)
    for length, _m, t, i in pending_keys:
        need[(t, length)].add(i)
    with progress() as p:
        gen_task = p.add_task("building prompts", total=len(need))
        if need:
            n_prompts = sum(len(v) for v in need.values())
            _announce(f"building {n_prompts} prompts, each (task, length)'s just before its first batch")

        def built(what: str, seconds: float) -> None:
            p.advance(gen_task)
            if not progress_enabled():
                _announce(f"building prompts: {what} ({fmt_seconds(seconds)})")

        samples = LazySamples(cfg, loaded.tokenizer, {k: sorted(v) for k, v in need.items()}, built, essay)
        samples.check()
        bar = p if progress_enabled() else None
        report = RunProgress("eval-ruler", len(pending_lengths), sum(pending_lengths), bar)
        evaluated = 0
        complete = True

        def write(recs: list[dict[str, Any]]) -> None:
            nonlocal evaluated
            _append(path, recs)
            evaluated += len(recs)

        deadline = None if cfg.time_budget is None else t0 + cfg.time_budget
        # lengths outer, methods inner: an interrupted run leaves complete columns for the shorter lengths
        for length in cfg.lengths:
            for m in cfg.methods:

                def todo(task: str, length: int = length, m: str = m) -> list[int]:
                    return [i for i in range(cfg.samples) if (length, m, task, i) in pending_keys]

                pending = pending_samples(samples, length, cfg.tasks, todo)
                if len(pending) and complete:
                    # the first batch this process runs holds one sample (unless --batch-size was given): the first
                    # record and ETA come after one sample's time instead of a whole batch's
                    alone_first = evaluated == 0 and cfg.batch_size is None
                    complete = run_method_samples(loaded, methods[m], pending, cfg, write, report, deadline, alone_first)
            samples.forget(length)
    scores, counts, mean, bpe, ptoks = aggregate(read_records(path), cfg, sources, head_dim, methods, digests)
    result = RulerResult(
        config=asdict(cfg),
        model={
            "reference": loaded.identity.reference,
            "resolved": loaded.identity.resolved,
            "dtype": str(loaded.dtype).removeprefix("torch."),
        },
        scores=scores,
        counts=counts,
        mean=mean,
        bpe=bpe,
        evaluated=evaluated,
        resumed=resumed,
        complete=complete,
        seconds=round(time.perf_counter() - t0, 1),
        prompt_tokens=ptoks,
        environment=environment(),
        files={"samples": str(path), "summary": str(out / SUMMARY_FILE), "heatmap": str(out / HEATMAP_FILE)},
        notes=notes,
    )
    title = loaded.identity.reference + (f" (YaRN x{cfg.rope_factor:g})" if cfg.rope_factor else "")
    plot_heatmap(scores, cfg.tasks, cfg.lengths, cfg.methods, out / HEATMAP_FILE, title, counts, cfg.samples)
    atomic_write_json(out / SUMMARY_FILE, result.to_json())
    return result
