"""``oscar bench``: INT2 decode attention vs the best BF16 decode available, same GPU, same run.

Data in (:class:`BenchConfig`), a result out (:class:`BenchResult`); the CLI only renders it. Times are medians
of ``triton.testing.do_bench`` (eager launches, after warm-up) and of CUDA-graph replays; inputs rotate over
enough copies to exceed the L2 cache (cold L2). Bytes moved count everything a decode step must read or write:
INT2 codes, scales and zeros, the BF16 sink and recent windows, q, the output, rotations and the block table.
Without CUDA :func:`run` raises :class:`~oscar_cli.errors.KernelUnavailableError`: never a made-up number.
"""

from __future__ import annotations

import logging
import math
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from oscar_cli.bench.shapes import AttnShape
from oscar_cli.errors import KernelUnavailableError

log = logging.getLogger(__name__)

BF16_BACKENDS = ("cudnn", "flash")


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. Contexts count every token (sink + history + recent)."""

    shape: AttnShape
    batches: tuple[int, ...] = (1, 16)
    contexts: tuple[int, ...] = (4096, 32768, 131072)
    dtype: str = "bf16"
    page_size: int = 64
    sink: int = 64
    recent: int = 256
    num_splits: int | None = None
    # DecodeConfig fields that replace ``oscar_kernels.ops.default_config(batch)``'s (``oscar bench --kernel``)
    kernel: tuple[tuple[str, Any], ...] = ()
    graphs: bool = True
    rep_ms: int = 100
    quant_tokens: int = 16384
    seed: int = 0
    paged: bool = True  # False: the non-paged layout [B, H_kv, T, D/4] (no block-table lookups)


@dataclass(frozen=True)
class CellResult:
    """One (batch, context) cell. Times in µs; ``None`` where a backend cannot run."""

    batch: int
    ctx: int
    splits: int
    int2_us: float
    int2_graph_us: float | None
    int2_bytes: int
    int2_gbps: float  # from the eager time (Python launches: launch-bound at small sizes)
    pct_copy: float
    bf16_us: dict[str, float | None]
    bf16_graph_us: dict[str, float | None]
    best_bf16: str
    best_bf16_us: float
    speedup: float
    speedup_graph: float | None
    pct_copy_graph: float | None = None  # from the CUDA-graph time (what a serving engine runs)
    int2_gbps_graph: float | None = None  # likewise

    @property
    def best_bf16_graph_us(self) -> float | None:
        """The fastest BF16 backend's CUDA-graph time (None where none was timed in a graph)."""
        return min((v for v in self.bf16_graph_us.values() if v is not None), default=None)


@dataclass(frozen=True)
class BenchResult:
    config: dict[str, Any]
    environment: dict[str, Any]
    copy_gbps: float
    cells: list[CellResult]
    quantize: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def require_cuda() -> torch.device:
    """The CUDA device, or KernelUnavailableError naming what is missing."""
    if not torch.cuda.is_available():
        raise KernelUnavailableError(
            "oscar bench needs a CUDA GPU: torch.cuda.is_available() is False on this machine",
            hint="run it on a machine with an NVIDIA GPU and a CUDA build of torch; nothing was measured",
        )
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - triton ships with CUDA torch
        raise KernelUnavailableError("oscar bench needs triton", hint="pip install triton") from exc
    return torch.device("cuda")


def environment() -> dict[str, Any]:
    """GPU name, versions, git sha and a content hash of the kernel sources recorded with every result (the sha
    names a commit; the hash says which kernels ran even from an uncommitted or copied tree)."""
    import triton

    props = torch.cuda.get_device_properties(0)
    sha, dirty = git_state()
    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "git_sha": sha,
        "git_dirty": dirty,  # tracked files differ from git_sha (e.g. a copied tree with a stale .git): trust the digest
        "kernels_sha256": _kernels_digest(),
    }


