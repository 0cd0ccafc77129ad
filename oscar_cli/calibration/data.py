"""Calibration tokens: self-generated, local files, or a Hugging Face dataset, packed into sequences.

Sources (recipe ``data.source`` or ``oscar calibrate --data``):

- ``self`` (offline default): the model continues a fixed set of diverse seed prompts (chat template when the
  tokenizer has one), batched, with sampling seeded by ``data.seed``; prompt + generated tokens form the
  documents. Tokens/s of the generation is reported separately.
- a local ``.txt``/``.md`` file, a ``.json``/``.jsonl`` file (objects with ``data.text_field``, or strings), or a
  folder of such files (sorted, recursive).
- ``hf:<dataset id>[:<config>]`` through ``datasets`` (imported lazily; offline and not cached is an error).
- ``random`` (library/benchmarks only): uniform token ids.

Documents are concatenated (EOS between them when the tokenizer has one) and cut into ``[N, seq_len]``.
The identity recorded in the manifest: ``source``, ``sha256`` (of the int32 token ids actually used),
``tokens``, ``sequences``, ``seq_len``, plus ``files_sha256`` for local files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from oscar_cli.errors import CalibrationError, MissingDependencyError
from oscar_cli.recipe import DataConfig

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".rst")
JSON_SUFFIXES = (".json", ".jsonl")

SEED_PROMPTS = (
    "Explain how a hash table handles collisions, with a short Python example.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Summarise the causes and consequences of the French Revolution.",
    "What is the difference between mitosis and meiosis? Answer step by step.",
    "Solve: a train leaves at 3 pm travelling 80 km/h; another leaves at 4 pm at 100 km/h. When does it catch up?",
    "Write a SQL query that finds the top five customers by total order value, and explain it.",
    "Describe the water cycle to a ten-year-old.",
    "List the pros and cons of remote work for a small software company.",
    "Translate into French and explain the grammar: 'I would have come if you had called me.'",
    "Write a haiku sequence about autumn in a big city.",
    "How does public-key cryptography work? Include a toy RSA example with small numbers.",
    "Draft a polite email asking a landlord to fix a broken heater.",
    "Compare the economic policies of Keynes and Hayek in a short essay.",
    "Give a recipe for a vegetarian lasagne with a shopping list.",
    "Prove that the square root of two is irrational.",
    "Explain the rules of chess castling and en passant with examples.",
)


@dataclass
class CalibrationData:
    """Packed calibration tokens.

    Attributes:
        sequences: int64 ``[N, seq_len]`` (statistics sequences first, held-out ones last).
        identity: manifest ``data`` entry (source, sha256, tokens, sequences, seq_len, ...).
        seconds: time spent producing the tokens (generation or reading + tokenizing).
        generated_tokens: new tokens generated (``self`` source), else 0.
    """

    sequences: torch.Tensor
    identity: dict[str, Any]
    seconds: float = 0.0
    generated_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 and self.generated_tokens else 0.0


def token_sha256(ids: torch.Tensor) -> str:
    """sha256 of token ids as little-endian int32 bytes (stable across platforms and dtypes)."""
    return hashlib.sha256(ids.to(torch.int32).contiguous().cpu().numpy().astype("<i4").tobytes()).hexdigest()


def pack(documents: list[list[int]], seq_len: int, n_seq: int, eos: int | None) -> torch.Tensor:
    """Concatenate documents (``eos`` between them) and cut ``n_seq`` rows of ``seq_len``: int64 ``[n_seq, seq_len]``.

    Raises CalibrationError if there are too few tokens.
    """
    stream: list[int] = []
    need = n_seq * seq_len
    for doc in documents:
        stream.extend(doc)
        if eos is not None:
            stream.append(eos)
        if len(stream) >= need:
            break
    if len(stream) < need:
        raise CalibrationError(
            f"the calibration data holds {len(stream)} tokens, fewer than the {need} asked for",
            hint="lower --tokens, or give more text with --data",
        )
    return torch.tensor(stream[:need], dtype=torch.int64).view(n_seq, seq_len)


def _texts_from_json(path: Path, text_field: str) -> Iterator[str]:
    raw = path.read_text(encoding="utf-8")
    items: list[Any]
    if path.suffix == ".jsonl":
        items = [json.loads(line) for line in raw.splitlines() if line.strip()]
    else:
        data = json.loads(raw)
        items = data if isinstance(data, list) else [data]
    for item in items:
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict) and isinstance(item.get(text_field), str):
            yield item[text_field]
        else:
            raise CalibrationError(f"{path}: an entry has no string field {text_field!r}",
                                   hint="set data.text_field in the recipe to the field holding the text")


def check_source(source: str) -> None:
    """Raise CalibrationError when ``source`` names a local file or folder that does not exist (checked before
    any budget or model work, so the first error is the one to fix)."""
    if source in ("self", "random") or source.startswith("hf:"):
        return
    if not Path(source).expanduser().exists():
        raise CalibrationError(f"calibration data {source} not found",
                               hint="use self, a text/JSON(L) file or folder, or hf:<dataset id>")


def local_texts(source: str, text_field: str) -> tuple[list[str], dict[str, Any]]:
    """Texts from a file or folder, and their identity (``files``, ``files_sha256`` over sorted bytes)."""
    check_source(source)
    root = Path(source).expanduser()
    suffixes = TEXT_SUFFIXES + JSON_SUFFIXES
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in suffixes) if root.is_dir() else [root]
    if not files:
        raise CalibrationError(f"{source}: no {', '.join(suffixes)} files found")
    h = hashlib.sha256()
    texts: list[str] = []
    skipped: list[str] = []
    for f in files:
        try:
            if f.suffix in JSON_SUFFIXES:
                found = list(_texts_from_json(f, text_field))
            else:
                found = [f.read_text(encoding="utf-8")]
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CalibrationError(f"{f}: cannot read it as text/JSON ({exc.__class__.__name__})") from None
        except CalibrationError:
            if not root.is_dir():
                raise
            # inside a folder, a JSON file without the text field is data, not text: skip it, loudly
            logger.warning("skipping %s: no string field %r in its entries", f, text_field)
            skipped.append(str(f.relative_to(root)))
            continue
        h.update(f.read_bytes())
        texts.extend(found)
    if not texts:
        raise CalibrationError(f"{source}: no text found (JSON files need the field {text_field!r})")
    ident: dict[str, Any] = {"files": len(files) - len(skipped), "files_sha256": h.hexdigest()}
    if skipped:
        ident["skipped_files"] = skipped
    return texts, ident


def hf_texts(source: str, cfg: DataConfig, need_tokens: int, tokenizer: Any) -> tuple[list[str], dict[str, Any]]:
    """Texts from ``hf:<id>[:<config>]`` until roughly ``need_tokens`` tokens (streamed from the local cache)."""
    try:
        import datasets
    except ImportError:
        raise MissingDependencyError("the hf: data source needs the datasets package",
                                     hint="pip install datasets, or use --data self / a local file") from None
    spec = source.removeprefix("hf:")
    name, _, config = spec.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split=cfg.hf_split)
    except Exception as exc:  # offline/not cached, unknown id, bad split: datasets raises many types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise CalibrationError(
            f"cannot load the dataset {name!r} (split {cfg.hf_split!r}): {first}",
            hint="when offline the dataset must already be in the HF datasets cache; or use --data self / a file",
        ) from None
    if cfg.text_field not in ds.column_names:
        raise CalibrationError(f"dataset {name!r} has no column {cfg.text_field!r} ({', '.join(ds.column_names)})",
                               hint="set data.text_field in the recipe")
    texts, total = [], 0
    for row in ds:
        text = row[cfg.text_field]
        if isinstance(text, str) and text.strip():
            texts.append(text)
            total += len(text) // 3  # rough: tokenized exactly below
            if total >= 2 * need_tokens:
                break
    return texts, {"dataset": name, "config": config or None, "split": cfg.hf_split,
                   "fingerprint": getattr(ds, "_fingerprint", None)}


def _prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(prompt)["input_ids"]]


@torch.inference_mode()
def generate_documents(
    model: Any, tokenizer: Any, cfg: DataConfig, need_tokens: int, device: torch.device,
    on_tokens: Callable[[int], None] | None = None,
) -> tuple[list[list[int]], int]:
    """Self-generated documents (prompt + continuation token ids) until ``need_tokens`` in total.

    Without a tokenizer, prompts are 16 random token ids each. Returns ``(documents, new_tokens_generated)``.
    """
    gen = torch.Generator().manual_seed(cfg.seed)
    vocab = int(model.config.get_text_config().vocab_size)
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    pad = (getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None)
    pad = pad if pad is not None else (eos if eos is not None else 0)
    docs: list[list[int]] = []
    total, new_total, round_ = 0, 0, 0
    while total < need_tokens:
        if round_ >= 64:
            raise CalibrationError("self-generation stalled: the model keeps stopping immediately",
                                   hint="use --data with a text file or folder")
        bsz = cfg.gen_batch_size
        if tokenizer is not None:
            prompts = [_prompt_ids(tokenizer, SEED_PROMPTS[(round_ * bsz + i) % len(SEED_PROMPTS)])
                       for i in range(bsz)]
        else:
            prompts = torch.randint(0, vocab, (bsz, 16), generator=gen).tolist()
        width = max(len(p) for p in prompts)
        ids = torch.full((bsz, width), pad, dtype=torch.int64)
        mask = torch.zeros(bsz, width, dtype=torch.int64)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        remaining = need_tokens - total - sum(len(p) for p in prompts)
        new = max(8, min(cfg.gen_max_new_tokens, math.ceil(max(remaining, 0) / bsz) + 8))
        torch.manual_seed(cfg.seed + round_)
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new // 2,
            do_sample=cfg.gen_temperature > 0, temperature=cfg.gen_temperature or None, top_p=cfg.gen_top_p,
            pad_token_id=pad, eos_token_id=eos,
        ).cpu()
        for i, p in enumerate(prompts):
            cont = out[i, width:].tolist()
            if eos is not None and eos in cont:
                cont = cont[: cont.index(eos)]
            docs.append(list(p) + cont)
            total += len(p) + cont.__len__() + (1 if eos is not None else 0)
            new_total += len(cont)
        if on_tokens:
            on_tokens(min(total, need_tokens))
        round_ += 1
    return docs, new_total


def prepare_data(
    source: str, cfg: DataConfig, *, model: Any, tokenizer: Any, device: torch.device, n_seq: int,
    on_tokens: Callable[[int], None] | None = None,
) -> CalibrationData:
    """Produce ``n_seq`` packed sequences of ``cfg.seq_len`` tokens from ``source`` (see module docstring)."""
    t0 = time.perf_counter()
    need = n_seq * cfg.seq_len
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    generated = 0
    ident: dict[str, Any] = {"source": source}
    if source == "self":
        docs, generated = generate_documents(model, tokenizer, cfg, need, device, on_tokens)
        ident.update({"seed_prompts": len(SEED_PROMPTS), "seed": cfg.seed, "temperature": cfg.gen_temperature,
                      "top_p": cfg.gen_top_p})
    elif source == "random":
        vocab = int(model.config.get_text_config().vocab_size)
        g = torch.Generator().manual_seed(cfg.seed)
        docs = [torch.randint(0, vocab, (need,), generator=g).tolist()]
        ident["seed"] = cfg.seed
        eos = None
    else:
        if tokenizer is None:
            raise CalibrationError(f"data source {source!r} needs a tokenizer, and the model has none")
        if source.startswith("hf:"):
            texts, extra = hf_texts(source, cfg, need, tokenizer)
        else:
            texts, extra = local_texts(source, cfg.text_field)
        ident.update(extra)
        docs = []
        total = 0
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            docs.append([int(i) for i in ids])
            total += len(ids) + 1
            if on_tokens:
                on_tokens(min(total, need))
            if total >= need:
                break
    seqs = pack(docs, cfg.seq_len, n_seq, eos)
    ident.update({"sha256": token_sha256(seqs), "tokens": int(seqs.numel()), "sequences": n_seq,
                  "seq_len": cfg.seq_len})
    seconds = time.perf_counter() - t0
    if generated:
        ident["generated_tokens"] = generated
    return CalibrationData(seqs, ident, seconds, generated)
