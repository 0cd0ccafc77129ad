"""RULER's eight needle-in-a-haystack tasks (NVIDIA/RULER ``scripts/synthetic.yaml`` + ``data/synthetic/niah.py``).

Reproduced from RULER's published task definitions (no code copied):

- **templates**: the task template and answer prefix of ``constants.py``; with one queried value
  (``num_q · num_v == 1``) the text is singularised ('Some' -> 'A', 'are all' -> 'is', 'are' -> 'is', and
  the plural "s" of the value type is dropped), as RULER does over template + answer prefix;
- **needles**: ``One of the special magic {type_v} for {key} is: {value}.`` (plural type);
- **key/value types**: ``numbers`` (random 7-digit), ``words`` (``adjective-noun`` from the wonderwords
  lists RULER uses; drawn as a uniform (adjective, noun) pair), ``uuids`` (uuid4 from the sample's RNG);
- **haystacks**: ``noise`` (RULER's repeated five sentences, one per line), ``needle`` (distractor needles
  with random keys and values, one per line), ``essay`` (prose, whitespace-split into words: RULER's Paul
  Graham essays are not redistributable, so by default two public-domain books shipped with oscar
  (``oscar_cli/eval/haystack``, ~105K tokens, repeated for longer haystacks as RULER repeats its essays), or
  the ``.txt`` files of ``--haystack-dir``);
- **depth**: essay — needles inserted at sentence boundaries at depths drawn from
  ``round(linspace(0, 100, 40))`` without replacement; noise/needle — random line indices;
- **length fitting**: the haystack size is binary-searched so that ``tokens(prompt) + 128 <= length``
  (resolution 50 words for essay, 1 line for noise/needle — finer than RULER's 500/25 so short lengths are
  filled), then reduced per sample if a sample overflows;
- **chat template**: for instruct models the task text is the user turn of the tokenizer's chat template
  (generation prompt added) and the answer prefix follows it, as RULER appends ``answer_prefix`` to the input.

Every sample has its own RNG seeded by ``(seed, task, length, index)``: sample ``i`` is the same whatever
``--samples`` is, which makes runs resumable and comparable.
"""

from __future__ import annotations

import random
import re
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np

from oscar_cli.errors import EvalError

Haystack = Literal["noise", "essay", "needle"]
ValueType = Literal["numbers", "words", "uuids"]

TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
TOKENS_TO_GENERATE = 128
DEPTHS: list[int] = np.round(np.linspace(0, 100, 40)).astype(int).tolist()  # RULER's essay depths (%)


@dataclass(frozen=True)
class NiahTask:
    """One RULER NIAH task: haystack kind, key/value types and needle counts."""

    name: str
    haystack: Haystack
    type_k: ValueType
    type_v: ValueType
    num_k: int
    num_v: int
    num_q: int


TASKS: dict[str, NiahTask] = {
    t.name: t
    for t in (
        NiahTask("niah_single_1", "noise", "words", "numbers", 1, 1, 1),
        NiahTask("niah_single_2", "essay", "words", "numbers", 1, 1, 1),
        NiahTask("niah_single_3", "essay", "words", "uuids", 1, 1, 1),
        NiahTask("niah_multikey_1", "essay", "words", "numbers", 4, 1, 1),
        NiahTask("niah_multikey_2", "needle", "words", "numbers", 1, 1, 1),
        NiahTask("niah_multikey_3", "needle", "uuids", "uuids", 1, 1, 1),
        NiahTask("niah_multivalue", "essay", "words", "numbers", 1, 4, 1),
        NiahTask("niah_multiquery", "essay", "words", "numbers", 4, 1, 4),
    )
}
TASK_NAMES: tuple[str, ...] = tuple(TASKS)


@dataclass(frozen=True)
class NiahSample:
    """One generated sample: the task text, the answer prefix and the expected answers."""

    task: str
    length: int
    index: int
    text: str
    answer_prefix: str
    answers: tuple[str, ...]
    depths: tuple[float, ...]


def parse_tasks(text: str | list[str]) -> list[str]:
    """``"niah_single_1,niah_multikey_2"`` (or ``all``) -> task names; unknown names list the valid ones."""
    items = text.split(",") if isinstance(text, str) else [p for t in text for p in t.split(",")]
    names = [i.strip() for i in items if i.strip()]
    if not names or names == ["all"]:
        return list(TASK_NAMES)
    bad = [n for n in names if n not in TASKS]
    if bad:
        raise EvalError(f"unknown task {bad[0]!r}; valid tasks: {', '.join(TASK_NAMES)}")
    return list(dict.fromkeys(names))


