"""The decode kernels ``oscar bench`` times, each over rotating caches, eager and in CUDA graphs: oscar's INT2
decode, torch SDPA's cuDNN and flash backends, and FlashInfer's paged BF16 decode (optional: recorded as not run
when it is not importable or does not run here)."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from oscar_cli.bench.cases import bf16_bytes, orthogonal
from oscar_cli.bench.config import BenchConfig
from oscar_cli.bench.shapes import AttnShape
from oscar_cli.bench.timing import cycle, graph_over, median_us, rotating

log = logging.getLogger(__name__)


def bench_int2(plans: list[Any], rep_ms: int, graphs: bool = True) -> tuple[float, float | None]:
    """(eager µs, graph µs) of one INT2 decode step, cycling over the rotating caches' launch plans
    (:func:`~oscar_cli.bench.cases.int2_plans`)."""
    eager = median_us(cycle(plans, lambda p: p.run()), rep_ms)
    g = graph_over(plans, lambda p: p.run(), rep_ms) if graphs else None
    return eager, g


def bench_bf16(
    shape: AttnShape, batch: int, ctx: int, cfg: BenchConfig, device: torch.device, l2: int, graphs: bool = True
) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """torch SDPA decode (cuDNN and flash backends, ``enable_gqa``) over rotating BF16 caches, then FlashInfer's
    tensor-core and CUDA-core kernels where it is importable."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    act = cfg.activation_dtype
    nbytes = bf16_bytes(shape, batch, ctx)

    def make(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.randn(batch, shape.h_q, 1, shape.d, device=device, dtype=act)
        k = torch.randn(batch, shape.h_kv, ctx, shape.d, device=device, dtype=act)
        return q, k, torch.randn_like(k)

    sets = rotating(make, nbytes, l2, most=16)
    eager: dict[str, float | None] = {}
    graph: dict[str, float | None] = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):

        def call(t: tuple[torch.Tensor, torch.Tensor, torch.Tensor], backend: Any = backend) -> torch.Tensor:
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(t[0], t[1], t[2], enable_gqa=True)

        try:
            call(sets[0])
            torch.cuda.synchronize()
        except RuntimeError as exc:
            log.info("BF16 %s unavailable: %s", name, str(exc).splitlines()[0])
            eager[name] = graph[name] = None
            continue
        eager[name] = median_us(cycle(sets, call), cfg.rep_ms)
        graph[name] = graph_over(sets, call, cfg.rep_ms) if graphs else None
    del sets
    if has_flashinfer():
        for name, tensor_cores in (("flashinfer_tc", True), ("flashinfer", False)):
            eager[name], graph[name] = bench_flashinfer(shape, batch, ctx, cfg, device, l2, tensor_cores, graphs)
    return eager, graph


def bench_flashinfer(
    shape: AttnShape, batch: int, ctx: int, cfg: BenchConfig, device: torch.device, l2: int, tensor_cores: bool,
    graphs: bool = True,
) -> tuple[float | None, float | None]:
    """FlashInfer's paged BF16 decode (``BatchDecodeWithPagedKVCacheWrapper``, NHD pages of ``cfg.page_size``
    tokens, tensor-core or CUDA-core kernels) over rotating caches; planned once, a CUDA-graph wrapper for the
    graph time. (None, None) with a log line when it does not run here (optional baseline)."""
    import flashinfer

    act = cfg.activation_dtype
    pages_per_seq = math.ceil(ctx / cfg.page_size)
    n_pages = batch * pages_per_seq
    indptr = torch.arange(0, n_pages + 1, pages_per_seq, dtype=torch.int32, device=device)
    indices = torch.randperm(n_pages, device=device).to(torch.int32)  # pages scattered like a real pool
    last = torch.full((batch,), ctx - (pages_per_seq - 1) * cfg.page_size, dtype=torch.int32, device=device)

    def make(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.randn(batch, shape.h_q, shape.d, device=device, dtype=act)
        return q, torch.randn(n_pages, 2, cfg.page_size, shape.h_kv, shape.d, device=device, dtype=act)

    try:
        sets = rotating(make, bf16_bytes(shape, batch, ctx), l2, most=16)
        timings: list[float | None] = []
        for use_graph in (False, True) if graphs else (False,):
            ws = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
            bufs = {"paged_kv_indptr_buffer": indptr.clone(), "paged_kv_indices_buffer": indices.clone(),
                    "paged_kv_last_page_len_buffer": last.clone()} if use_graph else {}
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=use_graph,
                                                              use_tensor_cores=tensor_cores, **bufs)
            w.plan(indptr, indices, last, shape.h_q, shape.h_kv, shape.d, cfg.page_size, q_data_type=act,
                   kv_data_type=act)

            def call(t: tuple[torch.Tensor, torch.Tensor], w: Any = w) -> torch.Tensor:
                return w.run(t[0], t[1])

            call(sets[0])
            torch.cuda.synchronize()
            timings.append(graph_over(sets, call, cfg.rep_ms) if use_graph else median_us(cycle(sets, call), cfg.rep_ms))
        del sets
    except Exception as exc:  # noqa: BLE001 - an optional baseline: recorded as not run, never fatal
        log.info("FlashInfer (%s) did not run: %s", "tensor cores" if tensor_cores else "CUDA cores",
                 str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None, None
    return timings[0], (timings[1] if len(timings) > 1 else None)


def bench_quantize(shape: AttnShape, tokens: int, cfg: BenchConfig, device: torch.device) -> dict[str, Any]:
    """Quantize-on-write (rotate + centre + clip 0.96 + quantize + pack + scatter) throughput: keys in rows
    (``us``), values in token quads (``values_us``: each row clears and sets its 2 bits per byte with atomics)."""
    from oscar_kernels import ops

    pages = math.ceil(tokens / cfg.page_size)
    x = torch.randn(tokens, shape.h_kv, shape.d, device=device).to(cfg.activation_dtype)
    slots = torch.randperm(pages * cfg.page_size, device=device)[:tokens]
    r, mu = orthogonal(shape.d, device), torch.randn(shape.d, device=device) * 0.1
    moved = tokens * shape.h_kv * (shape.d * x.element_size() + shape.d // 4 + 4) + tokens * 8
    out: dict[str, Any] = {"tokens": tokens}
    for key, layout in (("", "rows"), ("values_", "token_quads")):
        cache = ops.new_paged_cache(pages, shape.h_kv, cfg.page_size, shape.d, None, torch.bfloat16, device,
                                    layout=layout)

        def write(cache: Any = cache, layout: str = layout) -> None:
            ops.quantize_write(x, cache, slots, rotation=r, mean=mu, clip_ratio=0.96, layout=layout)

        us = median_us(write, cfg.rep_ms)
        out |= {f"{key}us": us, f"{key}rows_per_s": tokens * shape.h_kv / (us * 1e-6),
                f"{key}gbps": moved / (us * 1e-6) / 1e9}
    return out


def flashinfer_version() -> str:
    import flashinfer

    return str(getattr(flashinfer, "__version__", "?"))


def has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True
