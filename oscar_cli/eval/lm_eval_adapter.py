"""lm-evaluation-harness model type ``oscar``: any harness task through one of oscar's KV-cache methods.

The model is loaded like every oscar command loads it (any model reference, GGUF through the conversion
cache) and the method is attached with :func:`oscar_cli.quant.use_method`, so every request runs the way a
server would: prompts are prefilled in chunks through the method's cache (each chunk reads the quantized
history of the earlier ones), and generation decodes over sink + INT2 + recent window.

- ``loglikelihood``: context + continuation prefilled through the cache (``chunk_size`` tokens per chunk);
  the continuation's log-probabilities come from the logits of the positions before each of its tokens.
- ``loglikelihood_rolling``: lm-eval's disjoint rolling windows of ``max_length`` tokens, each scored as above.
- ``generate_until``: greedy decoding (:func:`oscar_cli.quant.greedy_generate`) for up to ``max_gen_toks``,
  cut at the first ``until`` string. Sampling is refused (oscar decodes greedily).

lm-eval discovers model types only in its own package, so the command line is ``oscar-lm-eval`` (lm-eval's
own CLI with ``oscar`` registered)::

    oscar-lm-eval --model oscar --model_args pretrained=qwen2.5-coder-1.5b,artifact=ART,method=oscar \\
        --tasks hellaswag --batch_size 8

From Python, import this module before calling ``lm_eval.simple_evaluate(model="oscar", ...)``.
``model_args``: ``pretrained`` (model reference, default the embedded model), ``method`` (bf16, naive-int2,
quarot-int2, kivi-2, oscar; default oscar), ``artifact`` (needed by oscar), ``device``, ``dtype``,
``batch_size``, ``chunk_size``, ``max_gen_toks``, ``backend`` (reference | triton).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from oscar_cli.errors import EvalError, MissingDependencyError
from oscar_cli.eval.ruler import eos_ids

logger = logging.getLogger(__name__)

try:
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import LM
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError(
        "the lm-evaluation-harness adapter needs lm-eval", hint="Run: pip install 'oscar-kv[lm-eval]'"
    ) from exc

MODEL_TYPE = "oscar"


class OscarLM(LM):
    """An lm-eval ``LM`` that runs a transformers model through an oscar KV-cache method."""

    def __init__(
        self,
        pretrained: str = "smollm2-135m",
        method: str = "oscar",
        artifact: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        batch_size: int | str = 1,
        chunk_size: int | str = 4096,
        max_gen_toks: int | str = 256,
        backend: str = "reference",
        **unused: Any,
    ) -> None:
        super().__init__()
        from oscar_cli.eval.prepare import build_methods, check_backend
        from oscar_cli.method_registry import parse_methods
        from oscar_cli.model import load_model

        if unused:
            logger.warning("oscar model type: ignoring model_args %s", ", ".join(sorted(unused)))
        if str(batch_size).startswith("auto"):
            batch_size = 1
        (name,) = parse_methods(method)[:1]
        if device and device.startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's own default is cuda:0; its hf model type runs on the CPU then, and so does this one
            logger.warning("lm-eval asks for device %s but CUDA is not available here: running on cpu "
                           "(--device cpu says so explicitly)", device)  # fmt: skip
            device = "cpu"
        check_backend(backend, device)
        self.loaded = load_model(pretrained, device=device, dtype=dtype)
        methods, notes = build_methods([name], self.loaded.model.config, artifact, None,
                                       resolved=self.loaded.identity.resolved)  # fmt: skip
        for note in notes:
            logger.warning(note)
        self.method = methods[name]
        self.backend = backend
        self.batch_size = max(1, int(batch_size))
        self.chunk_size = max(16, int(chunk_size))
        self.max_gen_toks = int(max_gen_toks)
        self._device = self.loaded.device

    # -- what lm-eval asks of every LM -------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", self.loaded.identity.reference)).replace("/", "__")

    @property
    def max_length(self) -> int:
        return int(getattr(self.loaded.model.config, "max_position_embeddings", 0) or 2048)

    @property
    def eot_token_id(self) -> int:
        ids = eos_ids(self.loaded.model, self.tokenizer)
        return ids[0] if ids else 0

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return int(bos) if bos is not None else self.eot_token_id

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )

    def tok_encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # -- scoring ---------------------------------------------------------------------------------------
    @contextmanager
    def _session(self) -> Iterator[Any]:
        from oscar_cli.quant import use_method

        with use_method(self.loaded.model, self.method, backend=self.backend) as session:
            yield session

    def _pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int(pad) if pad is not None else self.eot_token_id

    def _score(self, session: Any, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """``(sum log p(continuation | context), greedy?)`` for token pairs, one chunked prefill per batch."""
        from oscar_cli.quant import left_pad, prefill

        out: list[tuple[float, bool]] = []
        for start in range(0, len(pairs), self.batch_size):
            batch = pairs[start : start + self.batch_size]
            rows = []
            for ctx, cont in batch:
                full = (ctx + cont)[-(self.max_length + 1) :]
                rows.append(full[:-1])  # the last continuation token is predicted, never fed
            ids, mask = left_pad(rows, self._pad_id(), self._device)
            logits = prefill(self.loaded.model, session.new_cache(), ids, mask, self.chunk_size, all_logits=True)
            t = ids.shape[1]
            for row, (_ctx, cont) in enumerate(batch):
                n = len(cont)
                lp = torch.log_softmax(logits[row, t - n :].float(), -1)
                target = torch.tensor(cont, device=lp.device)
                logprob = float(lp.gather(-1, target[:, None]).sum())
                out.append((logprob, bool((lp.argmax(-1) == target).all())))
        return out

    def _pairs(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if not context:
            return [self.prefix_token_id], self.tok_encode(continuation)
        n_space = len(context) - len(context.rstrip())  # lm-eval convention: trailing spaces go to the continuation
        if n_space:
            context, continuation = context[:-n_space], context[-n_space:] + continuation
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        return whole[: len(ctx)], whole[len(ctx) :]

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._pairs(*req.args) for req in requests]
        if any(not cont for _, cont in pairs):
            raise EvalError("a loglikelihood request has an empty continuation")
        with self._session() as session:
            results = self._score(session, pairs)
        for req, res in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        out: list[float] = []
        with self._session() as session:
            for req in requests:
                (text,) = req.args
                windows = [
                    lm_utils.make_disjoint_window(w)
                    for w in lm_utils.get_rolling_token_windows(
                        token_list=self.tok_encode(text),
                        prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length,
                        context_len=1,
                    )
                ]
                total = sum(lp for lp, _ in self._score(session, [(list(c), list(x)) for c, x in windows]))
                out.append(total)
                self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return out

    # -- generation ------------------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        from oscar_cli.quant import greedy_generate, left_pad

        out: list[str] = []
        eos = eos_ids(self.loaded.model, self.tokenizer)
        with self._session() as session:
            for start in range(0, len(requests), self.batch_size):
                batch = requests[start : start + self.batch_size]
                kwargs = [dict(req.args[1] or {}) for req in batch]
                for kw in kwargs:
                    if kw.get("do_sample") or float(kw.get("temperature", 0.0) or 0.0) > 0:
                        raise EvalError(
                            "the oscar model type decodes greedily; this task asks for sampling",
                            hint="set do_sample: false / temperature: 0 in the task's generation_kwargs",
                        )
                max_new = max(int(kw.get("max_gen_toks", self.max_gen_toks)) for kw in kwargs)
                rows = [self.tok_encode(req.args[0])[-(self.max_length - max_new) :] for req in batch]
                ids, mask = left_pad(rows, self._pad_id(), self._device)
                gens = greedy_generate(self.loaded.model, session.new_cache(), ids, mask, max_new, eos, self.chunk_size)
                for req, kw, gen in zip(batch, kwargs, gens, strict=True):
                    limit = int(kw.get("max_gen_toks", self.max_gen_toks))
                    text = self.tokenizer.decode(gen[:limit], skip_special_tokens=True)
                    until = kw.get("until") or []
                    for stop in [until] if isinstance(until, str) else until:
                        if stop:
                            text = text.split(stop)[0]
                    out.append(text)
                    self.cache_hook.add_partial("generate_until", req.args, text)
        return out


def register() -> None:
    """Register the ``oscar`` model type with lm-eval (its own model types are imported first)."""
    import lm_eval.models  # noqa: F401  (fills lm-eval's registry; an already non-empty one would skip them)
    from lm_eval.api.registry import model_registry, register_model

    if MODEL_TYPE not in model_registry.keys():
        register_model(MODEL_TYPE)(OscarLM)


register()


def main() -> None:
    """``oscar-lm-eval``: lm-eval's command line with the ``oscar`` model type registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
