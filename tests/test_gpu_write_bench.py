"""scripts/gpu_write_bench.py: the smoke mode runs every case kind (CPU, Triton interpreter) and writes its JSON; a
failing case is recorded and does not stop the others."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.scripts import load_script

pytestmark = pytest.mark.unit


def test_smoke_runs_every_case(tmp_path: Path) -> None:
    bench = load_script("gpu_write_bench")
    out = tmp_path / "bench.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["env"]["interpret"] and result["env"]["torch"] and result["env"]["triton"]
    rows = result["results"]
    assert [r["error"] for r in rows] == [None] * len(rows)
    checks = [r for r in rows if r["op"] == "check_updates"]
    assert len(checks) == 1 and checks[0]["n"] == 1
    rows = [r for r in rows if r["op"] != "check_updates"]
    assert all(r["n"] == 1 and len(r["us_repeats"]) == 2 and r["us_per_launch"] > 0 for r in rows)
    qw = [(r["layout"], r["clip_method"], r["block_t_auto"]) for r in rows if r["op"] == "quantize_write"]
    for layout in ("rows", "token_quads"):
        for method in ("select", "sort"):
            assert {(layout, method, True), (layout, method, False), (layout, None, True)} <= set(qw)
    assert {r["num_warps"] for r in rows if r["op"] == "quantize_write"} == {1, 4}
    assert {r["op"] for r in rows} == {"quantize_write", "rotate_kv", "torch_rotate", "step_writes"}
    assert sorted(r["fused"] for r in rows if r["op"] == "step_writes") == [False, True]
    assert [(r["block_t"], "query_heads" in r) for r in rows if r["op"] == "rotate_kv"] == \
        [(None, False), (16, False), (32, False), (64, False), (None, True)]  # the last with the decode's queries
    assert {r["block_t"] for r in rows if r["op"] == "quantize_write"} == {1, 16}  # N=1: auto picks 1
    v = {(r["clip_method"], r["slots"], r["tq_update"]) for r in rows if r["op"] == "quantize_write"
         and r["layout"] == "token_quads" and r["num_warps"] == 4 and r["block_t_auto"]}
    for method in ("sort", None):
        assert {(method, "random", "and_or"), (method, "random", "xor"), (method, "decode", "and_or"),
                (method, "decode", "xor"), (method, "decode", "exclusive")} <= v
    assert {r["tq_update"] for r in rows if r["op"] == "quantize_write" and r["layout"] == "rows"} == {None}


def test_ops_filter_runs_only_those_kinds(tmp_path: Path) -> None:
    """``--ops rotate_kv,torch_rotate``: only the rotation rows, no V-update check; an unknown kind is refused."""
    bench = load_script("gpu_write_bench")
    out = tmp_path / "bench.json"
    assert bench.main(["--smoke", "--ops", "rotate_kv,torch_rotate", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert {r["op"] for r in rows} == {"rotate_kv", "torch_rotate"} and len(rows) == 6
    assert bench.main(["--smoke", "--ops", "rotate"]) == 2


def test_failing_case_is_recorded() -> None:
    bench = load_script("gpu_write_bench")

    def boom() -> None:
        raise RuntimeError("bad launch")

    row: dict[str, Any] = bench.run_case({"name": "x", "n": 1}, boom, lambda fn: bench.time_wall(fn, 2))
    assert row["error"] == "RuntimeError: bad launch" and row["us_per_launch"] is None
    ok = bench.run_case({"name": "y", "n": 1}, lambda: None, lambda fn: bench.time_wall(fn, 2))
    assert ok["error"] is None and len(ok["us_repeats"]) == 2


def test_check_updates_compares_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The V-update check passes on the real kernels (N=3: dense slots share words) and names a variant whose bytes
    differ (here an ``xor`` that writes nothing)."""
    import torch

    from oscar_kernels import ops

    bench = load_script("gpu_write_bench")
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter (conftest)
    assert bench.check_updates(3, 4, dev, 1, 64)["error"] is None

    real = ops.quantize_write

    def lazy_xor(*args: Any, **kw: Any) -> None:
        if kw.get("tq_update") == "xor" and not kw.get("exclusive_words"):
            return
        real(*args, **kw)

    monkeypatch.setattr(ops, "quantize_write", lazy_xor)
    err = bench.check_updates(3, 4, dev, 1, 64)["error"]
    assert err is not None and "decode xor:" in err and "dense xor:" in err and "exclusive" not in err


def test_table_labels_check_rows() -> None:
    """A check row has no time: the table says ``ok`` when it passed and ``FAILED`` (with the error) when not, a
    timed case its µs, a case that raised ``FAILED``."""
    bench = load_script("gpu_write_bench")
    lines = bench.table([{"name": "check", "n": 8, "us_per_launch": None, "error": None},
                         {"name": "check", "n": 64, "us_per_launch": None, "error": "AssertionError: bytes differ"},
                         {"name": "case", "n": 1, "us_per_launch": 2.5, "error": None}]).splitlines()
    assert lines[1].split()[:2] == ["8", "ok"]
    assert lines[2].split()[:2] == ["64", "FAILED"] and "bytes differ" in lines[2]
    assert lines[3].split()[:2] == ["1", "2.50"]
