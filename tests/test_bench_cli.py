"""`oscar bench`: argument parsing, and a clear error (exit 1, no numbers) without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from oscar_cli.bench.shapes import parse_int_list, parse_shape
from oscar_cli.errors import KernelUnavailableError
from oscar_cli.main import app, main

pytestmark = pytest.mark.unit


def test_parse_shape_named_and_triple() -> None:
    s = parse_shape("qwen3-8b")
    assert (s.h_q, s.h_kv, s.d, s.group) == (32, 8, 128, 4)
    assert (parse_shape("28,4,128").h_q, parse_shape("28,4,128").group) == (28, 7)
    for bad in ("nope", "32,5,128", "32,8,96", "1,2"):
        with pytest.raises(ValueError):
            parse_shape(bad)
    assert parse_int_list("16,1,4,1") == [1, 4, 16]
    with pytest.raises(ValueError):
        parse_int_list("0,2")


def test_bench_help_lists_examples() -> None:
    r = CliRunner().invoke(app, ["bench", "--help"])
    assert r.exit_code == 0
    assert "--shape" in r.output and "oscar --json bench" in r.output


def test_bench_bad_shape_is_a_usage_error() -> None:
    r = CliRunner().invoke(app, ["bench", "--shape", "32,5,128"])
    assert r.exit_code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_bench_without_cuda_exits_1_with_no_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--batch", "1", "--ctx", "4k"])
    assert exc.value.code == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "needs a CUDA GPU" in err and "nothing was measured" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_harness_run_raises_kernel_unavailable() -> None:
    from oscar_cli.bench import harness
    from oscar_cli.bench.config import BenchConfig

    with pytest.raises(KernelUnavailableError):
        harness.run(BenchConfig(shape=parse_shape("qwen3-8b")))


@pytest.mark.parametrize("batch", [1, 16])
def test_bench_keeps_the_default_config_it_does_not_override(batch: int) -> None:
    """Only the fields a bench config sets change; the measured defaults (e.g. the register cap) stay."""
    from oscar_cli.bench.cases import decode_config_for
    from oscar_cli.bench.config import BenchConfig
    from oscar_cli.bench.shapes import NAMED_SHAPES
    from oscar_kernels import ops

    base = ops.default_config(batch)
    assert decode_config_for(BenchConfig(shape=NAMED_SHAPES["qwen3-8b"]), batch) == base
    got = decode_config_for(BenchConfig(shape=NAMED_SHAPES["qwen3-8b"], kernel=(("num_stages", 3), ("hist_stages", 2))),
                              batch)
    assert (got.num_stages, got.hist_stages, got.maxnreg, got.block_nb) == (3, 2, base.maxnreg, base.block_nb)


def test_git_state_reports_sha_and_whether_tracked_files_differ() -> None:
    """The record's git fields: HEAD and a dirty flag from ``git status`` of this checkout (a copied tree whose
    ``.git`` is stale shows up as dirty); no git at all gives (None, None)."""
    import shutil
    import subprocess

    from oscar_cli.bench import environment
    from oscar_cli.bench.environment import git_state

    sha, dirty = git_state()
    here = Path(environment.__file__).resolve().parent
    if shutil.which("git") is None:
        assert (sha, dirty) == (None, None)
        return
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=here)
    if head.returncode != 0:  # installed outside any checkout
        assert (sha, dirty) == (None, None)
        return
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                            cwd=here).stdout
    assert sha == head.stdout.strip() and dirty == bool(status.strip())


def test_kernels_digest_names_the_kernel_sources() -> None:
    """The bench record carries a content hash of the kernel sources (a copied tree has no reliable git sha)."""
    import hashlib

    import oscar_kernels
    from oscar_cli.bench.environment import kernels_digest

    h = hashlib.sha256()
    for f in sorted(Path(oscar_kernels.__file__).resolve().parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    got = kernels_digest()
    assert got == h.hexdigest() and len(got) == 64


def test_bench_table_shows_graph_copy_share(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The table reports % of copy bandwidth from the CUDA-graph time next to the eager one, and GB/s from the graph
    time."""
    from oscar_cli import _output
    from oscar_cli.bench.report import BenchResult, CellResult
    from oscar_cli.commands.bench import _render

    monkeypatch.setattr(_output.stdout, "width", 250)  # every column unabridged
    cell = CellResult(batch=1, ctx=4096, splits=59, int2_us=118.0, int2_graph_us=13.2, int2_bytes=3_633_900,
                        int2_gbps=30.8, pct_copy=0.7, bf16_us={"cudnn": 16.5, "flash": 24.0},
                        bf16_graph_us={"cudnn": 12.2, "flash": 19.4}, best_bf16="cudnn", best_bf16_us=16.5,
                        speedup=0.14, speedup_graph=0.92, pct_copy_graph=6.5, int2_gbps_graph=275.3)
    res = BenchResult(config={"shape": {"name": "qwen3-8b", "h_kv": 8}}, environment={"gpu": "H200"},
                        copy_gbps=4250.0, cells=[cell],
                        quantize={"tokens": 16, "us": 1.0, "rows_per_s": 1e6, "gbps": 1.0, "values_us": 2.0},
                        notes=[])
    _render(res)
    out = capsys.readouterr().out
    import re

    assert re.search(r"\b1%\s*│\s*6%", out), out  # eager share, then the graph share
    assert re.search(r"│\s*275\s*│\s*1%", out), out  # bandwidth from the graph time (30.8 GB/s eager: launch-bound)


