"""scripts/vllm_ruler_compare.py: RULER through vLLM against oscar's path, per cell, on the same prompts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.scripts import load_script

pytestmark = pytest.mark.unit


def _rec(task: str, length: int, index: int, score: float, pred: str, method: str = "oscar") -> dict[str, Any]:
    return {"method": method, "task": task, "length": length, "index": index, "score": score, "pred": pred,
            "prompt_tokens": 100 + index}


def test_cells_means_agreement_and_prompt_checks(tmp_path: Path) -> None:
    m = load_script("vllm_ruler_compare")
    samples = [_rec("niah_single_1", 4096, i, 100.0, f"{i}") for i in range(3)]
    samples += [_rec("niah_multikey_2", 4096, i, 0.0 if i else 100.0, f"{i}") for i in range(3)]
    samples += [_rec("niah_single_1", 4096, 0, 0.0, "x", method="bf16")]  # another method: ignored
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in samples))
    vllm = {
        "m/oscar/ruler/niah_single_1/4096": {"scores": [100.0, 100.0, 0.0], "indices": [0, 1, 2],
                                             "prompt_tokens": [100, 101, 102], "preds": ["0", "1", "bad"]},
        # index 2's prompt has another length (another tokenizer): left out
        "m/oscar/ruler/niah_multikey_2/4096": {"scores": [100.0, 100.0, 100.0], "indices": [0, 1, 2],
                                               "prompt_tokens": [100, 101, 999], "preds": ["0", "x", "2"]},
        "m/bf16/ruler/niah_single_1/4096": {"scores": [0.0], "indices": [0]},  # another backend: ignored
        "m/oscar/capacity": {"tokens": 1},
    }
    cells = m.compare(vllm, m.read_samples(path, "oscar"), "oscar")
    c = cells[4096]
    assert c["tasks"]["niah_single_1"] == pytest.approx((200 / 3, 100.0, 3))
    assert c["tasks"]["niah_multikey_2"] == pytest.approx((100.0, 50.0, 2))
    assert (c["n"], c["same_score"], c["same_pred"], c["with_pred"], c["differs"]) == (5, 3, 3, 5, 1)
    md = m.markdown(cells)
    assert "| 4096 | 83.33 | 75.00 | +8.33 | single_1 67/100, multikey_2 100/50 | 3/5 (1 prompts differ) | 3/5 |" in md
    vf = tmp_path / "v.json"
    vf.write_text(json.dumps(vllm))
    assert m.main([str(vf), str(path)]) == 0
    assert m.main([str(vf), str(path), "--backend", "tq3"]) == 1


def test_records_without_indices_use_their_order(tmp_path: Path) -> None:
    m = load_script("vllm_ruler_compare")
    ref = {("niah_single_1", 4096, i): _rec("niah_single_1", 4096, i, 100.0, "a") for i in range(2)}
    cells = m.compare({"m/oscar/ruler/niah_single_1/4096": {"scores": [100.0, 0.0]}}, ref, "oscar")
    assert cells[4096]["tasks"]["niah_single_1"] == pytest.approx((50.0, 100.0, 2))
    assert cells[4096]["with_pred"] == 0 and "| — |" in m.markdown(cells)
