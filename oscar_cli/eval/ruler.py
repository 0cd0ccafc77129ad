"""``oscar eval-ruler``: RULER NIAH accuracy of each KV-cache method, resumable, on one loaded model.

Flow: load the model once → (YaRN if asked) → generate every (task, length, index) sample (deterministic,
:mod:`oscar_cli.eval.niah`) → for each method, attach it (:func:`oscar_cli.quant.use_method`) and run the
samples not yet in ``samples.jsonl`` in batches (left-padded, chunked prefill, greedy decode of up to 128
tokens, stop at EOS) → score with ``string_match_all`` → append one JSON line per sample as soon as its batch
finishes (a rerun skips what is there) → aggregate everything in the file that matches this run.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from oscar_cli.errors import EvalError
from oscar_cli.eval.niah import TASKS, NiahSample, PromptBuilder, fit_haystack, load_essay_words, make_sample
from oscar_cli.eval.scoring import match_all, postprocess

logger = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
SUMMARY_FILE = "summary.json"
HEATMAP_FILE = "heatmap.png"


@dataclass
class RulerConfig:
    """Everything ``oscar eval-ruler`` takes (lengths in tokens)."""

    lengths: list[int]
    tasks: list[str]
    methods: list[str]
    samples: int
    model: str = "smollm2-135m"
    artifact: str | None = None
    haystack_dir: str | None = None
    out: str = "ruler-results"
    rope_scaling: str | None = None
    rope_factor: float | None = None
    batch_size: int | None = None
    device: str | None = None
    dtype: str | None = None
    chunk_size: int = 4096
    max_new_tokens: int = 128
    seed: int = 42
    time_budget: float | None = None  # seconds; no new batch starts after it (the run stays resumable)
    bf16_windows: tuple[int, int] | None = None  # (S0, W) override for the per-token INT2 methods
    backend: str = "reference"  # "triton": INT2 writes and unpadded decode steps through oscar_kernels.ops


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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def environment() -> dict[str, Any]:
    """Versions and device, recorded with every result."""
    import transformers

    from oscar_cli import __version__

    env: dict[str, Any] = {
        "oscar": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": "cpu",
    }
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
    return env


def apply_rope_scaling(model: Any, lengths: list[int], rope_scaling: str | None, factor: float | None) -> None:
    """Refuse lengths beyond the model's context, or switch RoPE to YaRN (``factor × native`` positions)."""
    cfg = model.config
    native = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    longest = max(lengths)
    if rope_scaling is None:
        if native and longest > native:
            raise EvalError(
                f"--ctx {longest} is beyond the model's context of {native} tokens",
                hint=f"add --rope-scaling yarn --rope-factor {max(2, -(-longest // native))} (same for every method)",
            )
        return
    if rope_scaling != "yarn":
        raise EvalError(f"unknown --rope-scaling {rope_scaling!r}; supported: yarn")
    if not factor or factor <= 1:
        raise EvalError("--rope-scaling yarn needs --rope-factor F with F > 1")
    if native and longest > native * factor:
        raise EvalError(f"--ctx {longest} is beyond {native} × {factor} = {int(native * factor)} positions of YaRN")
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    cfg.rope_parameters = {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": native,
        "rope_theta": theta,
    }
    cfg.max_position_embeddings = int(native * factor)
    base = getattr(model, "model", model)
    rotary = base.rotary_emb
    base.rotary_emb = type(rotary)(config=cfg).to(next(model.parameters()).device)  # recompute inv_freq (YaRN)


def default_batch_size(length: int, device: torch.device) -> int:
    """4 on CPU; on GPU about 1M prompt tokens per batch (at most 512 rows)."""
    if device.type != "cuda":
        return 4
    return max(1, min(512, (1 << 20) // length))


def _key(rec: dict[str, Any]) -> tuple[str, str, str, int, int]:
    return (rec["method"], rec.get("method_source", ""), rec["task"], int(rec["length"]), int(rec["index"]))


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


def build_samples(
    cfg: RulerConfig, tokenizer: Any, progress_cb: Callable[[str], None] | None = None
) -> dict[tuple[str, int], list[tuple[NiahSample, list[int]]]]:
    """Every requested sample with its prompt ids, per ``(task, length)``."""
    builder = PromptBuilder(tokenizer)
    needs_essay = any(TASKS[t].haystack == "essay" for t in cfg.tasks)
    essay = load_essay_words(cfg.haystack_dir) if needs_essay else None
    out: dict[tuple[str, int], list[tuple[NiahSample, list[int]]]] = {}
    for length in cfg.lengths:
        for task in cfg.tasks:
            if progress_cb:
                progress_cb(f"{task} @ {length}")
            n_hay = fit_haystack(TASKS[task], length, builder, essay, cfg.seed)
            out[(task, length)] = [
                make_sample(task, length, i, n_hay, builder, essay, cfg.seed) for i in range(cfg.samples)
            ]
    return out


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), tokenizer, model.config):
        e = getattr(src, "eos_token_id", None)
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, list | tuple):
            ids.update(int(x) for x in e)
    return sorted(ids)


