"""``oscar generate``'s library: prompts -> text through ``model.generate`` on an oscar KV cache, with metrics.

:func:`generate_text` attaches the method (:func:`oscar_cli.api.attach`), tokenizes the prompts (the chat template
when the tokenizer has one), checks the limits before anything runs (the model's positions; the KV cache the
method needs, by its formula, against free memory), runs ``model.generate`` with a streamer that timestamps every
token, and reports:

- ``ttft_s``: time to the first new token (prefill included); ``tpot_s``: mean time per later token;
- ``kv_bytes`` / ``kv_bytes_per_token``: bytes the cache's tiers hold in use (all layers, K and V) after
  generation, per token of the batch; ``kv_allocated_bytes``: every tensor it holds (page-pool capacity included);
- ``peak_memory_bytes``: ``torch.cuda.max_memory_allocated`` on CUDA, the process's peak RSS on CPU
  (``peak_memory_kind`` says which);
- ``path``: ``triton`` or ``reference`` for the INT2 methods (never a silent fallback: ``--backend triton`` where
  the kernels cannot run is an error), else the method kind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from oscar_cli.errors import OscarError

log = logging.getLogger(__name__)


@dataclass
class GenerateConfig:
    """Everything ``oscar generate`` takes."""

    prompts: list[str]
    model: str = "smollm2-135m"
    artifact: str | None = None
    method: str = "oscar"
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    chat: bool = True  # apply the tokenizer's chat template when it has one
    backend: str = "auto"
    device: str | None = None
    dtype: str | None = None


@dataclass
class GenerateResult:
    """The generated texts (one per prompt) and the run's metrics."""

    texts: list[str]
    new_tokens: list[list[int]]
    prompt_tokens: list[int]
    metrics: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class _Timing:
    """A ``model.generate`` streamer: timestamps each step's tokens and, for one prompt, streams its text."""

    def __init__(self, tokenizer: Any, on_text: Callable[[str], None] | None) -> None:
        self.times: list[float] = []
        self._prompt_seen = False
        self.text = None
        if on_text is not None:
            from transformers import TextStreamer

            sink: Callable[[str], None] = on_text

            class _Text(TextStreamer):
                def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
                    sink(text + ("\n" if stream_end else ""))

            self.text = _Text(tokenizer, skip_prompt=True, skip_special_tokens=True)

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True
        if self.text is not None:
            self.text.put(value)

    def end(self) -> None:
        if self.text is not None:
            self.text.end()


def encode_prompts(tokenizer: Any, prompts: list[str], chat: bool) -> list[list[int]]:
    """Token ids per prompt: through the chat template (a user turn + the generation prompt) when ``chat`` and the
    tokenizer has one, else the plain text with the tokenizer's special tokens."""
    rows = []
    for p in prompts:
        if chat and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                 tokenize=False)
            rows.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
        else:
            rows.append(list(tokenizer(p)["input_ids"]))
    if any(not r for r in rows):
        raise OscarError("a prompt is empty (no tokens)", hint="give some text with --prompt, --prompt-file or stdin")
    return rows


def kv_bytes_needed(method: Any, config: Any, batch: int, length: int, act_bytes: int) -> int:
    """The method's KV cache for ``batch`` sequences of ``length`` tokens, by its bits-per-element formula (which
    counts 16-bit tiers; scaled to the activation width, an upper bound for 32-bit activations)."""
    from oscar_cli.model.geometry import ModelGeometry

    geo = ModelGeometry.of(config)
    bits = method.bits_per_element(length, geo.head_dim) * act_bytes / 2  # the formula counts 16-bit tiers
    return int(bits / 8 * 2 * geo.num_layers * batch * geo.num_key_value_heads * length * geo.head_dim)


def free_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors: CUDA ``mem_get_info``; on Linux CPUs ``MemAvailable``; else None."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_memory_allocated"
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "process_peak_rss"


