"""``oscar bench``: INT2 decode attention vs the best BF16 decode (cuDNN / flash SDPA, FlashInfer when importable)
on this GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from oscar_cli import _output
from oscar_cli._options import format_ctx, parse_ctx_list
from oscar_cli.errors import OscarError

EXAMPLES = """
[bold]Examples[/bold]

  oscar bench                                           # qwen3-8b layer, batch 1,16 x ctx 4k,32k,128k
  oscar bench --shape llama-3.1-8b --batch 1,4,16,64   # another model's attention shape
  oscar bench --shape 32,8,128 --ctx 8k,64k --plot bench.png
  oscar --json bench > bench.json                       # GPU name, versions, git sha and every number
  oscar bench --ctx 128k --kernel hist_stages=2         # a single-buffered INT2 loop, same harness
  oscar bench --batch 16 --page-size 16                  # vLLM-sized pages (INT2 and FlashInfer alike)
  oscar bench --ctx 32k,128k --key-mean rope           # with the position-dependent key mean's logit term
  oscar bench --ctx 128k --key-mean rope-gemm          # the same term as a GEMM the kernel reads (unfused)
  oscar bench --key-mean rope --key-bits 4             # a layer with INT4 keys (quant.int4_keys): both planes
  oscar bench --key-mean rope --meta-bits 8            # one-byte scale/zero (quant.meta_dtype uint8)
  oscar bench --replot bench.json --plot bench.png      # plot a saved --json record again (no GPU needed)