def git_state() -> tuple[str | None, bool | None]:
    """(HEAD sha, whether tracked files differ from it) of the checkout holding this package; (None, None) outside
    git."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=here)
        except (OSError, subprocess.SubprocessError):
            return None
        return p.stdout if p.returncode == 0 else None

    sha = (git("rev-parse", "HEAD") or "").strip() or None
    status = git("status", "--porcelain", "--untracked-files=no") if sha else None
    return sha, (None if status is None else bool(status.strip()))


def _kernels_digest() -> str | None:
    """sha256 over the kernel package's ``.py`` files (names and contents, sorted by name)."""
    import hashlib

    try:
        import oscar_kernels
    except ImportError:
        return None
    h = hashlib.sha256()
    for f in sorted(Path(oscar_kernels.__file__).resolve().parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def median_us(fn: Callable[[], Any], rep_ms: int = 100) -> float:
    """Median time of ``fn`` in µs (``triton.testing.do_bench``, 25 ms warm-up)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")) * 1e3


def graph_us(fns: Sequence[Callable[..., Any]], rep_ms: int = 100) -> float | None:
    """Median µs per call of ``fns`` captured back to back in one CUDA graph (None if capture fails)."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in fns:
                f()
        return median_us(graph.replay, rep_ms) / len(fns)
    except RuntimeError as exc:
        log.info("graph capture failed: %s", exc)
        torch.cuda.synchronize()
        return None


def rotating(make: Callable[[int], Any], bytes_each: int, l2_bytes: int, most: int = 64) -> list[Any]:
    """Enough independent copies of an input set to exceed 4x the L2 cache (at least 1)."""
    n = max(1, min(most, math.ceil(4 * l2_bytes / max(bytes_each, 1))))
    return [make(i) for i in range(n)]


def graph_over(items: list[Any], call: Callable[[Any], Any], rep_ms: int = 100) -> float | None:
    """:func:`graph_us` of ``call(item)`` for every rotating input set, back to back in one graph (a single set is
    captured four times, so one replay is never a single launch)."""
    return graph_us([partial(call, t) for t in (items if len(items) > 1 else items * 4)], rep_ms)


def cycle(items: list[Any], call: Callable[[Any], Any]) -> Callable[[], Any]:
    state = {"i": 0}

    def fn() -> Any:
        state["i"] = (state["i"] + 1) % len(items)
        return call(items[state["i"]])

    return fn


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src))
    return 2 * nbytes / (us * 1e-6) / 1e9


def int2_bytes(shape: AttnShape, batch: int, ctx: int, sink: int, recent: int, page: int, meta_bytes: int = 2) -> int:
    """Bytes one INT2 decode step must move (G = D): history codes + scale + zero, BF16 tiers, q, out,
    R_K, R_V, mu_V and the block table."""
    hp = min(ctx, sink + recent)
    hist = ctx - hp
    per_tok = 2 * shape.h_kv * (shape.d // 4 + 2 * meta_bytes)
    tiers = 2 * hp * shape.h_kv * shape.d * 2
    qo = 2 * shape.h_q * shape.d * 2
    table = math.ceil(hist / page) * 4
    return batch * (hist * per_tok + tiers + qo + table) + 2 * shape.d * shape.d * 4 + shape.d * 4


def bf16_bytes(shape: AttnShape, batch: int, ctx: int) -> int:
    return batch * (2 * ctx * shape.h_kv * shape.d * 2 + 2 * shape.h_q * shape.d * 2)


def _orth(d: int, device: torch.device) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(d, d, device=device, dtype=torch.float32))[0].contiguous()


def page_geometry(cfg: BenchConfig, hist: int) -> tuple[int, int]:
    """(page size, pages per sequence): ``cfg.page_size`` pages, or one page of the whole history."""
    if cfg.paged:
        return cfg.page_size, max(1, math.ceil(hist / cfg.page_size))
    return max(64, math.ceil(hist / 64) * 64), 1


