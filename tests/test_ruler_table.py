"""scripts/ruler_table.py: the RESULTS.md tables and heatmap from a sweep's samples file and eval-kl outputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.scripts import load_script

from oscar_cli.eval.niah import TASK_NAMES

pytestmark = pytest.mark.unit


def _rt() -> Any:
    return load_script("ruler_table")


def _rec(method: str, task: str, length: int, index: int, score: float, *, rope: str = "", source: str = "none",
         secs: float = 10.0, bs: int = 2, bpe: float = 16.0) -> dict[str, Any]:
    return {"method": method, "method_source": source, "rope": rope, "task": task, "length": length, "index": index,
            "score": score, "batch_seconds": secs, "batch_size": bs, "bpe_measured_batch": bpe}


def _full(method: str, length: int, score: float, samples: int = 2, **kw: Any) -> list[dict[str, Any]]:
    return [_rec(method, t, length, i, score, **kw) for t in TASK_NAMES for i in range(samples)]


def test_means_partial_cells_seconds_and_yarn_labels(tmp_path: Path) -> None:
    rt = _rt()
    recs = _full("bf16", 4096, 100.0, secs=5.0, bs=16) + _full("bf16", 65536, 50.0, rope="yarn x4", secs=7.0, bs=16)
    # oscar at 4K: task 1 scores 100 and 0 (mean 50), the rest 100; one duplicate (a resumed rerun) ignored
    recs += [_rec("oscar", t, 4096, i, 0.0 if (t, i) == (TASK_NAMES[0], 1) else 100.0, source="A", secs=3.0,
                  bs=16, bpe=3.5) for t in TASK_NAMES for i in range(2)]
    recs.append(_rec("oscar", TASK_NAMES[0], 4096, 1, 100.0, source="A", secs=99.0))
    # oscar at 64K: only 2 tasks, 3 samples, two batches (different batch_seconds)
    recs += [_rec("oscar", TASK_NAMES[0], 65536, 0, 100.0, rope="yarn x4", source="A", secs=4.0, bpe=2.4),
             _rec("oscar", TASK_NAMES[0], 65536, 1, 0.0, rope="yarn x4", source="A", secs=4.0, bpe=2.4),
             _rec("oscar", TASK_NAMES[1], 65536, 0, 100.0, rope="yarn x4", source="A", secs=6.0, bpe=2.4)]
    t = rt.tables(recs, samples=2)
    assert t["methods"] == ["bf16", "oscar"] and t["lengths"] == [4096, 65536]
    assert t["mean"]["oscar"][4096] == pytest.approx((50.0 + 7 * 100.0) / 8)
    assert t["mean"]["oscar"][65536] == pytest.approx((50.0 + 100.0) / 2)  # the mean over the tasks present
    assert t["n"]["oscar"][65536] == 3 and t["want"] == 16
    assert t["seconds"]["oscar"] == {4096: 3.0, 65536: 10.0}  # one batch at 4K, two at 64K
    md = rt.ruler_markdown(t)
    assert "| method | 4K | 64K (YaRN x4) | BPE at 4K / 64K |" in md
    assert "| oscar | 93.8 | 75.0* (3/16) | 3.50 / 2.40 |" in md
    assert "| bf16 | 100.0 | 50.0 | 16.00 / 16.00 |" in md
    assert "| all | 8 | 17 | **25** |" in md
    heat = tmp_path / "h.png"
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert rt.main([str(tmp_path), "--samples", "2", "--heatmap", str(heat)]) == 0
    assert heat.read_bytes()[:4] == b"\x89PNG"


def test_another_seeds_samples_count_and_a_repeat_does_not() -> None:
    rt = _rt()
    recs = _full("bf16", 4096, 100.0)  # seed unrecorded: 42
    recs += [{**r, "seed": 7, "score": 0.0} for r in _full("bf16", 4096, 100.0)]  # seed 7: other prompts
    recs += [{**r, "seed": 7, "score": 100.0} for r in _full("bf16", 4096, 100.0)]  # seed 7 again: ignored
    t = rt.tables(recs, samples=2)
    assert t["n"]["bf16"][4096] == 32 and t["mean"]["bf16"][4096] == pytest.approx(50.0)


def test_refuses_mixed_sources_and_ropes() -> None:
    rt = _rt()
    with pytest.raises(SystemExit, match="oscar has records from 2 sources"):
        rt.tables(_full("oscar", 4096, 100.0, source="A") + [_rec("oscar", TASK_NAMES[0], 4096, 5, 0.0, source="B")], 2)
    served = [dict(r, artifact_serving="sha256:" + c * 64) for c, r in zip("ab", _full("oscar", 4096, 1.0, source="A")[:2], strict=True)]
    with pytest.raises(SystemExit, match=r"oscar has records from 2 sources \(A \[serving aaaa"):
        rt.tables(served, 2)
    with pytest.raises(SystemExit, match="length 65536 ran under 2 RoPE settings"):
        rt.tables(_full("bf16", 65536, 100.0) + _full("bf16", 65536, 100.0, rope="yarn x4"), 2)


def test_kl_markdown(tmp_path: Path) -> None:
    rt = _rt()
    for L, kl in ((4096, 0.02), (32704, 0.37)):
        (tmp_path / f"kl-{L}.json").write_text(json.dumps({"config": {"windows": 8}, "metrics": {
            "bf16": {str(L): {"kl": 0.0, "top1": 1.0}}, "oscar": {str(L): {"kl": kl, "top1": 0.9}},
            "kivi-2": {str(L): {"kl": 0.1, "top1": 0.8}}}}))
    md = rt.kl_markdown(sorted(tmp_path.glob("kl-*.json")))
    assert md.splitlines()[0] == "| method | 4K (8 windows) | 32,704 (8 windows) |"
    assert "| oscar | 0.0200 (0.900) | 0.3700 (0.900) |" in md and "bf16" not in md
    assert md.splitlines()[2].startswith("| oscar")  # the methods in the table's order