@lru_cache(maxsize=1)
def _word_lists() -> tuple[list[str], list[str]]:
    import importlib.resources as res

    try:
        assets = res.files("wonderwords.assets")
        adjs = assets.joinpath("adjectivelist.txt").read_text().split()
        nouns = assets.joinpath("nounlist.txt").read_text().split()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        from oscar_cli.errors import MissingDependencyError

        raise MissingDependencyError(
            "RULER word keys need the wonderwords word lists", hint="pip install wonderwords"
        ) from exc
    return adjs, nouns


def random_value(kind: ValueType, rng: random.Random) -> str:
    """A RULER key or value: 7-digit number, ``adjective-noun`` word, or uuid4."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        adjs, nouns = _word_lists()
        return f"{rng.choice(adjs)}-{rng.choice(nouns)}"
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


_SENT_RE = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]*[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Regex sentence splitter (offline stand-in for NLTK ``sent_tokenize``)."""
    return [s for s in _SENT_RE.split(text.strip()) if s]


def haystack_files(haystack_dir: str | Path) -> list[Path]:
    """The ``*.txt`` files under ``haystack_dir`` (sorted); one line when it is missing, a file, or has none."""
    root = Path(haystack_dir).expanduser()
    if not root.exists():
        raise EvalError(f"--haystack-dir {root}: no such folder", hint="point it at a folder of prose .txt files")
    if not root.is_dir():
        raise EvalError(f"--haystack-dir {root} is a file, not a folder", hint="put the .txt file in a folder of its own")
    files = sorted(p for p in root.rglob("*.txt") if p.is_file())
    if not files:
        raise EvalError(f"--haystack-dir {root}: no .txt files found", hint="point it at a folder of prose .txt files")
    return files


def shipped_haystack() -> list[str]:
    """The texts of the public-domain books shipped as package data (``oscar_cli/eval/haystack``; README there)."""
    import importlib.resources as res

    root = res.files("oscar_cli.eval").joinpath("haystack")
    books = sorted((f for f in root.iterdir() if f.name.endswith(".txt")), key=lambda f: f.name)
    return [f.read_text(encoding="utf-8") for f in books]


def essay_digest(words: list[str]) -> str:
    """The identity of an essay haystack: ``sha256:`` and 16 hex digits of its words joined by single spaces
    (what the prompts are built from, so file names and line breaks do not enter)."""
    import hashlib

    return "sha256:" + hashlib.sha256(" ".join(words).encode("utf-8")).hexdigest()[:16]


def load_essay_words(haystack_dir: str | Path | None) -> list[str]:
    """Whitespace-split words of every ``*.txt`` under ``haystack_dir`` (sorted by name), or of the shipped
    public-domain books when ``haystack_dir`` is None."""
    if haystack_dir is None:
        texts, where = shipped_haystack(), "the shipped haystack"
    else:
        from oscar_cli.eval.prepare import read_text_file

        texts = [read_text_file(f, "--haystack-dir file") for f in haystack_files(haystack_dir)]
        where = f"--haystack-dir {haystack_dir}"
    words = " ".join(texts).split()
    if len(words) < 1000:
        raise EvalError(f"{where}: only {len(words)} words of prose; need at least 1000")
    return words


# Where a byte-level BPE tokenizer's pre-tokenizer always splits: a single space or newline between two
# non-whitespace characters starts a new pre-token (module docstring of PromptBuilder).
_PIECE_BOUNDARY = re.compile(r"(?<=\S)(?=[ \n]\S)")
_MAX_PIECES = 1_000_000  # memoised pieces kept (random needles never repeat; the memo is cleared past this)
_NO_NORMALIZER = {"type": "Sequence", "normalizers": []}  # runs no normalizer: the text unchanged


