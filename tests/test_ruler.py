"""RULER NIAH generators (exact templates, answers, haystacks, depth, length fitting) and scoring."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.evaldata import prose
from helpers.tiny import CharTokenizer

from oscar_cli.errors import EvalError
from oscar_cli.eval.niah import (
    DEPTHS,
    NOISE,
    TASK_NAMES,
    TASKS,
    TOKENS_TO_GENERATE,
    PromptBuilder,
    fit_haystack,
    load_essay_words,
    make_sample,
    parse_tasks,
    split_sentences,
)
from oscar_cli.eval.scoring import match_all, postprocess, string_match_all

pytestmark = pytest.mark.unit

NUM = re.compile(r"^\d{7}$")
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
WORD = re.compile(r"^[A-Za-z][A-Za-z'.]*-[A-Za-z][A-Za-z'.]*$")


@pytest.fixture(scope="module")
def essay(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return load_essay_words(prose(tmp_path_factory.mktemp("prose")))


def sample(task: str, essay: list[str], length: int = 2048, index: int = 0):
    b = PromptBuilder(CharTokenizer())
    n = fit_haystack(TASKS[task], length, b, essay, 42)
    return make_sample(task, length, index, n, b, essay), b


def test_task_table_matches_ruler() -> None:
    assert TASK_NAMES == (
        "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
        "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery",
    )  # fmt: skip
    t = {n: (x.haystack, x.type_k, x.type_v, x.num_k, x.num_v, x.num_q) for n, x in TASKS.items()}
    assert t["niah_single_1"] == ("noise", "words", "numbers", 1, 1, 1)
    assert t["niah_single_3"] == ("essay", "words", "uuids", 1, 1, 1)
    assert t["niah_multikey_2"] == ("needle", "words", "numbers", 1, 1, 1)
    assert t["niah_multikey_3"] == ("needle", "uuids", "uuids", 1, 1, 1)
    assert t["niah_multivalue"] == ("essay", "words", "numbers", 1, 4, 1)
    assert t["niah_multiquery"] == ("essay", "words", "numbers", 4, 1, 4)
    assert DEPTHS[:4] == [0, 3, 5, 8] and DEPTHS[-1] == 100 and len(DEPTHS) == 40


def test_single_needle_template_is_singularised_exactly(essay: list[str]) -> None:
    (s, _ids), _b = sample("niah_single_1", essay)
    (key,) = re.findall(r"for (\S+) mentioned", s.text)
    assert WORD.match(key)
    assert s.text.startswith(
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\n"
    )
    assert s.text.endswith(f"\nWhat is the special magic number for {key} mentioned in the provided text?")
    assert s.answer_prefix == f" The special magic number for {key} mentioned in the provided text is"
    (value,) = s.answers
    assert NUM.match(value)
    assert f"One of the special magic numbers for {key} is: {value}." in s.text.split("\n")
    context = s.text.split("\n")[1:-1]
    assert sum(line == NOISE for line in context) == len(context) - 1  # noise haystack, one line per sentence


def test_multivalue_and_multiquery_templates_and_answers(essay: list[str]) -> None:
    (mv, _), _ = sample("niah_multivalue", essay)
    (key,) = re.findall(r"for (\S+) mentioned", mv.text)
    assert mv.text.startswith("Some special magic numbers are hidden within the following text.")
    assert mv.text.endswith(f"What are all the special magic numbers for {key} mentioned in the provided text?")
    assert mv.answer_prefix.endswith("mentioned in the provided text are")
    assert len(mv.answers) == 4 and all(
        f"One of the special magic numbers for {key} is: {v}." in mv.text for v in mv.answers
    )
    (mq, _), _ = sample("niah_multiquery", essay)
    query = re.search(r"numbers for (.+) mentioned in the provided text\?$", mq.text).group(1)
    keys = re.match(r"^(\S+), (\S+), (\S+), and (\S+)$", query).groups()
    assert len(mq.answers) == 4
    for k, v in zip(keys, mq.answers, strict=True):
        assert f"One of the special magic numbers for {k} is: {v}." in mq.text


def test_uuid_keys_values_and_needle_haystack(essay: list[str]) -> None:
    (s, _), _ = sample("niah_multikey_3", essay)
    (key,) = re.findall(r"for (\S+) mentioned", s.text)
    assert UUID.match(key) and UUID.match(s.answers[0])
    lines = s.text.split("\n")[1:-1]
    assert len(lines) > 3 and all(line.startswith("One of the special magic uuids for ") for line in lines)
    assert sum(key in line for line in lines) == 1  # distractors carry other keys
    (s3, _), _ = sample("niah_single_3", essay)
    assert UUID.match(s3.answers[0]) and "special magic uuid for" in s3.text


def test_essay_depths_and_multikey_distractors(essay: list[str]) -> None:
    (s, _), _ = sample("niah_multikey_1", essay)
    assert len(s.depths) == 4 and all(d in DEPTHS for d in s.depths)
    assert s.text.count("One of the special magic number") == 4  # 1 queried + 3 distractor needles
    assert "The river near the garden" in s.text


def test_length_fitting_and_determinism(essay: list[str]) -> None:
    for task in ("niah_single_1", "niah_single_2", "niah_multikey_2"):
        (s, ids), b = sample(task, essay, length=3000)
        assert len(ids) + TOKENS_TO_GENERATE <= 3000
        assert len(ids) + TOKENS_TO_GENERATE > 3000 - 160  # filled to within one step (50 words / 1 line)
        (again, ids2), _ = sample(task, essay, length=3000)
        assert again == s and ids2 == ids
        (other, _), _ = sample(task, essay, length=3000, index=1)
        assert other.answers != s.answers


def test_task_names_and_missing_essay() -> None:
    assert parse_tasks("all") == list(TASK_NAMES)
    with pytest.raises(EvalError, match="valid tasks: niah_single_1"):
        parse_tasks("niah_single_9")
    words = load_essay_words(None)  # the shipped public-domain books
    assert 70_000 < len(words) and words[:3] == ["ALICE'S", "ADVENTURES", "IN"]


def test_sentence_splitter() -> None:
    assert split_sentences("It rained. Then it stopped! Did it? Yes.") == [
        "It rained.",
        "Then it stopped!",
        "Did it?",
        "Yes.",
    ]


def test_string_match_all_like_ruler() -> None:
    assert postprocess("  a\tb\x01c \n") == "a\nb\nc"
    assert match_all("The numbers are 123 and 456", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert match_all("ABC-def", ["abc-DEF"]) == 1.0
    assert string_match_all(["abc 123", "x"], [["123", "456"], ["x"]]) == 75.0


def test_chat_template_wraps_task_text() -> None:
    class ChatTok(CharTokenizer):
        chat_template = "x"

        def apply_chat_template(self, msgs, tokenize: bool, add_generation_prompt: bool) -> str:
            assert not tokenize and add_generation_prompt
            return f"<user>{msgs[0]['content']}</user><assistant>"

    b = PromptBuilder(ChatTok())
    assert b.prompt("Q?", " A is") == "<user>Q?</user><assistant> A is"


def test_prose_file_is_used(tmp_path: Path) -> None:
    words = load_essay_words(prose(tmp_path))
    assert words[:3] == ["The", "river", "near"]


@pytest.mark.parametrize(("partial", "legend"), [(False, False), (True, True)])
def test_heatmap_legend_only_when_a_cell_is_marked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, partial: bool, legend: bool
) -> None:
    import matplotlib.figure

    from oscar_cli.eval.heatmap import plot_heatmap

    titles: list[str] = []
    original = matplotlib.figure.Figure.suptitle
    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle", lambda self, t, **kw: titles.append(t) or original(self, t, **kw))
    tasks, lengths, methods = ["niah_single_1"], [1024, 2048], ["bf16", "oscar"]
    scores = {m: {t: {L: 50.0 for L in lengths} for t in tasks} for m in methods}
    counts = {m: {t: {L: 4 if (partial and L == 2048 and m == "oscar") else 8 for L in lengths} for t in tasks} for m in methods}
    path = plot_heatmap(scores, tasks, lengths, methods, tmp_path / "h.png", "tiny", counts, 8)
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert titles and titles[0].startswith("RULER NIAH — tiny")
    assert ("fewer samples than asked" in titles[0]) is legend


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_multikey_3"])
@pytest.mark.parametrize("length", [1000, 3000, 6000])
def test_fit_is_the_largest_size_that_fits(essay: list[str], task: str, length: int) -> None:
    """The regula-falsi fit returns what an exhaustive scan over the step grid returns."""
    from oscar_cli.eval.niah import TOKENS_TO_GENERATE, _increment, _render, _sample_rng

    b = PromptBuilder(CharTokenizer())
    n = fit_haystack(TASKS[task], length, b, essay, 42)
    step = _increment(TASKS[task], length)

    def fits(units: int) -> bool:
        text, prefix, _, _ = _render(TASKS[task], units * step, _sample_rng(42, task, length, 0), essay)
        return b.count(text, prefix) <= length - TOKENS_TO_GENERATE

    assert fits(n // step) and not fits(n // step + 1)


def test_batched_samples_equal_one_by_one(essay: list[str]) -> None:
    from oscar_cli.eval.niah import make_samples

    b = PromptBuilder(CharTokenizer())
    n = fit_haystack(TASKS["niah_multivalue"], 2048, b, essay, 42)
    many = make_samples("niah_multivalue", 2048, [0, 3, 5], n, b, essay)
    assert [s for s, _ in many] == [make_sample("niah_multivalue", 2048, i, n, b, essay)[0] for i in (0, 3, 5)]


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_bpe(essay: list[str], add_prefix_space: bool = False, chat: bool = True, as_gguf_517: bool = False):
    """A small byte-level BPE (GPT-2 regex) trained on the prose, as a transformers fast tokenizer; ``as_gguf_517``:
    configured as transformers 5.17 converts the embedded SmolLM2's GGUF (an empty normalizer ``Sequence``,
    ``trim_offsets`` off, BPE with an unknown token, ``fuse_unk`` and ``byte_fallback``)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>", fuse_unk=True, byte_fallback=True) if as_gguf_517 else
                    models.BPE())  # fmt: skip
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, trim_offsets=not as_gguf_517)
    if as_gguf_517:
        tok.normalizer = normalizers.Sequence([])
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"] if as_gguf_517 else ["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([" ".join(essay[i : i + 200]) for i in range(0, len(essay), 200)] + [NOISE], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    if chat:
        fast.chat_template = CHATML
    return fast


@pytest.mark.parametrize(
    ("chat", "as_gguf_517"), [(True, False), (False, False), (True, True)], ids=["chat-template", "plain", "gguf-5.17"]
)
@pytest.mark.parametrize("task", TASK_NAMES)
def test_piecewise_prompt_ids_equal_whole_tokenization(essay: list[str], task: str, chat: bool, as_gguf_517: bool) -> None:
    """Tokenizing the haystack's pieces once each gives, for every sample, the ids of tokenizing its prompt whole."""
    from oscar_cli.eval.niah import make_samples

    tok = _byte_level_bpe(essay, chat=chat, as_gguf_517=as_gguf_517)
    fast, whole = PromptBuilder(tok), PromptBuilder(tok, piecewise=False)
    assert fast.piecewise and not whole.piecewise and fast.chat is chat
    n = fit_haystack(TASKS[task], 3000, fast, essay, 42)
    assert n == fit_haystack(TASKS[task], 3000, whole, essay, 42)
    got = make_samples(task, 3000, [0, 1, 2, 7], n, fast, essay)
    assert got == make_samples(task, 3000, [0, 1, 2, 7], n, whole, essay)
    assert all(ids == whole.ids(whole.prompt(s.text, s.answer_prefix)) for s, ids in got)
    assert fast._pieces  # the pieces were memoised, not the whole prompt tokenized


def test_piecewise_only_where_the_tokenizer_splits_there(essay: list[str]) -> None:
    from tokenizers import normalizers

    assert not PromptBuilder(CharTokenizer()).piecewise  # not a fast tokenizer
    assert not PromptBuilder(_byte_level_bpe(essay, add_prefix_space=True)).piecewise
    tok = _byte_level_bpe(essay)
    tok.backend_tokenizer.normalizer = normalizers.Lowercase()
    assert not PromptBuilder(tok).piecewise
    tok.backend_tokenizer.normalizer = normalizers.Sequence([normalizers.Lowercase()])  # only an empty one runs none
    assert not PromptBuilder(tok).piecewise
    tok.backend_tokenizer.normalizer = normalizers.Sequence([])
    assert PromptBuilder(tok).piecewise
    b = PromptBuilder(_byte_level_bpe(essay))
    text = "a b <|im_end|> c d"  # an added token inside the text: tokenized whole
    assert b._split(text, " e") is None and b.prompt_ids(text, " e") == b.ids(b.prompt(text, " e"))


@pytest.mark.slow
@pytest.mark.parametrize("task", TASK_NAMES)
def test_piecewise_equals_whole_on_the_embedded_tokenizer(task: str) -> None:
    """The embedded SmolLM2 tokenizer: the piecewise ids of every sample are those of the whole prompt."""
    from transformers import AutoTokenizer

    from oscar_cli.eval.niah import make_samples
    from oscar_cli.model.load import model_directory

    tok = AutoTokenizer.from_pretrained(model_directory())
    essay = load_essay_words(None)
    fast, whole = PromptBuilder(tok), PromptBuilder(tok, piecewise=False)
    assert fast.piecewise
    n = fit_haystack(TASKS[task], 8192, fast, essay, 42)
    assert n == fit_haystack(TASKS[task], 8192, whole, essay, 42)
    assert make_samples(task, 8192, [0, 1, 2], n, fast, essay) == make_samples(task, 8192, [0, 1, 2], n, whole, essay)
