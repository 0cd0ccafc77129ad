"""What a method's wrong RULER answers are: another needle's value, or a value that is in no needle (a chimera).

    python3 scripts/ruler_errors.py MODEL SAMPLES.jsonl[.gz]... [--tasks niah_multikey_2,niah_multikey_3]
        [--lengths 16384,32768] [--samples 25] [--seed 42] [--show 5] [--out F.json]

eval-ruler's samples files keep each answer but not its prompt. The prompts are rebuilt here with eval-ruler's own
generator (same tasks, lengths, sample indices and seed: a sample's text depends only on those and the tokenizer,
so MODEL only needs its tokenizer), and every record that scored below 100 is put in one class:

- ``partial``: every value it gave is an expected one, some are missing (multi-value tasks);
- ``other-needle``: it gave a value that appears in the prompt but is not an expected one (retrieval picked the
  wrong needle; BF16 makes this error too);
- ``garbled``: it gave a value found nowhere in the prompt whose nearest value there (by edit distance; an expected
  one on ties) is an expected one: the right needle, copied with errors;
- ``chimera``: it gave a value found nowhere in the prompt whose nearest value there is another needle's: the copy
  wandered from one needle's value into another's, or started from the wrong one; ``--show`` prints some garbled
  and chimera answers with that nearest value;
- ``no-answer``: no value of the task's type in the answer;
- ``prompt-differs``: the record's prompt length is not the rebuilt prompt's (another generator version, tokenizer
  or ``--haystack-dir``): not classified.

Printed per method, task and length as counts; ``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

NUMBER = re.compile(r"\d{7}")
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
WORD = re.compile(r"[a-z]+-[a-z]+")


def value_pattern(task: str) -> re.Pattern[str]:
    """The regex of the task's value type (RULER's NIAH: numbers, uuids, words)."""
    from oscar_cli.eval.niah import TASKS

    return {"numbers": NUMBER, "uuids": UUID, "words": WORD}[TASKS[task].type_v]


def edit_distance(a: str, b: str) -> int:
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def classify(pred: str, answers: list[str], text: str, pattern: re.Pattern[str]) -> tuple[str, str | None]:
    """``(class, the first value not in the prompt or None)`` for one answer that scored below 100: ``partial``,
    ``other-needle``, ``garbled``, ``chimera`` or ``no-answer`` (the module's docstring)."""
    given = pattern.findall(pred)
    if not given:
        return "no-answer", None
    wrong = [g for g in given if g not in answers]
    if not wrong:
        return "partial", None
    stray = next((g for g in wrong if g not in text), None)
    if stray is None:
        return "other-needle", None
    near = min(pattern.findall(text) or [""], key=lambda v: (edit_distance(stray, v), v not in answers))
    return ("garbled" if near in answers else "chimera"), stray


def method_label(record: dict[str, Any]) -> str:
    """The method, with its artifact's rotations digest when it has one (two oscar artifacts stay apart)."""
    m = re.search(r"rotations ([0-9a-f]+)", record.get("method_source", ""))
    return f"{record['method']}[{m.group(1)[:8]}]" if m else str(record["method"])


def tokenizer(ref: str) -> Any:
    """The tokenizer alone: a GGUF file's (transformers reads it from the GGUF) or a model folder's."""
    from transformers import AutoTokenizer

    path = Path(ref)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(path)


def read(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:  # type: ignore[operator]
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="the model whose tokenizer built the prompts: a GGUF file or a model folder")
    ap.add_argument("samples", nargs="+", type=Path, help="eval-ruler samples.jsonl files (.gz too)")
    ap.add_argument("--tasks", default="niah_multikey_2,niah_multikey_3")
    ap.add_argument("--lengths", default="16384,32768")
    ap.add_argument("--samples-per-cell", "--samples", dest="n", type=int, default=25)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--show", type=int, default=0, help="chimeras printed per method, task and length")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    from oscar_cli.eval.niah import parse_tasks
    from oscar_cli.eval.ruler import RulerConfig, build_samples

    tasks = parse_tasks(args.tasks)
    lengths = [int(x) for x in args.lengths.split(",")]
    tok = tokenizer(args.model)
    cfg = RulerConfig(lengths=lengths, tasks=tasks, methods=[], samples=args.n, seed=args.seed)
    texts = {(task, length): {s.index: (s.text, len(ids)) for s, ids in items}
             for (task, length), items in build_samples(cfg, tok).items()}

    counts: dict[str, Counter[str]] = defaultdict(Counter)
    shown: Counter[str] = Counter()
    seen: set[tuple[Any, ...]] = set()
    for path in args.samples:
        for r in read(path):
            key = (r["method"], r.get("method_source", ""), r["task"], r["length"], r["index"], r.get("rope", ""))
            cell = texts.get((r["task"], r["length"]))
            if cell is None or r["index"] not in cell or key in seen:
                continue
            seen.add(key)
            name = f"{method_label(r)}/{r['task']}/{r['length']}"
            text, n_ids = cell[r["index"]]
            if r.get("prompt_tokens", n_ids) != n_ids:  # another generator, tokenizer or haystack made this prompt
                counts[name]["prompt-differs"] += 1
                continue
            if r["score"] >= 100:
                counts[name]["ok"] += 1
                continue
            pattern = value_pattern(r["task"])
            kind, stray = classify(r["pred"], list(r["answers"]), text, pattern)
            counts[name][kind] += 1
            if stray is not None and shown[name] < args.show:
                shown[name] += 1
                near = min(pattern.findall(text), key=lambda v: edit_distance(stray, v))
                print(f"{name} #{r['index']}: gave {stray}, expected {r['answers'][0]}; nearest in the prompt "
                      f"{near} (distance {edit_distance(stray, near)}, to the expected "
                      f"{edit_distance(stray, r['answers'][0])})")
    classes = ("ok", "partial", "other-needle", "garbled", "chimera", "no-answer", "prompt-differs")
    print("| method / task / length | " + " | ".join(classes) + " |")
    print("|---|" + "---:|" * len(classes))
    for name in sorted(counts):
        print(f"| {name} | " + " | ".join(str(counts[name][c]) for c in classes) + " |")
    if args.out:
        args.out.write_text(json.dumps({k: dict(v) for k, v in sorted(counts.items())}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