def generate_text(
    cfg: GenerateConfig, loaded: Any | None = None, on_text: Callable[[str], None] | None = None
) -> GenerateResult:
    """Generate for every prompt in one left-padded batch; ``on_text`` receives the streamed text (one prompt; a
    newline ends it)."""
    from oscar_cli.api import attach
    from oscar_cli.quant.generation import cache_kwarg, left_pad

    if not cfg.prompts:
        raise OscarError("no prompt given", hint="use --prompt TEXT, --prompt-file FILE or pipe text on stdin")
    if cfg.max_new_tokens < 1:
        raise OscarError(f"--max-new-tokens must be at least 1, got {cfg.max_new_tokens}")
    if cfg.temperature < 0 or not 0 < cfg.top_p <= 1:
        raise OscarError(f"--temperature must be >= 0 and --top-p in (0, 1], got {cfg.temperature}, {cfg.top_p}")
    if loaded is None:
        from oscar_cli.model import load_model

        loaded = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    model, tok, dev = loaded.model, loaded.tokenizer, loaded.device
    rows = encode_prompts(tok, cfg.prompts, cfg.chat)
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    longest = max(len(r) for r in rows)
    if limit and longest + cfg.max_new_tokens > limit:
        raise OscarError(
            f"prompt of {longest} tokens + {cfg.max_new_tokens} new tokens is beyond the model's {limit} positions",
            hint="shorten the prompt or lower --max-new-tokens",
        )
    session = attach(model, cfg.artifact, method=cfg.method, backend=cfg.backend)
    act = torch.finfo(loaded.dtype).bits // 8
    need = kv_bytes_needed(session.method, model.config, len(rows), longest + cfg.max_new_tokens, act)
    free = free_memory(dev)
    if free is not None and need > free:
        raise OscarError(
            f"the {cfg.method} KV cache of {len(rows)} x {longest + cfg.max_new_tokens} tokens needs "
            f"{need / 2**30:.2f} GiB, {free / 2**30:.2f} GiB are free on {dev}",
            hint="use fewer or shorter prompts, or fewer --max-new-tokens",
        )
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    ids, mask = left_pad(rows, int(pad), dev)
    cache = session.new_cache()
    streamer = _Timing(tok, on_text if len(rows) == 1 else None)
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p}
        if cfg.temperature > 0 else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    )
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    try:
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=cfg.max_new_tokens, pad_token_id=int(pad),
            streamer=streamer, **sampling, **{cache_kwarg(model): cache},
        )
    except torch.OutOfMemoryError:
        raise OscarError(
            f"out of memory on {dev} generating {len(rows)} x {longest + cfg.max_new_tokens} tokens",
            hint="use fewer or shorter prompts, or fewer --max-new-tokens",
        ) from None
    log.info("generate: %s cache, %s path", cfg.method, cache.path)
    new = out[:, ids.shape[1]:]
    eos = set(_eos_ids(model, tok))
    tokens = [r[: _stop(r, eos)] for r in new.tolist()]
    texts = [tok.decode(t, skip_special_tokens=True) for t in tokens]
    times = streamer.times
    stored = cache.get_seq_length()
    peak, kind = _peak_memory(dev)
    metrics = {
        "ttft_s": round(times[0] - t0, 6) if times else None,
        "tpot_s": round((times[-1] - times[0]) / (len(times) - 1), 6) if len(times) > 1 else None,
        "new_tokens": len(times),
        "kv_bytes": cache.storage_bytes(),
        "kv_allocated_bytes": cache.allocated_bytes(),
        "kv_bytes_per_token": round(cache.storage_bytes() / max(1, stored * len(rows)), 2),
        "kv_tokens": stored * len(rows),
        "peak_memory_bytes": peak,
        "peak_memory_kind": kind,
        "path": cache.path,
        "method": session.method.name,
        "method_source": session.method.source,
        "device": str(dev),
        "dtype": str(loaded.dtype).removeprefix("torch."),
    }
    return GenerateResult(texts, tokens, [len(r) for r in rows], metrics, asdict(cfg))


def _stop(row: list[int], eos: set[int]) -> int:
    """Index of the first EOS in ``row`` (its length when none)."""
    return next((i for i, t in enumerate(row) if t in eos), len(row))


def _eos_ids(model: Any, tok: Any) -> list[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    if ids is None:
        ids = tok.eos_token_id
    return [int(i) for i in (ids if isinstance(ids, list) else [ids]) if i is not None]