def _batches(items: list[Any], size: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def run_method_samples(
    loaded: Any,
    method: Any,
    pending: list[tuple[NiahSample, list[int]]],
    cfg: RulerConfig,
    sink: Callable[[list[dict[str, Any]]], None],
    advance: Callable[[int], None],
    deadline: float | None = None,
) -> bool:
    """Generate, score and hand over (``sink``) the records of ``pending`` samples for one attached method.

    Returns False when ``deadline`` (``time.perf_counter()`` value) passed before every batch ran.
    """
    from oscar_cli.quant import greedy_generate, left_pad, use_method

    model, tok = loaded.model, loaded.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (_eos_ids(model, tok) or [0])[0]
    eos = _eos_ids(model, tok)
    head_dim = int(getattr(model.config, "head_dim", 0) or model.config.hidden_size // model.config.num_attention_heads)
    by_len: dict[int, list[tuple[NiahSample, list[int]]]] = defaultdict(list)
    for item in pending:
        by_len[item[0].length].append(item)
    with use_method(model, method, backend=cfg.backend) as session:
        for length, items in sorted(by_len.items()):
            items.sort(key=lambda it: len(it[1]))
            size = cfg.batch_size or default_batch_size(length, loaded.device)
            for batch in _batches(items, size):
                if deadline is not None and time.perf_counter() > deadline:
                    return False
                cache = session.new_cache()
                ids, mask = left_pad([b[1] for b in batch], pad_id, loaded.device)
                t0 = time.perf_counter()
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
                advance(len(batch))
    return True


def aggregate(
    records: list[dict[str, Any]], cfg: RulerConfig, sources: dict[str, str], head_dim: int, methods: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any], dict[int, float]]:
    """Scores, counts, per-length means and BPE from the records that belong to this run's configuration."""
    wanted = {
        (m, sources[m], t, L, i)
        for m in cfg.methods
        for t in cfg.tasks
        for L in cfg.lengths
        for i in range(cfg.samples)
    }
    cell: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    bpe_meas: dict[tuple[str, int], list[float]] = defaultdict(list)
    ptoks: dict[int, list[int]] = defaultdict(list)
    for r in records:
        if _key(r) in wanted:
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


def run_ruler(cfg: RulerConfig, loaded: Any | None = None) -> RulerResult:
    """Run (or resume) a RULER NIAH evaluation; writes ``samples.jsonl``, ``summary.json``, ``heatmap.png``.

    Args:
        cfg: the run's configuration.
        loaded: an already loaded model (:class:`oscar_cli.model.LoadedModel`); loaded from ``cfg.model``
            when None.
    """
    from oscar_cli._output import progress
    from oscar_cli.eval.heatmap import plot_heatmap
    from oscar_cli.quant import build_method

    if cfg.samples <= 0:
        raise EvalError("--samples must be at least 1")
    if not cfg.lengths:
        raise EvalError("no context lengths given (--ctx 1k,2k,...)")
    t0 = time.perf_counter()
    if loaded is None:
        from oscar_cli.model import load_model

        loaded = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    model = loaded.model
    apply_rope_scaling(model, cfg.lengths, cfg.rope_scaling, cfg.rope_factor)
    methods = {m: build_method(m, model.config, cfg.artifact, cfg.bf16_windows) for m in cfg.methods}
    sources = {m: meth.source for m, meth in methods.items()}
    head_dim = int(getattr(model.config, "head_dim", 0) or model.config.hidden_size // model.config.num_attention_heads)

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / SAMPLES_FILE
    done = {_key(r) for r in read_records(path)}
    with progress() as p:
        gen_task = p.add_task("building prompts", total=len(cfg.tasks) * len(cfg.lengths))
        samples = build_samples(cfg, loaded.tokenizer, lambda _what: p.advance(gen_task))
        evaluated = resumed = 0
        complete = True

        def write(recs: list[dict[str, Any]]) -> None:
            nonlocal evaluated
            _append(path, recs)
            evaluated += len(recs)

        deadline = None if cfg.time_budget is None else t0 + cfg.time_budget
        # lengths outer, methods inner: an interrupted run leaves complete columns for the shorter lengths
        bars = {m: p.add_task(m, total=len(cfg.tasks) * len(cfg.lengths) * cfg.samples) for m in cfg.methods}
        for length in cfg.lengths:
            for m in cfg.methods:
                items = [it for t in cfg.tasks for it in samples[(t, length)]]
                pending = [it for it in items if (m, sources[m], it[0].task, length, it[0].index) not in done]
                resumed += len(items) - len(pending)
                p.advance(bars[m], len(items) - len(pending))

                def advance(n: int, bar: Any = bars[m]) -> None:
                    p.advance(bar, n)

                if pending and complete:
                    complete = run_method_samples(loaded, methods[m], pending, cfg, write, advance, deadline)
    scores, counts, mean, bpe, ptoks = aggregate(read_records(path), cfg, sources, head_dim, methods)
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
    )
    plot_heatmap(
        scores, cfg.tasks, cfg.lengths, cfg.methods, out / HEATMAP_FILE, loaded.identity.reference, counts, cfg.samples
    )
    tmp = out / f".{SUMMARY_FILE}.tmp"
    tmp.write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / SUMMARY_FILE)
    return result