def _splits_exactly(tokenizer: Any, add_special_tokens: bool) -> bool:
    """True when ``tokenizer`` encodes text as the concatenation of its pieces split at :data:`_PIECE_BOUNDARY`.

    That holds for a fast tokenizer with no normalizer (or an empty ``Sequence`` of them, which runs none:
    transformers 5.17 converts the embedded SmolLM2's GGUF with one), the byte-level pre-tokenizer with the GPT-2
    regex and no prefix space, a BPE model without dropout (its other options act inside one pre-token), no added
    token containing whitespace, and no post-processor that adds tokens: the regex's alternatives (``'s``,
    `` ?\\p{L}+``, `` ?\\p{N}+``, `` ?[^\\s\\p{L}\\p{N}]+``, ``\\s+(?!\\S)``, ``\\s+``) take whitespace only at a
    pre-token's start or as a run of whitespace alone, so the pre-token before such a space ends at it and the
    match from it on does not depend on what precedes (no look-behind); BPE runs inside each pre-token. Any other
    configuration is tokenized whole.
    """
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not getattr(tokenizer, "is_fast", False) or backend is None:
        return False
    try:
        cfg = json.loads(backend.to_str())
    except Exception:
        return False
    pre, model, post = cfg.get("pre_tokenizer") or {}, cfg.get("model") or {}, cfg.get("post_processor")
    if cfg.get("normalizer") not in (None, _NO_NORMALIZER):
        return False
    if cfg.get("truncation") is not None or cfg.get("padding") is not None:
        return False
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    if {k: v for k, v in pre.items() if k != "trim_offsets"} != byte_level:  # trim_offsets: offsets only
        return False
    if model.get("type") != "BPE" or model.get("dropout") is not None:
        return False
    if any(re.search(r"\s", t.get("content", "")) for t in cfg.get("added_tokens", [])):
        return False
    adds_nothing = post is None or post.get("type") == "ByteLevel" or (
        post.get("type") == "TemplateProcessing" and post.get("single") == [{"Sequence": {"id": "A", "type_id": 0}}]
    )
    return adds_nothing or not add_special_tokens


class PromptBuilder:
    """Turns task text into the model's prompt (chat template for instruct models) and counts its tokens.

    A long prompt repeats its haystack's pieces (noise lines, essay words): where the tokenizer provably encodes
    a text as the concatenation of its pieces (:func:`_splits_exactly`, e.g. the embedded SmolLM2's), the task
    text is split at those boundaries, each distinct piece is tokenized once (memoised), and the ids are
    concatenated — the same ids as tokenizing the whole prompt, several times faster at 128K. The chat head and
    tail stay in the first and last piece; a text containing an added token is tokenized whole.
    """

    def __init__(self, tokenizer: Any, chat: bool | None = None, piecewise: bool = True) -> None:
        self.tokenizer = tokenizer
        has_template = bool(getattr(tokenizer, "chat_template", None))
        self.chat = has_template if chat is None else chat
        self.piecewise = piecewise and _splits_exactly(tokenizer, add_special_tokens=not self.chat)
        self._pieces: dict[str, list[int]] = {}
        self._added: list[str] = []
        if self.piecewise:
            self._added = [str(t) for t in getattr(tokenizer, "get_added_vocab", dict)() if t]

    def prompt(self, text: str, answer_prefix: str) -> str:
        if self.chat:
            head = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            return str(head) + answer_prefix
        return text + answer_prefix

    def ids(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=not self.chat)["input_ids"])

    def ids_many(self, prompts: list[str]) -> list[list[int]]:
        """:meth:`ids` of several prompts; one batched call for fast (Rust, multi-threaded) tokenizers."""
        if not getattr(self.tokenizer, "is_fast", False) or len(prompts) < 2:
            return [self.ids(p) for p in prompts]
        return [list(x) for x in self.tokenizer(prompts, add_special_tokens=not self.chat)["input_ids"]]

    def _split(self, text: str, answer_prefix: str) -> list[str] | None:
        """The prompt of ``text`` as pieces whose ids concatenate to the prompt's, or None (tokenize it whole)."""
        if not self.piecewise or any(t in text for t in self._added):
            return None
        prompt = self.prompt(text, answer_prefix)
        start = prompt.find(text)
        if start < 0:
            return None
        pieces = _PIECE_BOUNDARY.split(text)
        pieces[0] = prompt[:start] + pieces[0]
        pieces[-1] += prompt[start + len(text) :]
        return pieces

    def prompt_ids_many(self, items: list[tuple[str, str]]) -> list[list[int]]:
        """The ids of ``prompt(text, answer_prefix)`` for each item: piecewise where exact, else whole."""
        split = [self._split(text, prefix) for text, prefix in items]
        whole = [i for i, pieces in enumerate(split) if pieces is None]
        out: dict[int, list[int]] = dict(
            zip(whole, self.ids_many([self.prompt(*items[i]) for i in whole]), strict=True)
        )
        if len(self._pieces) > _MAX_PIECES:  # before this call's new pieces: a shrunk sample reuses its lines
            self._pieces.clear()
        new = list(dict.fromkeys(p for pieces in split if pieces is not None for p in pieces if p not in self._pieces))
        if new:  # the backend directly: a piece is short, and the wrapper's per-encoding conversion dominated
            encoded = self.tokenizer.backend_tokenizer.encode_batch(new, add_special_tokens=not self.chat)
            self._pieces.update(zip(new, (e.ids for e in encoded), strict=True))
        for i, pieces in enumerate(split):
            if pieces is not None:
                ids: list[int] = []
                for p in pieces:
                    ids += self._pieces[p]
                out[i] = ids
        return [out[i] for i in range(len(items))]

    def prompt_ids(self, text: str, answer_prefix: str) -> list[int]:
        return self.prompt_ids_many([(text, answer_prefix)])[0]

    def count(self, text: str, answer_prefix: str) -> int:
        return len(self.prompt_ids(text, answer_prefix))


