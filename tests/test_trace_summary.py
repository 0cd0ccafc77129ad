"""scripts/trace_summary.py: kernel totals, busy/idle GPU time and launch kinds of a torch-profiler trace."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from helpers.scripts import load_script

pytestmark = pytest.mark.unit


def _module() -> Any:
    return load_script("trace_summary")


def _kernel(name: str, ts: float, dur: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def _trace() -> list[dict[str, Any]]:
    # two kernels overlapping (10..20, 15..25), a 3 us gap, one kernel 28..30, a 2,000 us gap, one at 2030..2040
    return [_kernel("a", 10, 10), _kernel("b", 15, 10), _kernel("a", 28, 2), _kernel("merge", 2030, 10),
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 2040, "dur": 5},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1, "dur": 3},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 2, "dur": 3},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50}]


def test_summary_counts_busy_idle_and_launches() -> None:
    s = _module().summarize(_trace(), steps=2, top=2)
    assert s["kernels"] == 4 and s["kernel_us"] == pytest.approx(32)
    assert s["gpu_span_us"] == pytest.approx(2035)  # 10 .. 2045 (the memcpy ends last)
    assert s["gpu_busy_us"] == pytest.approx(15 + 2 + 15)  # union: 10..25, 28..30, 2030..2045
    assert s["idle_gaps"]["<5us"]["count"] == 1 and s["idle_gaps"][">=1000us"]["count"] == 1
    assert s["host_launches"] == {"kernel_launch": 1, "graph_launch": 1}
    assert [t["name"] for t in s["top"]] == ["a", "b"] and s["top"][0]["count"] == 2
    assert s["per_step"]["kernels"] == 2


@pytest.mark.parametrize("gz", [False, True], ids=["json", "json.gz"])
def test_cli_reads_a_trace_directory(tmp_path: Path, gz: bool, capsys: pytest.CaptureFixture[str]) -> None:
    body = json.dumps({"traceEvents": _trace()})
    sub = tmp_path / "worker0"
    sub.mkdir()
    if gz:
        with gzip.open(sub / "t.pt.trace.json.gz", "wt") as fh:
            fh.write(body)
    else:
        (sub / "t.pt.trace.json").write_text(body)
    _module().main([str(tmp_path), "--out", str(tmp_path / "s.json")])
    assert "kernels 4" in capsys.readouterr().out
    assert json.loads((tmp_path / "s.json").read_text())["kernels"] == 4


def test_a_trace_without_kernels_is_refused(tmp_path: Path) -> None:
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": [_trace()[-1]]}))
    with pytest.raises(SystemExit, match="no GPU kernel events"):
        _module().main([str(tmp_path / "t.json")])
