"""scripts/gpu_layer_step_bench.py: the smoke mode runs every variant of the launches around the decode (CPU, Triton
interpreter) through the backend's layer and writes its JSON, every variant's output bitwise the default's; the
distinct layers are distinct; a bad variant name is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.scripts import load_script

pytestmark = pytest.mark.unit


def test_smoke_runs_every_variant(tmp_path: Path) -> None:
    bench = load_script("gpu_layer_step_bench")
    out = tmp_path / "step.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["env"]["interpret"] is True
    rows = result["results"]
    assert [r["variant"] for r in rows] == list(bench.VARIANTS)
    assert all(r["ctx"] == 64 and len(r["us_repeats"]) == 2 and r["us_per_layer"] > 0 for r in rows)
    assert all(r["same_output_as_first"] is True for r in rows)


def test_distinct_layers_differ_and_a_changed_output_is_caught() -> None:
    import torch

    bench = load_script("gpu_layer_step_bench")
    steps = [bench.build("gather", 64, 1, "cpu", True, seed=i) for i in range(2)]
    a, b = (torch.as_tensor(fn()).clone() for fn in steps)
    assert not torch.equal(a, b)  # each layer its own rotation, means and pages
    flipped = [lambda: a, lambda: b.clone().index_put_((torch.tensor([0]),), b[0] * 2)]
    same = bench.same_outputs({"x": [lambda: a, lambda: b], "y": flipped})
    assert same == {"x": True, "y": False}


def test_unknown_variant_is_refused() -> None:
    with pytest.raises(SystemExit, match="--variants"):
        load_script("gpu_layer_step_bench").main(["--smoke", "--variants", "gather,fastest"])
