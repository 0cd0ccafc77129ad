"""scripts/ruler_paired.py: paired RULER differences over the samples every row has."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from helpers.scripts import load_script

pytestmark = pytest.mark.unit


def _write(path: Path, method: str, scores: dict[tuple[str, int, int], float], gz: bool = False) -> Path:
    lines = "".join(json.dumps({"method": method, "task": t, "length": n, "index": i, "score": s}) + "\n"
                    for (t, n, i), s in scores.items())
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(lines)
    else:
        path.write_text(lines)
    return path


def test_pairs_on_common_samples_with_standard_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rp = load_script("ruler_paired")
    base = {("a", 4096, 0): 100.0, ("a", 4096, 1): 0.0, ("b", 4096, 0): 50.0, ("a", 8192, 0): 0.0}
    other = {("a", 4096, 0): 100.0, ("a", 4096, 1): 100.0, ("b", 4096, 0): 100.0, ("b", 4096, 9): 0.0}
    f1 = _write(tmp_path / "one.jsonl.gz", "oscar", base, gz=True)
    f2 = _write(tmp_path / "two.jsonl", "bf16", other)
    assert rp.main([f"{f1}:oscar", f"{f2}:bf16"]) == 0
    out = capsys.readouterr().out
    assert "3 samples common to all 2 rows" in out  # (a, 8192, 0) and (b, 4096, 9) have no partner
    # differences 0, +100, +50: mean 50, s.e. sqrt(2500 / 2 / 3) = 28.87
    assert "| 4096 | 3 | 50.00 | 100.00 (+50.00 ± 28.87) |" in out
    assert "| all | 3 |" in out
    assert rp.paired({"k": 1.0}, {"k": 3.0}, ["k"]) == (2.0, 0.0)


def test_a_method_with_no_records_is_an_error(tmp_path: Path) -> None:
    rp = load_script("ruler_paired")
    f = _write(tmp_path / "s.jsonl", "oscar", {("a", 4096, 0): 100.0})
    with pytest.raises(SystemExit, match="no 'kivi-2' records"):
        rp.main([f"{f}:oscar", f"{f}:kivi-2"])
    with pytest.raises(SystemExit, match="not FILE:METHOD"):
        rp.main(["nocolon"])


def _vllm_json(path: Path, backend: str, cells: dict[tuple[str, int], list[float]], indices: bool = True) -> Path:
    rec = {f"model/{backend}/ruler/{t}/{n}": {"score": sum(s) / len(s), "samples": len(s), "scores": s,
                                               **({"indices": list(range(len(s)))} if indices else {})}
           for (t, n), s in cells.items()}
    rec[f"other-model/{backend}/capacity"] = {"kv_tokens": 1}  # not a ruler record: ignored
    path.write_text(json.dumps(rec))
    return path


def test_vllm_ruler_records_pair_with_samples_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rp = load_script("ruler_paired")
    base = _write(tmp_path / "s.jsonl", "bf16", {("a", 32768, 0): 100.0, ("a", 32768, 1): 0.0, ("a", 32768, 2): 50.0})
    v = _vllm_json(tmp_path / "v.json", "tq3", {("a", 32768): [100.0, 100.0]})
    _vllm_json(tmp_path / "o.json", "oscar", {("a", 32768): [0.0]})
    assert rp.load(f"{v}:tq3") == {("a", 32768, 0, 42): 100.0, ("a", 32768, 1, 42): 100.0}
    assert rp.load(f"{v}:oscar") == {}  # another backend's records only
    assert rp.main([f"{base}:bf16", f"{v}:tq3"]) == 0
    # common: indices 0 and 1; differences 0 and +100: mean 50, s.e. sqrt(5000 / 1 / 2) = 50
    assert "| 32768 | 2 | 50.00 | 100.00 (+50.00 ± 50.00) |" in capsys.readouterr().out


def test_vllm_ruler_records_without_indices_are_refused(tmp_path: Path) -> None:
    rp = load_script("ruler_paired")
    v = _vllm_json(tmp_path / "v.json", "tq3", {("a", 4096): [100.0]}, indices=False)
    with pytest.raises(SystemExit, match="no per-sample indices"):
        rp.load(f"{v}:tq3")


def test_rows_pair_only_within_a_seed_and_a_haystack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rp = load_script("ruler_paired")
    rows = [
        {"method": "bf16", "task": "a", "length": 1024, "index": 0, "score": 100.0},  # no seed field: 42
        {"method": "bf16", "task": "a", "length": 1024, "index": 1, "score": 0.0, "seed": 42, "haystack": "sha256:x"},
        {"method": "bf16", "task": "a", "length": 1024, "index": 2, "score": 0.0, "seed": 42, "haystack": "sha256:x"},
        {"method": "oscar", "task": "a", "length": 1024, "index": 0, "score": 0.0, "seed": 42, "haystack": "sha256:x"},
        {"method": "oscar", "task": "a", "length": 1024, "index": 1, "score": 100.0, "seed": 7},  # another seed
        {"method": "oscar", "task": "a", "length": 1024, "index": 2, "score": 100.0, "seed": 42, "haystack": "sha256:y"},
    ]
    f = tmp_path / "s.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert set(rp.load(f"{f}:oscar")) == {("a", 1024, 0, 42), ("a", 1024, 1, 7), ("a", 1024, 2, 42)}
    assert rp.main([f"{f}:bf16", f"{f}:oscar"]) == 0
    out = capsys.readouterr().out
    # index 0 pairs (a record without a digest pairs with any haystack); 1 is another seed; 2 two haystacks
    assert "1 samples common to all 2 rows (1 left out: their rows were built on different haystacks)" in out
    assert "| 1024 | 1 | 100.00 | 0.00 (-100.00 ± 0.00) |" in out