def _cell(batch: int, ctx: int, graph: bool = True) -> object:
    from oscar_cli.bench.report import CellResult

    return CellResult(batch=batch, ctx=ctx, splits=30, int2_us=100.0 + ctx / 1e3, int2_graph_us=10.0 + ctx / 1e4
                        if graph else None, int2_bytes=1, int2_gbps=1.0, pct_copy=1.0,
                        bf16_us={"cudnn": 50.0 + ctx / 1e3, "flashinfer": None},
                        bf16_graph_us={"cudnn": 12.0 + ctx / 1e4 if graph else None, "flashinfer": 11.0 + ctx / 1e4
                                       if graph else None},
                        best_bf16="cudnn", best_bf16_us=50.0 + ctx / 1e3, speedup=0.5, speedup_graph=None)


@pytest.mark.parametrize("graph", [True, False], ids=["graph-times", "eager-only"])
def test_bench_plot_shows_graph_times_and_the_page_size(tmp_path: Path, graph: bool) -> None:
    """The plot shows what the table and docs report: CUDA-graph times (eager only when no graph time was
    measured), INT2 and the fastest BF16 backend per batch, the page size in the title; written atomically."""
    from oscar_cli.bench.report import BenchResult, plot_series, save_plot

    cells = [_cell(b, c, graph) for b in (16, 1) for c in (32768, 4096)]
    res = BenchResult(config={"shape": {"name": "qwen3-8b"}, "page_size": 16, "paged": True},
                        environment={"gpu": "H200"}, copy_gbps=1.0, cells=cells, quantize={})  # type: ignore[arg-type]
    timing, series = plot_series(res)
    assert timing == ("CUDA graph" if graph else "eager")
    assert [s[0] for s in series] == ["INT2 B=1", "best BF16 B=1", "INT2 B=16", "best BF16 B=16"]
    assert series[0][1] == [4096, 32768]
    if graph:
        assert series[0][2] == pytest.approx([10.4096, 13.2768]) and series[1][2] == pytest.approx([11.4096, 14.2768])
    else:
        assert series[0][2] == pytest.approx([104.096, 132.768]) and series[1][2] == pytest.approx([54.096, 82.768])
    out = save_plot(res, tmp_path / "bench.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and [p.name for p in tmp_path.iterdir()] == ["bench.png"]


def test_bench_replot_draws_a_saved_record_without_a_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--replot``: a saved ``--json`` record back to a PNG (no measuring, no CUDA); bad records are one-line errors."""
    import json
    from dataclasses import asdict

    from oscar_cli.bench.report import BenchResult, result_from_json

    res = BenchResult(config={"shape": {"name": "qwen3-8b"}, "page_size": 64, "paged": True},
                        environment={"gpu": "H200"}, copy_gbps=1.0, cells=[_cell(1, 4096), _cell(1, 32768)],  # type: ignore[list-item]
                        quantize={})
    record = tmp_path / "bench.json"
    record.write_text(json.dumps(asdict(res) | {"plot": None}))
    assert result_from_json(json.loads(record.read_text())) == res
    r = CliRunner().invoke(app, ["bench", "--replot", str(record), "--plot", str(tmp_path / "b.png")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    r = CliRunner().invoke(app, ["--json", "bench", "--replot", str(record), "--plot", str(tmp_path / "j.png")])
    assert r.exit_code == 0 and json.loads(r.stdout) == {"record": str(record), "plot": str(tmp_path / "j.png"),
                                                          "cells": 2}, r.output
    r = CliRunner().invoke(app, ["bench", "--replot", str(record)])
    assert r.exit_code == 2 and "--replot needs --plot" in r.output
    bad = tmp_path / "bad.json"
    bad.write_text('{"cells": []}')
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--replot", str(bad), "--plot", str(tmp_path / "c.png")])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "is not an `oscar --json bench` record (KeyError: 'config')" in err and len(err.strip().splitlines()) == 2
    assert not (tmp_path / "c.png").exists()


def test_bench_table_shows_the_faster_flashinfer_kernel(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """With FlashInfer measured, its column shows the faster of its tensor-core and CUDA-core kernels."""
    from oscar_cli import _output
    from oscar_cli.bench.report import BenchResult, CellResult
    from oscar_cli.commands.bench import _render

    cell = CellResult(batch=1, ctx=4096, splits=30, int2_us=35.6, int2_graph_us=11.8, int2_bytes=3_633_900,
                        int2_gbps=102.0, pct_copy=2.4, bf16_us={"cudnn": 51.8, "flash": 24.4, "flashinfer_tc": 19.2,
                                                                 "flashinfer": 18.2},
                        bf16_graph_us={"cudnn": 12.2, "flash": 19.2, "flashinfer_tc": 14.7, "flashinfer": 29.7},
                        best_bf16="flashinfer", best_bf16_us=18.2, speedup=0.51, speedup_graph=1.03,
                        pct_copy_graph=7.2)
    res = BenchResult(config={"shape": {"name": "qwen3-8b", "h_kv": 8}}, environment={"gpu": "H200"},
                        copy_gbps=4274.0, cells=[cell],
                        quantize={"tokens": 16, "us": 1.0, "rows_per_s": 1e6, "gbps": 1.0, "values_us": 2.0},
                        notes=[])
    monkeypatch.setattr(_output.stdout, "width", 240)  # every column unabbreviated
    _render(res)
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "4k" in line)
    cols = [c.strip() for c in row.split("│")[1:-1]]
    assert "FlashInfer µs" in out and cols[10] == "18.2", out  # eager: min(flashinfer_tc 19.2, flashinfer 18.2)


def test_flashinfer_failure_is_recorded_as_not_run(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """FlashInfer is an optional baseline: when its kernels do not run here the cell records None, never an error
    or a made-up number."""
    import logging
    import sys
    import types

    from oscar_cli.bench import backends
    from oscar_cli.bench.backends import bench_flashinfer
    from oscar_cli.bench.config import BenchConfig
    from oscar_cli.bench.shapes import NAMED_SHAPES

    class Wrapper:
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("no kernel image for this GPU")

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=Wrapper))
    cfg = BenchConfig(shape=NAMED_SHAPES["smollm2-135m"], rep_ms=1)
    with caplog.at_level(logging.INFO, logger=backends.log.name):
        got = bench_flashinfer(cfg.shape, 1, 256, cfg, torch.device("cpu"), 1 << 20, tensor_cores=True)
    assert got == (None, None)
    assert "FlashInfer (tensor cores) did not run: no kernel image" in caplog.text


def test_kernel_options_parse_and_apply() -> None:
    """``--kernel`` sets any DecodeConfig field; the others keep default_config(batch)."""
    from oscar_cli.bench.cases import decode_config_for
    from oscar_cli.bench.config import BenchConfig
    from oscar_cli.bench.kernel_options import parse_kernel_options
    from oscar_cli.bench.shapes import NAMED_SHAPES
    from oscar_kernels import ops

    knobs = parse_kernel_options(" hist_stages=4, maxnreg=none ,pdl=false,merge_cols=128")
    assert knobs == (("hist_stages", 4), ("maxnreg", None), ("pdl", False), ("merge_cols", 128))
    assert parse_kernel_options(None) == () and parse_kernel_options("") == ()
    # an optional flag takes true/false and none (the kernel's own choice)
    assert parse_kernel_options("meta_words=true,pdl=off") == (("meta_words", True), ("pdl", False))
    assert parse_kernel_options("meta_words=none") == (("meta_words", None),)
    got = decode_config_for(BenchConfig(shape=NAMED_SHAPES["qwen3-8b"], kernel=knobs), 16)
    base = ops.default_config(16)
    assert (got.hist_stages, got.maxnreg, got.pdl, got.merge_cols) == (4, None, False, 128)
    assert (got.block_n, got.num_warps, got.merge_block_p) == (base.block_n, base.num_warps, base.merge_block_p)


@pytest.mark.parametrize(("text", "match"), [
    ("nope=1", "unknown kernel option 'nope'; known: .*hist_stages"),
    ("hist_stages", "expected KEY=VALUE"),
    ("hist_stages=", "expected KEY=VALUE"),
    ("pdl=maybe", "pdl takes true or false, got"),
    ("pdl=none", "pdl takes true or false, got 'none'"),
    ("meta_words=2", "meta_words takes true or false or none"),
    ("hist_stages=four", "hist_stages takes an integer"),
    ("hist_stages=none", "hist_stages cannot be none"),
    ("hist_stages=4,hist_stages=5", "hist_stages given twice"),
    ("mode=1", "unknown kernel option 'mode'"),
])
def test_kernel_options_reject_bad_items(text: str, match: str) -> None:
    from oscar_cli.bench.kernel_options import parse_kernel_options

    with pytest.raises(ValueError, match=match):
        parse_kernel_options(text)


@pytest.mark.parametrize("page", ["8", "96", "0"])
def test_bench_bad_page_size_is_a_usage_error(page: str) -> None:
    r = CliRunner().invoke(app, ["bench", "--page-size", page])
    assert r.exit_code == 2
    assert "--page-size must be a multiple of 16" in r.output


def test_bench_bad_kernel_option_is_a_usage_error() -> None:
    r = CliRunner().invoke(app, ["bench", "--kernel", "nope=1"])
    assert r.exit_code == 2
    assert "unknown kernel option" in r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path; the GPU runs it in scripts/")
@pytest.mark.parametrize(("paged", "page"), [(True, 64), (True, 128), (False, 64)], ids=["pages64", "pages128",
                                                                                       "contiguous"])
def test_int2_plans_build_runnable_plans_with_kernel_overrides(paged: bool, page: int) -> None:
    """The plans every INT2 bench measurement is built on: rotating cases, the --kernel overrides, the page layout
    (token-quad rows of 64 tokens above 64-token pages and without pages), a run."""
    from oscar_cli.bench.cases import int2_plans
    from oscar_cli.bench.config import BenchConfig
    from oscar_cli.bench.shapes import NAMED_SHAPES

    shape = NAMED_SHAPES["smollm2-135m"]
    cfg = BenchConfig(shape=shape, dtype="fp16", kernel=(("block_n", 16), ("merge_block_p", 16)), paged=paged,
                        page_size=page)
    plans, cases, s = int2_plans(shape, 1, 512, cfg, torch.device("cpu"), 1 << 20)
    assert len(plans) == len(cases) >= 2  # enough copies to exceed 4x the (pretend) L2
    assert (plans[0].config.block_n, plans[0].config.merge_block_p, s) == (16, 16, plans[0].num_splits)
    out = plans[0].run()
    assert out.shape == (1, shape.h_q, shape.d) and torch.isfinite(out).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path; the GPU runs it in `oscar bench`")
@pytest.mark.parametrize("key_mean", ["rope", "rope-gemm"])
def test_rope_mean_step_is_the_decode_with_the_float64_term(key_mean: str) -> None:
    """``--key-mean rope`` (the term inside the decode kernel) and ``rope-gemm`` (a GEMM writing it first): each
    timed INT2 step adds the position-dependent key mean's logit term over the history (positions after the sink):
    the same output as the decode given the float64 term."""
    from oscar_cli.bench.cases import RopeMeanStep, int2_plans
    from oscar_cli.bench.config import BenchConfig
    from oscar_cli.bench.shapes import NAMED_SHAPES
    from oscar_kernels import ops
    from oscar_kernels import reference as ref

    shape = NAMED_SHAPES["smollm2-135m"]
    cfg = BenchConfig(shape=shape, dtype="fp16", kernel=(("block_n", 16), ("merge_block_p", 16)), page_size=64,
                      key_mean=key_mean)
    plans, cases, _ = int2_plans(shape, 1, 512, cfg, torch.device("cpu"), 1 << 20)
    step, c = plans[0], cases[0]
    assert isinstance(step, RopeMeanStep) == (key_mean == "rope-gemm")
    got = step.run().float().clone()
    config = step.plan.config if isinstance(step, RopeMeanStep) else step.config
    hist, s0 = int(c["hist_len"][0]), int(c["sink_len"][0])
    pos = torch.arange(s0, s0 + hist)[None]
    from oscar_cli.bench.cases import rope_frequencies

    inv = rope_frequencies(shape.d)
    term = ref.rope_mean_logits(c["q"], c["mean_pre"], inv, 1.0, pos, shape.d ** -0.5).float()
    bias = torch.zeros(*term.shape[:2], int(c["block_table"].shape[1]) * 64, dtype=torch.float32)
    bias[..., :hist] = term
    keys = ("k_cache", "v_cache", "block_table", "hist_len", "sink_k", "sink_v", "sink_len",
            "recent_k", "recent_v", "recent_len")
    want = ops.decode_attention(c["q"], *(c[k] for k in keys), rotation_k=c["rotation_k"], rotation_v=c["rotation_v"],
                                mean_v=c["mean_v"], logit_bias=bias, config=config).float()
    plain = ops.decode_attention(c["q"], *(c[k] for k in keys), rotation_k=c["rotation_k"], rotation_v=c["rotation_v"],
                                 mean_v=c["mean_v"], config=config).float()
    assert (got - want).abs().max() < 2e-3 * max(1.0, float(want.abs().max()))
    assert (got - plain).abs().max() > 1e-2  # the term is not zero


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path; the GPU runs it in `oscar bench`")
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "non-paged"])
def test_int4_key_step_reads_the_low_plane(paged: bool) -> None:
    """``--key-bits 4``: each timed INT2 step reads the keys' low plane beside the pages' high plane (a
    ``LowPlane`` over every slot of the block table's capacity), its bytes counted: the same output as the decode
    given the plane's float64 logit term as a bias, not the plain decode's."""
    from oscar_cli.bench.cases import int2_bytes, int2_plans
    from oscar_cli.bench.config import BenchConfig
    from oscar_cli.bench.shapes import NAMED_SHAPES
    from oscar_kernels import ops
    from oscar_kernels import reference as ref

    shape = NAMED_SHAPES["smollm2-135m"]
    cfg = BenchConfig(shape=shape, dtype="fp16", kernel=(("block_n", 16), ("merge_block_p", 16)), page_size=64,
                      key_bits=4, paged=paged)
    plans, cases, _ = int2_plans(shape, 1, 512, cfg, torch.device("cpu"), 1 << 20)
    plan, c = plans[0], cases[0]
    got = plan.run().float().clone()
    low = c["low_plane"]
    cap = int(c["block_table"].shape[1]) * int(c["k_cache"].packed.shape[2])
    assert low.codes.shape == (1, shape.h_kv, cap, shape.d // 4) and int(low.first.abs().max()) == 0
    g = shape.h_q // shape.h_kv
    q = c["q"].double() @ c["rotation_k"].double()
    lo = ref.unpack_int2(low.codes).double().repeat_interleave(g, 1)  # [1, H_q, cap, D]
    table = c["block_table"].long()
    n = torch.arange(cap)
    page = int(c["k_cache"].packed.shape[2])
    scale = c["k_cache"].scale[table[0, n // page], :, n % page, 0].double().T.repeat_interleave(g, 0)[None]
    bias = (torch.einsum("bhd,bhtd->bht", q, lo) * scale / 4 * shape.d ** -0.5).float()
    keys = ("k_cache", "v_cache", "block_table", "hist_len", "sink_k", "sink_v", "sink_len",
            "recent_k", "recent_v", "recent_len")
    kw = dict(rotation_k=c["rotation_k"], rotation_v=c["rotation_v"], mean_v=c["mean_v"], config=plan.config,
              paged=paged)
    want = ops.decode_attention(c["q"], *(c[k] for k in keys), logit_bias=bias, **kw).float()
    plain = ops.decode_attention(c["q"], *(c[k] for k in keys), **kw).float()
    err, moved = float((got - want).abs().max()), float((got - plain).abs().max())
    assert err < 2e-3 * max(1.0, float(want.abs().max()))
    assert moved > 4 * err, (moved, err)  # the bench's small random scales: the plane moves the output a little
    hist = 512 - cfg.sink - cfg.recent
    assert int2_bytes(shape, 1, 512, cfg.sink, cfg.recent, 64, key_bits=4) - \
        int2_bytes(shape, 1, 512, cfg.sink, cfg.recent, 64) == hist * shape.h_kv * shape.d // 4


def test_bench_key_bits_must_be_2_or_4() -> None:
    r = CliRunner().invoke(app, ["bench", "--key-bits", "3"])
    assert r.exit_code == 2 and "--key-bits must be 2 or 4" in r.output


def test_bench_key_mean_must_be_constant_or_rope() -> None:
    r = CliRunner().invoke(app, ["bench", "--key-mean", "learned"])
    assert r.exit_code == 2 and "--key-mean must be constant, rope or rope-gemm" in r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path; the GPU runs it in `oscar bench`")
def test_meta8_step_reads_the_bytes() -> None:
    """``--meta-bits 8``: each timed INT2 step reads formula 10's scale and zero bytes (one each per token and head,
    bytes counted so), the same output as the decode given those bytes decoded to float32 metadata."""
    from oscar_cli.bench.cases import int2_bytes, int2_plans
    from oscar_cli.bench.config import BenchConfig
    from oscar_cli.bench.shapes import NAMED_SHAPES
    from oscar_kernels import ops
    from oscar_kernels import reference as ref

    shape = NAMED_SHAPES["smollm2-135m"]
    cfg = BenchConfig(shape=shape, dtype="fp16", kernel=(("block_n", 16), ("merge_block_p", 16)), page_size=64,
                      meta_bits=8)
    plans, cases, _ = int2_plans(shape, 1, 512, cfg, torch.device("cpu"), 1 << 20)
    c = cases[0]
    got = plans[0].run().float().clone()
    assert c["k_cache"].scale.dtype == torch.uint8 and c["v_cache"].zero.dtype == torch.uint8
    wide = {k: ref.QuantizedRows(c[k].packed, *ref.decode_meta(c[k].scale, c[k].zero)) for k in ("k_cache", "v_cache")}
    keys = ("block_table", "hist_len", "sink_k", "sink_v", "sink_len", "recent_k", "recent_v", "recent_len")
    want = ops.decode_attention(c["q"], wide["k_cache"], wide["v_cache"], *(c[k] for k in keys),
                                rotation_k=c["rotation_k"], rotation_v=c["rotation_v"], mean_v=c["mean_v"],
                                config=plans[0].config).float()
    assert float((got - want).abs().max()) < 2e-3 * max(1.0, float(want.abs().max()))
    hist = 512 - cfg.sink - cfg.recent
    assert int2_bytes(shape, 1, 512, cfg.sink, cfg.recent, 64) - int2_bytes(shape, 1, 512, cfg.sink, cfg.recent, 64, 1) \
        == hist * 2 * shape.h_kv * 2


def test_bench_meta_bits_must_be_16_or_8() -> None:
    r = CliRunner().invoke(app, ["bench", "--meta-bits", "4"])
    assert r.exit_code == 2 and "--meta-bits must be 16 or 8" in r.output