def _sample_rng(seed: int, task: str, length: int, index: int) -> random.Random:
    return random.Random(f"ruler:{seed}:{task}:{length}:{index}")


def _render(
    task: NiahTask, n_hay: int, rng: random.Random, essay: list[str] | None
) -> tuple[str, str, tuple[str, ...], tuple[float, ...]]:
    """RULER's ``generate_input_output``: returns (task text, answer prefix, answers, needle depths in %)."""
    num_k = max(task.num_k, task.num_q)
    keys: list[str] = []
    values: list[list[str]] = []
    needles: list[str] = []
    for _ in range(num_k):
        keys.append(random_value(task.type_k, rng))
        vals = [random_value(task.type_v, rng) for _ in range(task.num_v)]
        values.append(vals)
        needles += [NEEDLE.format(type_needle_v=task.type_v, key=keys[-1], value=v) for v in vals]
    rng.shuffle(needles)
    depths: list[float] = []
    if task.haystack == "essay":
        assert essay is not None
        words = essay[:n_hay] if n_hay <= len(essay) else (essay * (n_hay // len(essay) + 1))[:n_hay]
        sents = split_sentences(" ".join(words))
        chosen = sorted(rng.sample(DEPTHS, len(needles)))
        cuts = [0] + [int(len(sents) * d / 100) for d in chosen] + [len(sents)]
        parts: list[str] = []
        for i in range(1, len(cuts)):
            parts.append(" ".join(sents[cuts[i - 1] : cuts[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(p for p in parts if p)
        depths = [float(d) for d in chosen]
    else:
        if task.haystack == "noise":
            lines = [NOISE] * n_hay
        else:
            lines = [
                NEEDLE.format(
                    type_needle_v=task.type_v, key=random_value(task.type_k, rng), value=random_value(task.type_v, rng)
                )
                for _ in range(n_hay)
            ]
        idx = sorted(rng.sample(range(n_hay), len(needles)), reverse=True)
        for i, needle in zip(idx, needles, strict=True):
            lines.insert(i, needle)
        context = "\n".join(lines)
        depths = sorted(100.0 * i / max(1, n_hay) for i in idx)
    chosen_keys = rng.sample(range(num_k), task.num_q)
    queries = [keys[i] for i in chosen_keys]
    answers = tuple(a for i in chosen_keys for a in values[i])
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, prefix, type_v = TEMPLATE, ANSWER_PREFIX, str(task.type_v)
    if task.num_q * task.num_v == 1:
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        prefix = prefix.replace("are", "is")
        type_v = type_v[:-1]
    text = template.format(type_needle_v=type_v, context=context, query=query)
    return text, prefix.format(type_needle_v=type_v, query=query), answers, tuple(depths)


def _increment(task: NiahTask, length: int) -> int:
    """Search resolution: 50 words (essay) or 1 line (noise/needle).

    RULER steps by 500 words / 25 lines (5 below 4K), which can leave hundreds of tokens of a short length
    unused; a finer step fills each length closer to its nominal size.
    """
    return 50 if task.haystack == "essay" else 1


def check_length(
    task: NiahTask, length: int, builder: PromptBuilder, essay: list[str] | None, seed: int, tokens: int | None = None
) -> None:
    """One line when ``length`` is too short for ``task``'s prompt with a one-step haystack (a short prompt to count:
    a run checks every length before its first batch); ``tokens``: that prompt's count when already known."""
    if tokens is None:
        text, prefix, _, _ = _render(task, _increment(task, length), _sample_rng(seed, task.name, length, 0), essay)
        tokens = builder.count(text, prefix)
    if tokens > length - TOKENS_TO_GENERATE:
        raise EvalError(f"{task.name}: a length of {length} tokens is too short for even a minimal haystack")


def fit_haystack(task: NiahTask, length: int, builder: PromptBuilder, essay: list[str] | None, seed: int) -> int:
    """Largest haystack size (words or lines, a multiple of the step) whose sample 0 fits ``length``.

    The prompt's token count grows almost linearly with the haystack size: the answer is bracketed from a
    proportional guess, then found by regula falsi (bisection for what is left), so a long length costs a few
    tokenizations of long prompts instead of a doubling search and a bisection over all of them. Under
    monotonic counts the result is the one a plain bisection gives.
    """
    step = _increment(task, length)
    budget = length - TOKENS_TO_GENERATE
    counted: dict[int, int] = {}

    def count(units: int) -> int:
        if units not in counted:
            text, prefix, _, _ = _render(task, units * step, _sample_rng(seed, task.name, length, 0), essay)
            counted[units] = builder.count(text, prefix)
        return counted[units]

    check_length(task, length, builder, essay, seed, count(1))
    lo, x = 1, 2  # lo fits; grow x from the tokens per unit seen so far until it does not
    while count(x) <= budget:
        lo = x
        per_unit = max(1e-9, (count(lo) - count(1)) / (lo - 1))
        x = max(lo + 1, int(1.02 * (budget - count(1)) / per_unit) + 2)
    hi = x
    for _ in range(6):  # regula falsi: the count is nearly linear in the size, so this lands on the boundary
        if hi - lo <= 1:
            break
        x = lo + int((budget - count(lo)) * (hi - lo) / max(1, count(hi) - count(lo)))
        x = min(max(x, lo + 1), hi - 1)
        lo, hi = (x, hi) if count(x) <= budget else (lo, x)
    while hi - lo > 1:  # bisection for whatever is left
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) <= budget else (lo, mid)
    return lo * step


def make_sample(
    task_name: str,
    length: int,
    index: int,
    n_hay: int,
    builder: PromptBuilder,
    essay: list[str] | None,
    seed: int = 42,
) -> tuple[NiahSample, list[int]]:
    """Sample ``index`` of ``task`` at ``length`` and its prompt token ids (haystack shrunk if it overflows)."""
    return make_samples(task_name, length, [index], n_hay, builder, essay, seed)[0]


def make_samples(
    task_name: str,
    length: int,
    indices: list[int],
    n_hay: int,
    builder: PromptBuilder,
    essay: list[str] | None,
    seed: int = 42,
) -> list[tuple[NiahSample, list[int]]]:
    """Samples ``indices`` of ``task`` at ``length`` with their prompt ids; the prompts of one haystack size are
    tokenized in one batch, and a sample that overflows is shrunk by one step at a time on its own."""
    task = TASKS[task_name]
    step = _increment(task, length)
    out: dict[int, tuple[NiahSample, list[int]]] = {}
    sizes = {i: n_hay for i in indices}
    while len(out) < len(indices):
        todo = [i for i in indices if i not in out]
        rendered = {i: _render(task, sizes[i], _sample_rng(seed, task_name, length, i), essay) for i in todo}
        prompt_ids = builder.prompt_ids_many([(rendered[i][0], rendered[i][1]) for i in todo])
        for i, ids in zip(todo, prompt_ids, strict=True):
            text, prefix, answers, depths = rendered[i]
            if len(ids) + TOKENS_TO_GENERATE <= length or sizes[i] <= step:
                out[i] = (NiahSample(task_name, length, i, text, prefix, answers, depths), ids)
            else:
                sizes[i] -= step
    return [out[i] for i in indices]
