"""``oscar bench``: INT2 decode attention vs the best BF16 decode available, same GPU, same run.

Data in (:class:`~oscar_cli.bench.config.BenchConfig`), a result out (:class:`~oscar_cli.bench.report.BenchResult`);
the CLI only renders it. Times are medians of ``triton.testing.do_bench`` (eager launches, after warm-up) and of
CUDA-graph replays; inputs rotate over enough copies to exceed the L2 cache (cold L2; :mod:`.timing`). Bytes moved
count everything a decode step must read or write: INT2 codes, scales and zeros, the BF16 sink and recent windows,
q, the output, rotations and the block table (:mod:`.cases`). Without CUDA :func:`run` raises
:class:`~oscar_cli.errors.KernelUnavailableError`: never a made-up number.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from oscar_cli.bench.backends import bench_bf16, bench_int2, bench_quantize, flashinfer_version, has_flashinfer
from oscar_cli.bench.cases import int2_bytes, int2_plans
from oscar_cli.bench.config import BenchConfig
from oscar_cli.bench.environment import environment, require_cuda
from oscar_cli.bench.report import BenchResult, CellResult
from oscar_cli.bench.shapes import AttnShape
from oscar_cli.bench.timing import copy_bandwidth
from oscar_cli.errors import KernelUnavailableError


def run(config: BenchConfig, progress: Callable[[str], None] | None = None) -> BenchResult:
    """Measure every (batch, context) cell of ``config``; see the module docstring."""
    device = require_cuda()
    env = environment()
    l2 = int(env["l2_bytes"] or 50 << 20)
    copy = copy_bandwidth(device)
    cells: list[CellResult] = []
    for batch in config.batches:
        for ctx in config.contexts:
            if progress:
                progress(f"batch {batch} x ctx {ctx}")
            plans, _, s = int2_plans(config.shape, batch, ctx, config, device, l2)
            i_us, i_g = bench_int2(plans, config.rep_ms, graphs=config.graphs)
            del plans  # the INT2 caches are freed before the BF16 ones are allocated
            b_us, b_g = bench_bf16(config.shape, batch, ctx, config, device, l2, graphs=config.graphs)
            cells.append(_cell(config, batch, ctx, s, i_us, i_g, b_us, b_g, copy))
            torch.cuda.empty_cache()
    quant = bench_quantize(config.shape, config.quant_tokens, config, device)
    notes = [
        "FlashInfer not measured: optional, not importable here"
        if not has_flashinfer()
        else f"FlashInfer {flashinfer_version()} measured: paged BF16 decode, pages of {config.page_size} tokens, "
        "tensor-core (flashinfer_tc) and CUDA-core (flashinfer) kernels; a cell without it did not run (see the log)"
    ]
    if config.key_mean == "rope":
        notes.append("INT2 times include the position-dependent key mean (quant.key_mean rope), its logit term "
                     "computed inside the decode kernel from the position table")
    elif config.key_mean == "rope-gemm":
        notes.append("INT2 times include the position-dependent key mean (quant.key_mean rope) in its unfused form: "
                     "per step a GEMM writing the float32 [B, H_q, L] logit term, then the decode kernel reading it; "
                     "bytes and % copy count the INT2 format's bytes only, so the term's traffic shows as a lower share")
    if config.key_bits == 4:
        notes.append("INT2 times read keys at 4 bits (quant.int4_keys): the pages' high plane plus the low plane in "
                     "the same tile, as every layer of an artifact with INT4 keys on all layers would; bytes count "
                     "the low plane")
    if config.meta_bits == 8:
        notes.append("INT2 times read 8-bit scale/zero (quant.meta_dtype uint8, formula 10), decoded in the tile; "
                     "bytes count one byte each")
    cfg = {k: (v.__dict__ if isinstance(v, AttnShape) else v) for k, v in config.__dict__.items()}
    return BenchResult(config=cfg, environment=env, copy_gbps=copy, cells=cells, quantize=quant, notes=notes)


def _cell(config: BenchConfig, batch: int, ctx: int, splits: int, i_us: float, i_g: float | None,
          b_us: dict[str, float | None], b_g: dict[str, float | None], copy: float) -> CellResult:
    """One cell from its INT2 and BF16 times: bytes, bandwidth, share of copy bandwidth, speed-ups."""
    avail = {k: v for k, v in b_us.items() if v is not None}
    if not avail:
        raise KernelUnavailableError(
            "no BF16 SDPA backend (cuDNN, flash) runs on this GPU", hint="update torch; nothing was compared"
        )
    best = min(avail, key=lambda k: avail[k])
    best_g = [v for v in b_g.values() if v is not None]
    nbytes = int2_bytes(config.shape, batch, ctx, config.sink, config.recent, config.page_size,
                        config.meta_bits // 8, config.key_bits)
    gbps = nbytes / (i_us * 1e-6) / 1e9
    return CellResult(
        batch=batch,
        ctx=ctx,
        splits=splits,
        int2_us=i_us,
        int2_graph_us=i_g,
        int2_bytes=nbytes,
        int2_gbps=gbps,
        pct_copy=100 * gbps / copy,
        bf16_us=b_us,
        bf16_graph_us=b_g,
        best_bf16=best,
        best_bf16_us=avail[best],
        speedup=avail[best] / i_us,
        speedup_graph=(min(best_g) / i_g) if (best_g and i_g) else None,
        pct_copy_graph=(100 * nbytes / (i_g * 1e-6) / 1e9 / copy) if i_g else None,
        int2_gbps_graph=(nbytes / (i_g * 1e-6) / 1e9) if i_g else None,
    )