"""


def _us(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.1f}"


def _best(times: dict[str, float | None], prefix: str) -> float | None:
    """The fastest of the backends named ``prefix*`` that ran (FlashInfer: tensor-core and CUDA-core kernels)."""
    return min((v for k, v in times.items() if k.startswith(prefix) and v is not None), default=None)


def _render(res: Any) -> None:
    env = res.environment
    t = Table(title=f"decode attention, one {res.config['shape']['name']} layer on {env['gpu']} "
              f"(copy {res.copy_gbps / 1e3:.2f} TB/s; µs medians: eager / CUDA graph)", title_justify="left")
    for col in ("batch", "ctx", "splits", "INT2 µs", "INT2 graph", "GB/s graph", "% copy", "% copy graph", "cuDNN µs",
                "flash µs", "FlashInfer µs", "best BF16 graph", "speed-up", "speed-up graph"):
        t.add_column(col, justify="right")
    for c in res.cells:
        t.add_row(str(c.batch), format_ctx(c.ctx), str(c.splits), _us(c.int2_us), _us(c.int2_graph_us),
                  "n/a" if c.int2_gbps_graph is None else f"{c.int2_gbps_graph:,.0f}", f"{c.pct_copy:.0f}%",
                  "n/a" if c.pct_copy_graph is None else f"{c.pct_copy_graph:.0f}%", _us(c.bf16_us.get("cudnn")),
                  _us(c.bf16_us.get("flash")), _us(_best(c.bf16_us, "flashinfer")), _us(c.best_bf16_graph_us), f"{c.speedup:.2f}x",
                  "n/a" if c.speedup_graph is None else f"{c.speedup_graph:.2f}x")
    _output.stdout.print(t)
    q = res.quantize
    _output.stdout.print(f"quantize-on-write: {q['tokens']} tokens x {res.config['shape']['h_kv']} KV heads in "
                         f"{q['us']:,.1f} µs = {q['rows_per_s'] / 1e6:,.1f} M rows/s ({q['gbps']:,.0f} GB/s) for keys, "
                         f"{q['values_us']:,.1f} µs for values (token quads)")
    for n in res.notes:
        _output.stdout.print(f"note: {n}")


def _replot(record: Path, plot: Path | None) -> None:
    """``--replot``: the plot of a saved JSON record (atomic write), nothing measured."""
    import json

    from oscar_cli.bench import report

    if plot is None:
        raise typer.BadParameter("--replot needs --plot PATH (where to write the PNG)", param_hint="--replot")
    try:
        res = report.result_from_json(json.loads(record.read_text()))
    except OSError as exc:
        raise OscarError(f"cannot read the bench record {record}: {exc.strerror}") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise OscarError(f"{record} is not an `oscar --json bench` record ({type(exc).__name__}: {exc})",
                         hint="pass the JSON that `oscar --json bench` printed") from exc
    try:
        report.save_plot(res, plot)
    except OSError as exc:
        raise OscarError(f"cannot write the plot to {plot}: {exc.strerror}") from exc
    doc = {"record": str(record), "plot": str(plot), "cells": len(res.cells)}
    _output.emit(doc, lambda d: _output.info(f"plot of {record} ({d['cells']} cells) written to {plot}"))


def bench(
    shape: Annotated[str, typer.Option("--shape", help="qwen3-8b | llama-3.1-8b | smollm2-135m | H_Q,H_KV,D")] = "qwen3-8b",
    batch: Annotated[str, typer.Option("--batch", help="Batch sizes, comma-separated.")] = "1,16",
    ctx: Annotated[str, typer.Option("--ctx", help="Context lengths (all tiers), e.g. 4k,32k,128k.")] = "4k,32k,128k",
    dtype: Annotated[str, typer.Option("--dtype", help="Activation dtype: bf16 | fp16.")] = "bf16",
    splits: Annotated[int | None, typer.Option("--splits", help="INT2 split count (default: from shapes).")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG plot of time vs context here.")] = None,
    graphs: Annotated[bool, typer.Option("--graphs/--no-graphs", help="Also time CUDA-graph replays.")] = True,
    paged: Annotated[bool, typer.Option("--paged/--contiguous",
                                        help="INT2 cache layout: shuffled pages of --page-size tokens, or one "
                                             "[B, H_kv, T, D/4] block per sequence.")] = True,
    page_size: Annotated[int, typer.Option("--page-size", help="Tokens per page (INT2 and FlashInfer): a multiple of "
                                                               "16, of 64 above 64.")] = 64,
    replot: Annotated[Path | None, typer.Option(
        "--replot", help="Plot a saved `oscar --json bench` record to --plot instead of measuring (no GPU).")] = None,
    kernel: Annotated[str | None, typer.Option(
        "--kernel", help="Decode-kernel knobs KEY=VALUE,... (DecodeConfig fields, e.g. hist_stages=2,maxnreg=none,pdl=false); "
                         "the rest stay default_config(batch).")] = None,
    key_mean: Annotated[str, typer.Option(
        "--key-mean", help="constant | rope | rope-gemm: rope times each INT2 step as a quant.key_mean rope artifact "
                           "runs on the Triton path (the decode kernel adds the per-key logit term itself); rope-gemm "
                           "the unfused form (the term's GEMM into a [B, H_q, L] tensor, then the kernel reading "
                           "it).")] = "constant",
    key_bits: Annotated[int, typer.Option(
        "--key-bits", help="2 | 4: 4 times each INT2 step reading keys at 4 bits, as the layers of an artifact's "
                           "quant.int4_keys run on the Triton path (the decode kernel reads the low plane beside the "
                           "pages' high plane).")] = 2,
    meta_bits: Annotated[int, typer.Option(
        "--meta-bits", help="16 | 8: 8 times each INT2 step reading one-byte scale and zero (quant.meta_dtype uint8, "
                            "docs/METHOD.md §6), decoded in the decode kernel's tile.")] = 16,
) -> None:
    """Time INT2 decode attention against the best BF16 decode on this GPU (needs CUDA)."""
    from oscar_cli.bench.kernel_options import parse_kernel_options
    from oscar_cli.bench.shapes import parse_int_list, parse_shape

    if replot is not None:
        _replot(replot, plot)
        return

    try:
        cfg_shape = parse_shape(shape)
        batches = tuple(parse_int_list(batch))
        ctxs = tuple(parse_ctx_list(ctx))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    try:
        knobs = parse_kernel_options(kernel)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--kernel") from exc
    if page_size < 16 or page_size % 16 or (page_size > 64 and page_size % 64):
        raise typer.BadParameter(f"--page-size must be a multiple of 16 (of 64 above 64), got {page_size}")
    if key_mean not in ("constant", "rope", "rope-gemm"):
        raise typer.BadParameter(f"--key-mean must be constant, rope or rope-gemm, got {key_mean!r}")
    if key_bits not in (2, 4):
        raise typer.BadParameter(f"--key-bits must be 2 or 4, got {key_bits}")
    if meta_bits not in (8, 16):
        raise typer.BadParameter(f"--meta-bits must be 16 or 8, got {meta_bits}")
    if dtype not in ("bf16", "fp16"):
        raise typer.BadParameter(f"--dtype must be bf16 or fp16, got {dtype!r}")
    from oscar_cli.bench import harness, report
    from oscar_cli.bench.config import BenchConfig

    config = BenchConfig(shape=cfg_shape, batches=batches, contexts=ctxs, dtype=dtype, num_splits=splits,
                         graphs=graphs, paged=paged, page_size=page_size, kernel=knobs, key_mean=key_mean,
                         key_bits=key_bits, meta_bits=meta_bits)
    with _output.progress(log="bench") as p:
        task = p.add_task("bench", total=len(batches) * len(ctxs))

        def step(msg: str) -> None:
            p.update(task, description=msg)
            p.advance(task)

        from oscar_kernels.ops import ConfigError

        try:
            res = harness.run(config, progress=step)
        except ConfigError as exc:
            raise OscarError(f"--kernel {kernel}: {exc}", hint="see DecodeConfig in oscar_kernels/decode_ops.py for legal "
                             "values") from exc
    if plot is not None:
        try:
            report.save_plot(res, plot)
        except OSError as exc:
            raise OscarError(f"cannot write the plot to {plot}: {exc.strerror}") from exc
    if _output.SETTINGS.json:
        from dataclasses import asdict

        _output.emit_json(asdict(res) | {"plot": str(plot) if plot else None})
    else:
        _render(res)
        if plot is not None:
            _output.info(f"plot written to {plot}")


def register(app: typer.Typer) -> None:
    """Add ``oscar bench`` to the root app."""
    app.command("bench", help=bench.__doc__, epilog=EXAMPLES)(bench)
