"""``oscar eval-kl``: how far each method's next-token distributions drift from BF16 after a long context.

For each context length ``L``, ``N`` windows of ``L + M`` tokens are cut from held-out prose (evenly spaced
over the tokenized file). Each method prefills the first ``L`` tokens through its cache (chunked, like a
server), then **teacher-forces** the next ``M`` tokens one decode step at a time, so every distribution is
produced by a decode step that reads sink + INT2 history + recent window. Against the ``bf16`` method's
distributions at the same positions it reports

- ``kl``: mean ``KL(p_bf16 || p_method)`` in nats over the ``N × M`` positions (float32 log-softmax);
- ``top1``: the fraction of positions where both pick the same argmax token;
- ``nll``: the method's mean negative log-likelihood of the actual next tokens (``ppl = exp(nll)``).

This smooth metric is what calibration work tunes against (RULER scores saturate).

Windows beyond the model's positions (``L + M`` > native) run under YaRN, every method and the ``bf16``
reference alike, with one note naming the factor (:func:`oscar_cli.model.rope.yarn_for_run`, as
``oscar eval-ruler``); ``--no-rope-scaling`` refuses instead.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from oscar_cli.errors import EvalError

logger = logging.getLogger(__name__)


@dataclass
class KLConfig:
    """Everything ``oscar eval-kl`` takes."""

    text: str
    lengths: list[int]
    methods: list[str]  # empty: naive-int2, quarot-int2, kivi-2 and (with an artifact) oscar
    tokens: int = 64
    windows: int = 4
    model: str = "smollm2-135m"
    artifact: str | None = None
    device: str | None = None
    dtype: str | None = None
    chunk_size: int = 4096
    bf16_windows: tuple[int, int] | None = None  # (S0, W) override for the per-token INT2 methods
    backend: str = "auto"  # auto | reference | triton (quant.runtime.attach: triton on CUDA where the kernels serve it)
    rope_scaling: str | None = None  # None: YaRN when context + tokens is beyond the model's positions (auto_rope)
    rope_factor: float | None = None  # filled in with the factor applied
    auto_rope: bool = True  # False (--no-rope-scaling): refuse windows beyond the model's positions


@dataclass
class KLResult:
    """``metrics[method][length] = {"kl", "top1", "nll", "ppl"}`` (bf16's own kl is 0, top1 1)."""

    config: dict[str, Any]
    model: dict[str, Any]
    metrics: dict[str, dict[int, dict[str, float]]]
    bpe: dict[str, dict[int, float]]
    seconds: float
    environment: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def cut_windows(ids: list[int], length: int, tokens: int, windows: int) -> torch.Tensor:
    """``windows`` evenly spaced slices of ``length + tokens`` ids -> ``[N, L + M]`` long.

    Raises:
        EvalError: the text is shorter than one window, or so short for ``windows`` that the scored spans
            (the last ``tokens`` of each window) would overlap: the same positions would be counted twice.
    """
    need = length + tokens
    if len(ids) < need:
        raise EvalError(
            f"the text has {len(ids)} tokens; a window needs {need} (context {length} + {tokens} scored)",
            hint="use a longer --text file or a shorter --ctx",
        )
    last = len(ids) - need
    most = 1 + last // tokens  # evenly spaced starts at least `tokens` apart
    if windows > most:
        raise EvalError(
            f"--windows {windows} of {length} + {tokens} tokens do not fit in the text's {len(ids)} tokens without "
            f"scoring the same positions twice; at most {most} fit",
            hint=f"use --windows {most} or less, a shorter --ctx/--tokens, or a longer --text file",
        )
    starts = [round(i * last / max(1, windows - 1)) for i in range(windows)] if windows > 1 else [0]
    return torch.tensor([ids[s : s + need] for s in starts], dtype=torch.long)


@torch.inference_mode()
def teacher_forced_logprobs(model: Any, session: Any, batch: torch.Tensor, length: int, chunk: int) -> torch.Tensor:
    """Log-probabilities ``[N, M, V]`` (float32) for positions ``L .. L+M-1`` through a fresh cache."""
    from oscar_cli.quant.generation import decode_step, prefill

    cache = session.new_cache()
    mask = torch.ones_like(batch[:, :length])
    logits = prefill(model, cache, batch[:, :length], mask, chunk)
    out = [torch.log_softmax(logits, -1)]
    for j in range(batch.shape[1] - length - 1):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        logits = decode_step(model, cache, batch[:, length + j], mask)
        out.append(torch.log_softmax(logits, -1))
    return torch.stack(out, 1)


def method_logprobs(model: Any, method: Any, batch: torch.Tensor, length: int, chunk: int,
                    backend: str = "auto") -> torch.Tensor:
    """:func:`teacher_forced_logprobs` with ``method`` attached to ``model`` for the call (restored after)."""
    from oscar_cli.quant import use_method

    with use_method(model, method, backend=backend) as session:
        return teacher_forced_logprobs(model, session, batch, length, chunk)


def compare(ref: torch.Tensor, lp: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """KL(ref || lp), top-1 agreement and NLL of ``targets [N, M]`` for log-probs ``[N, M, V]``."""
    kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
    top1 = (ref.argmax(-1) == lp.argmax(-1)).float().mean().item()
    nll = -lp.gather(-1, targets.unsqueeze(-1)).mean().item()
    return {"kl": round(max(kl, 0.0), 6), "top1": round(top1, 4), "nll": round(nll, 4), "ppl": round(math.exp(nll), 3)}


def run_kl(cfg: KLConfig, loaded: Any | None = None) -> KLResult:
    """Run the KL evaluation (``bf16`` is always computed first, as the reference)."""
    from oscar_cli._output import progress
    from oscar_cli.environment import environment
    from oscar_cli.eval.prepare import build_methods, check_backend, default_methods, read_text_file
    from oscar_cli.model.rope import yarn_for_run

    if cfg.tokens < 1 or cfg.windows < 1:
        raise EvalError("--tokens and --windows must be at least 1")
    if not cfg.methods:
        cfg.methods, note = default_methods(cfg.artifact, reference=False)
        if note:
            logger.warning(note)
    text = read_text_file(cfg.text)
    check_backend(cfg.backend, cfg.device)
    t0 = time.perf_counter()
    if loaded is None:
        from oscar_cli.model import load_model

        loaded = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    model, tok = loaded.model, loaded.tokenizer
    longest = max(cfg.lengths) + cfg.tokens
    factor, yarn_note = yarn_for_run(model, longest, cfg.rope_scaling, cfg.rope_factor, auto=cfg.auto_rope,
                                     what="--ctx + --tokens", span=f"--ctx {max(cfg.lengths)} + --tokens {cfg.tokens}")
    cfg.rope_scaling, cfg.rope_factor = ("yarn", factor) if factor is not None else (None, None)
    if yarn_note:
        logger.warning(yarn_note)
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    names = ["bf16"] + [m for m in cfg.methods if m != "bf16"]
    for length in cfg.lengths:  # every length's windows are checked before any method runs
        cut_windows(ids, length, cfg.tokens, cfg.windows)
    methods, notes = build_methods(names, model.config, cfg.artifact, cfg.bf16_windows, resolved=loaded.identity.resolved)
    for note in notes:
        logger.warning(note)
    head_dim = loaded.geometry.head_dim
    metrics: dict[str, dict[int, dict[str, float]]] = {m: {} for m in names}
    with progress(log="eval-kl") as p:
        bar = p.add_task("eval-kl", total=len(names) * len(cfg.lengths))
        for length in cfg.lengths:
            batch = cut_windows(ids, length, cfg.tokens, cfg.windows).to(loaded.device)
            targets = batch[:, length:]
            ref: torch.Tensor | None = None
            for m in names:
                p.update(bar, description=f"{m} @ {length}")
                lp = method_logprobs(model, methods[m], batch, length, cfg.chunk_size, cfg.backend)
                if ref is None:
                    ref = lp
                metrics[m][length] = compare(ref, lp, targets)
                p.advance(bar)
    bpe = {m: {L: round(methods[m].bits_per_element(L, head_dim), 4) for L in cfg.lengths} for m in names}
    return KLResult(
        config=asdict(cfg),
        model={
            "reference": loaded.identity.reference,
            "resolved": loaded.identity.resolved,
            "dtype": str(loaded.dtype).removeprefix("torch."),
        },
        metrics={m: metrics[m] for m in names if m in cfg.methods or m == "bf16"},
        bpe=bpe,
        seconds=round(time.perf_counter() - t0, 1),
        environment=environment(),
    )
