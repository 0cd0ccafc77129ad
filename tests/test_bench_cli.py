"""`oscar bench`: argument parsing, and a clear error (exit 1, no numbers) without CUDA."""

from __future__ import annotations

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

    with pytest.raises(KernelUnavailableError):
        harness.run(harness.BenchConfig(shape=parse_shape("qwen3-8b")))


@pytest.mark.parametrize("batch", [1, 16])
def test_bench_keeps_the_default_config_it_does_not_override(batch: int) -> None:
    """Only the fields a bench config sets change; the measured defaults (e.g. the register cap) stay."""
    from oscar_cli.bench import harness as H
    from oscar_cli.bench.shapes import NAMED_SHAPES
    from oscar_kernels import ops

    base = ops.default_config(batch)
    assert H.decode_config_for(H.BenchConfig(shape=NAMED_SHAPES["qwen3-8b"]), batch) == base
    got = H.decode_config_for(H.BenchConfig(shape=NAMED_SHAPES["qwen3-8b"], num_stages=3, magic=0), batch)
    assert (got.num_stages, got.magic, got.maxnreg, got.block_nb) == (3, 0, base.maxnreg, base.block_nb)