def build_int2_case(
    shape: AttnShape, batch: int, ctx: int, cfg: BenchConfig, device: torch.device, seed: int
) -> dict[str, Any]:
    """Random paged INT2 cache (shuffled pages), BF16 tiers and rotations for one decode step."""
    from oscar_kernels.reference import QuantizedRows, token_quad_row

    torch.manual_seed(seed)
    act = torch.bfloat16 if cfg.dtype == "bf16" else torch.float16
    hp = min(ctx, cfg.sink + cfg.recent)
    hist = ctx - hp
    page_size, n_pp = page_geometry(cfg, hist)
    pages = batch * n_pp
    h, d = shape.h_kv, shape.d

    def rows(values: bool = False) -> QuantizedRows:
        row = token_quad_row(page_size)  # token quads for V: rows of min(P, 64) tokens
        cshape = (pages, h, page_size // row * d, row // 4) if values else (pages, h, page_size, d // 4)
        codes = torch.randint(0, 256, cshape, dtype=torch.uint8, device=device)
        scale = (torch.rand(pages, h, page_size, 1, device=device) * 0.1 + 0.01).to(torch.bfloat16)
        zero = (torch.randn(pages, h, page_size, 1, device=device) * 0.2).to(torch.bfloat16)
        return QuantizedRows(codes, scale, zero)

    def tier(n: int) -> torch.Tensor:
        return torch.randn(batch, h, max(n, 1), d, device=device).to(act)

    s_len, r_len = min(ctx, cfg.sink), hp - min(ctx, cfg.sink)
    return {
        "q": torch.randn(batch, shape.h_q, d, device=device).to(act),
        "k_cache": rows(),
        "v_cache": rows(values=True),
        "block_table": torch.randperm(pages, device=device, dtype=torch.int32).reshape(batch, n_pp),
        "hist_len": torch.full((batch,), hist, dtype=torch.int32, device=device),
        "sink_k": tier(s_len),
        "sink_v": tier(s_len),
        "sink_len": torch.full((batch,), s_len, dtype=torch.int32, device=device),
        "recent_k": tier(r_len),
        "recent_v": tier(r_len),
        "recent_len": torch.full((batch,), r_len, dtype=torch.int32, device=device),
        "rotation_k": _orth(d, device),
        "rotation_v": _orth(d, device),
        "mean_v": torch.randn(d, device=device) * 0.1,
    }


def int2_plan(case: dict[str, Any], splits: int, config: Any, workspace: Any, out: torch.Tensor,
              paged: bool = True) -> Any:
    """A validated :class:`oscar_kernels.ops.DecodePlan` over one case (launch with ``.run()``)."""
    from oscar_kernels import ops

    keys = ("k_cache", "v_cache", "block_table", "hist_len", "sink_k", "sink_v", "sink_len",
            "recent_k", "recent_v", "recent_len")
    return ops.DecodePlan(case["q"], *(case[k] for k in keys), rotation_k=case["rotation_k"],
                          rotation_v=case["rotation_v"], mean_v=case["mean_v"], num_splits=splits,
                          config=config, workspace=workspace, out=out, paged=paged)


def decode_config_for(cfg: BenchConfig, batch: int) -> Any:
    """``oscar_kernels.ops.default_config(batch)`` with the fields the bench config overrides (all others kept)."""
    from dataclasses import replace

    from oscar_kernels import ops

    return replace(ops.default_config(batch), **dict(cfg.kernel))


def int2_plans(
    shape: AttnShape,
    batch: int,
    ctx: int,
    cfg: BenchConfig,
    device: torch.device,
    l2: int,
    decode_config: Any = None,
    splits: int | None = None,
) -> tuple[list[Any], list[dict[str, Any]], int]:
    """(launch plans, their cases, split count) of one INT2 decode step over enough rotating caches to exceed
    the L2 (cold-cache timing); the plans share one workspace and output. Benchmarks and GPU scripts build
    their measurements on these."""
    from oscar_kernels import ops

    dc = decode_config or decode_config_for(cfg, batch)
    hist = max(ctx - cfg.sink - cfg.recent, 0)
    ps, n_pp = page_geometry(cfg, hist)
    s = splits or cfg.num_splits or ops.default_num_splits(batch, shape.h_kv, ps * n_pp, dc.block_n, device)
    nbytes = int2_bytes(shape, batch, ctx, cfg.sink, cfg.recent, cfg.page_size)
    cases = rotating(lambda i: build_int2_case(shape, batch, ctx, cfg, device, cfg.seed + i), nbytes, l2)
    ws = ops.make_workspace(batch, shape.h_q, shape.d, s, device)
    out = torch.empty(batch, shape.h_q, shape.d, dtype=cases[0]["q"].dtype, device=device)
    return [int2_plan(c, s, dc, ws, out, cfg.paged) for c in cases], cases, s


def bench_int2(
    shape: AttnShape,
    batch: int,
    ctx: int,
    cfg: BenchConfig,
    device: torch.device,
    l2: int,
    decode_config: Any = None,
    splits: int | None = None,
    graphs: bool = True,
) -> tuple[float, float | None, int]:
    """(eager µs, graph µs, splits) of one INT2 decode step over rotating caches."""
    plans, _, s = int2_plans(shape, batch, ctx, cfg, device, l2, decode_config, splits)
    eager = median_us(cycle(plans, lambda p: p.run()), cfg.rep_ms)
    g = graph_over(plans, lambda p: p.run(), cfg.rep_ms) if graphs else None
    return eager, g, s


def bench_bf16(
    shape: AttnShape, batch: int, ctx: int, cfg: BenchConfig, device: torch.device, l2: int, graphs: bool = True
) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """torch SDPA decode (cuDNN and flash backends, ``enable_gqa``) over rotating BF16 caches."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    act = torch.bfloat16 if cfg.dtype == "bf16" else torch.float16
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
    if _has_flashinfer():
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

    act = torch.bfloat16 if cfg.dtype == "bf16" else torch.float16
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

    act = torch.bfloat16 if cfg.dtype == "bf16" else torch.float16
    pages = math.ceil(tokens / cfg.page_size)
    x = torch.randn(tokens, shape.h_kv, shape.d, device=device).to(act)
    slots = torch.randperm(pages * cfg.page_size, device=device)[:tokens]
    r, mu = _orth(shape.d, device), torch.randn(shape.d, device=device) * 0.1
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
            i_us, i_g, s = bench_int2(config.shape, batch, ctx, config, device, l2, graphs=config.graphs)
            b_us, b_g = bench_bf16(config.shape, batch, ctx, config, device, l2, graphs=config.graphs)
            avail = {k: v for k, v in b_us.items() if v is not None}
            if not avail:
                raise KernelUnavailableError(
                    "no BF16 SDPA backend (cuDNN, flash) runs on this GPU", hint="update torch; nothing was compared"
                )
            best = min(avail, key=lambda k: avail[k])
            best_g = [v for v in b_g.values() if v is not None]
            nbytes = int2_bytes(config.shape, batch, ctx, config.sink, config.recent, config.page_size)
            gbps = nbytes / (i_us * 1e-6) / 1e9
            cells.append(
                CellResult(
                    batch=batch,
                    ctx=ctx,
                    splits=s,
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
            )
            torch.cuda.empty_cache()
    quant = bench_quantize(config.shape, config.quant_tokens, config, device)
    notes = [
        "FlashInfer not measured: optional, not importable here"
        if not _has_flashinfer()
        else f"FlashInfer {_flashinfer_version()} measured: paged BF16 decode, pages of {config.page_size} tokens, "
        "tensor-core (flashinfer_tc) and CUDA-core (flashinfer) kernels; a cell without it did not run (see the log)"
    ]
    cfg = {k: (v.__dict__ if isinstance(v, AttnShape) else v) for k, v in config.__dict__.items()}
    return BenchResult(config=cfg, environment=env, copy_gbps=copy, cells=cells, quantize=quant, notes=notes)


def _flashinfer_version() -> str:
    import flashinfer

    return str(getattr(flashinfer, "__version__", "?"))


def _has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def result_from_json(record: dict[str, Any]) -> BenchResult:
    """A :class:`BenchResult` back from ``oscar --json bench`` output (``KeyError``/``TypeError`` on other JSON)."""
    return BenchResult(config=record["config"], environment=record["environment"], copy_gbps=record["copy_gbps"],
                       cells=[CellResult(**c) for c in record["cells"]], quantize=record["quantize"],
                       notes=list(record.get("notes", [])))


def plot_series(result: BenchResult) -> tuple[str, list[tuple[str, list[int], list[float]]]]:
    """(timing, [(label, contexts, µs)]) of :func:`save_plot`: per batch size INT2 and the best BF16 backend, from the
    CUDA-graph times when every cell has them (what serving runs and what the docs report; eager times of small
    cells are Python-launch-bound), else from the eager times."""
    graph = all(c.int2_graph_us is not None and c.best_bf16_graph_us is not None for c in result.cells)
    series = []
    for batch in sorted({c.batch for c in result.cells}):
        cs = sorted((c for c in result.cells if c.batch == batch), key=lambda c: c.ctx)
        xs = [c.ctx for c in cs]
        if graph:
            int2 = [float(c.int2_graph_us or 0.0) for c in cs]
            bf16 = [float(c.best_bf16_graph_us or 0.0) for c in cs]
        else:
            int2, bf16 = [c.int2_us for c in cs], [c.best_bf16_us for c in cs]
        series += [(f"INT2 B={batch}", xs, int2), (f"best BF16 B={batch}", xs, bf16)]
    return ("CUDA graph" if graph else "eager"), series


def save_plot(result: BenchResult, path: Path) -> Path:
    """PNG: decode time vs context, INT2 vs best BF16, one line pair per batch size (log scale; CUDA-graph times
    when measured, see :func:`plot_series`), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timing, series = plot_series(result)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    color = None
    for label, xs, ys in series:
        if label.startswith("INT2"):
            color = ax.plot(xs, ys, marker="o", label=label)[0].get_color()
        else:
            ax.plot(xs, ys, marker="s", ls="--", color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(f"decode attention, one layer (µs, median, {timing})")
    cfg = result.config
    pages = f"pages of {cfg.get('page_size')} tokens" if cfg.get("paged", True) else "non-paged"
    ax.set_title(f"{cfg['shape']['name']} on {result.environment['gpu']}, {pages}")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(path)
    return path
