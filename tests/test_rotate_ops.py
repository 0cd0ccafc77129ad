"""The Triton K/V rotation (``ops.rotate_kv``) vs torch's ``(x.float() @ R).to(dtype)`` (``core.torch_rotate``, what the
vLLM layer ran before and still runs above ``core.ROTATE_TRITON_MAX_ROWS`` tokens), and the layer's choice between them.

Criteria (the float32 sums are in another order than torch's, so they may differ in their last bits): before the cast
(``dtype=float32``) every element is within ``1e-5 · (|x| @ |R|)`` of torch's float32 product; the rounded outputs
are the kernel's own float32 sums rounded to nearest even, bitwise, and equal to torch's rounded outputs but for at
most 0.1 % of the elements for bf16 (0.8 % for fp16; at least one allowed), which are one unit in the last place away.
(A float32 summation order other than torch's flips the rounding of about 0.01 % of bf16 and 0.1 % of fp16 outputs
for such inputs, measured on the CPU against the exactly rounded and the reversed sums: fp16 keeps 3 more bits, so
8× the flips. Over this file's CPU cases the interpreter's float32 sums differ from torch's in 13 % of the elements,
at most 1.2e-7 of the scale, and 6 of 62,592 fp16 elements and no bf16 one round differently; on CUDA both orders
change.) CPU runs use the
Triton interpreter; the kernel rounds to bfloat16 with integer arithmetic (the interpreter's cast truncates), so
bf16 runs here too; ``-m gpu`` checks the engine's shapes against cuBLAS.
"""

from __future__ import annotations

import pytest
import torch

from oscar_cli.vllm import core, debug
from oscar_cli.vllm.core import TorchTiers, TritonKernels, torch_rotate
from oscar_kernels import ops

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DTYPE_IDS = ["fp16", "bf16", "fp32"]


def _rotation(g: torch.Generator, form: str, h: int, d: int) -> torch.Tensor:
    """A random orthogonal float32 ``[D, D]`` (``form="shared"``) or ``[H_kv, D, D]`` (``"head"``)."""
    m = torch.randn(1 if form == "shared" else h, d, d, generator=g, dtype=torch.float64)
    q = torch.linalg.qr(m)[0].float()
    return (q[0] if form == "shared" else q).contiguous().to(DEV)


def _kv(g: torch.Generator, n: int, h: int, d: int, layout: str, dtype: torch.dtype,
        h_q: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[N, H_kv, D]``: rows spread over many binades (both signs, some exact zeros), laid out as views into a
    vLLM-style qkv output ``[N, (H_q + 2 H_kv) · D]`` (``"qkv"``), contiguous, or head-major ``[H_kv, N, D]``
    transposed (``"heads"``)."""
    def spread(x: torch.Tensor) -> torch.Tensor:
        x = x * torch.exp2(torch.randint(-5, 6, (*x.shape[:-1], 1), generator=g).float())
        x[..., ::9] = 0.0
        return x.to(dtype).to(DEV)

    if layout == "qkv":
        w = (h_q + 2 * h) * d
        qkv = spread(torch.randn(n, h_q + 2 * h, d, generator=g))  # (a view keeps a one-row stride only for N > 1)
        return qkv.as_strided((n, h, d), (w, d, 1), h_q * d), qkv.as_strided((n, h, d), (w, d, 1), (h_q + h) * d)
    if layout == "heads":
        return (spread(torch.randn(h, n, d, generator=g)).transpose(0, 1) for _ in range(2))  # type: ignore[return-value]
    return spread(torch.randn(n, h, d, generator=g)), spread(torch.randn(n, h, d, generator=g))


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """Bit patterns of a 16-bit float tensor as integers in the order of the values (+0 and -0 both 0)."""
    b = x.contiguous().view(torch.int16).cpu().to(torch.int32)
    mag = b & 0x7FFF
    return torch.where(b < 0, -mag, mag)


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at ``|x|`` (float32 values; subnormals included)."""
    fi = torch.finfo(dtype)
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(fi.smallest_normal)))) * fi.eps


def _check(got: tuple[torch.Tensor, torch.Tensor], got32: tuple[torch.Tensor, torch.Tensor],
           xs: tuple[torch.Tensor, torch.Tensor], rs: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> None:
    mismatched, total = 0, 0
    share = 1e-3 if dtype == torch.bfloat16 else 8e-3  # (fp32 outputs: no rounding, no count)
    for name, y, y32, x, r in zip(("k", "v"), got, got32, xs, rs, strict=True):
        assert y.dtype == dtype and y32.dtype == torch.float32 and y.shape == x.shape and y.is_contiguous(), name
        want32 = torch_rotate(x, r, torch.float32)
        ax = x.float().abs()
        scale = ax @ r.abs() if r.dim() == 2 else torch.einsum("nhd,hde->nhe", ax, r.abs())
        err = (y32 - want32).abs()
        assert bool((err <= 1e-5 * scale + 1e-30).all()), \
            f"{name}: float32 error {err.max().item():.3g} (scale {scale.max().item():.3g})"
        if dtype == torch.float32:
            assert torch.equal(y, y32), f"{name}: the float32 output is not the float32 sums"
            continue
        # the rounded output is the kernel's own float32 sum rounded to nearest even, bitwise
        assert torch.equal(y.view(torch.int16), y32.to(dtype).view(torch.int16)), f"{name}: not rn(float32 sums)"
        # against torch's own rounding: identical float32 sums round identically; where the sums differ (another
        # summation order: numpy's BLAS in the interpreter, torch's CPU GEMM here, and which one sums how depends on
        # the CPU), by at most one ulp more than the float32 difference spans (cancellation makes that several ulps
        # of a small output)
        dist = (_ordered(y) - _ordered(torch_rotate(x, r, dtype))).abs()
        same = (y32 == want32).cpu()  # (_ordered's integers are on the CPU)
        if bool(same.any()):
            assert int(dist[same].max()) == 0, f"{name}: equal float32 sums rounded apart"
        allowed = 1 + torch.ceil((y32 - want32).abs() / _ulp(want32, dtype)).to(torch.int32).cpu()
        assert bool((dist <= allowed).all()), f"{name}: {int((dist - allowed).max())} ulps past the float32 difference"
        mismatched += int((dist != 0).sum())
        total += dist.numel()
    assert mismatched <= max(1, int(share * total)), f"{mismatched} of {total} elements round differently from torch"


CASES = [
    # id, N, H_kv, D, layout, K rotation form, V rotation form
    ("n1-h1-d64-qkv-shared-shared", 1, 1, 64, "qkv", "shared", "shared"),
    ("n1-h8-d128-qkv-head-shared", 1, 8, 128, "qkv", "head", "shared"),
    ("n3-h2-d64-qkv-shared-head", 3, 2, 64, "qkv", "shared", "head"),
    ("n3-h1-d128-contig-head-head", 3, 1, 128, "contig", "head", "head"),
    ("n17-h2-d128-qkv-head-shared", 17, 2, 128, "qkv", "head", "shared"),
    ("n17-h8-d64-heads-shared-shared", 17, 8, 64, "heads", "shared", "shared"),
    ("n64-h2-d64-qkv-head-head", 64, 2, 64, "qkv", "head", "head"),
    ("n64-h1-d128-heads-shared-head", 64, 1, 128, "heads", "shared", "head"),
]


@pytest.mark.unit
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_rotate_kv_matches_torch(case: tuple, dtype: torch.dtype) -> None:
    name, n, h, d, layout, form_k, form_v = case
    g = torch.Generator().manual_seed(len(name) * 31 + n)
    k, v = _kv(g, n, h, d, layout, dtype)
    rs = (_rotation(g, form_k, h, d), _rotation(g, form_v, h, d))
    before = (k.clone(), v.clone())
    got = ops.rotate_kv(k, v, *rs)
    got32 = ops.rotate_kv(k, v, *rs, dtype=torch.float32)
    _check(got, got32, (k, v), rs, dtype)
    assert torch.equal(k, before[0]) and torch.equal(v, before[1]), "an input was modified"


@pytest.mark.unit
@pytest.mark.parametrize("block_t", [16, 32, 64])
def test_rotate_kv_into_given_outputs(block_t: int) -> None:
    """``out``: slices of larger buffers are filled and returned, nothing past them written; either token tile."""
    n, h, d = 17, 2, 64
    g = torch.Generator().manual_seed(block_t)
    k, v = _kv(g, n, h, d, "qkv", torch.float16)
    rs = (_rotation(g, "head", h, d), _rotation(g, "shared", h, d))
    bufs = [torch.full((n + 5, h, d), float("nan"), dtype=torch.float16, device=DEV) for _ in range(2)]
    out = (bufs[0][:n], bufs[1][:n])
    got = ops.rotate_kv(k, v, *rs, out=out, block_t=block_t)
    assert got[0] is out[0] and got[1] is out[1]
    # the float32 sums of the same tile (another tile is another summation order in the interpreter's BLAS)
    _check(got, ops.rotate_kv(k, v, *rs, dtype=torch.float32, block_t=block_t), (k, v), rs, torch.float16)
    assert all(bool(torch.isnan(b[n:]).all()) for b in bufs), "wrote past the outputs"
    empty = ops.rotate_kv(k[:0], v[:0], *rs)
    assert empty[0].shape == (0, h, d) and empty[1].dtype == torch.float16


@pytest.mark.unit
def test_rotate_kv_refuses_bad_arguments() -> None:
    n, h, d = 3, 2, 64
    k = torch.zeros(n, h, d, dtype=torch.float16, device=DEV)
    r = torch.eye(d, device=DEV)
    cases = [
        ((k.double(), k, r, r), {}, "k: expected"),
        ((k.int(), k, r, r), {}, "k: expected"),
        ((k[0], k, r, r), {}, "k: expected"),
        ((torch.zeros(n, h, 96, dtype=torch.float16, device=DEV),) * 2 + (torch.eye(96, device=DEV),) * 2, {},
         "D 64 or 128"),
        (([1.0], k, r, r), {}, "k: expected a torch.Tensor"),
        ((k.transpose(1, 2).contiguous().transpose(1, 2), k, r, r), {}, "k: expected a contiguous last dim"),
        ((k, k.bfloat16(), r, r), {}, "v: expected"),
        ((k, k[:2], r, r), {}, "v: expected"),
        ((k, k.transpose(1, 2).contiguous().transpose(1, 2), r, r), {}, "v: expected a contiguous last dim"),
        ((k, k, r.double(), r), {}, "r_k: expected float32"),
        ((k, k, r, r.half()), {}, "r_v: expected float32"),
        ((k, k, r, r.expand(h + 1, d, d)), {}, "r_v: expected float32"),
        ((k, k, r[:32], r), {}, "r_k: expected float32"),
        ((k, k, r, r), {"dtype": torch.int8}, "dtype: expected"),
        ((k, k, r, r), {"out": (k.float(), k.half())}, r"out\[1\]: expected"),
        ((k, k, r, r), {"out": (k[:2], k[:2])}, r"out\[0\]: expected"),
        ((k, k, r, r), {"out": (k, k), "dtype": torch.float32}, r"out\[0\]: expected"),
        ((k, k, r, r), {"out": (k.clone(), k.transpose(1, 2).contiguous().transpose(1, 2))},
         r"out\[1\]: expected a contiguous last dim"),
        ((k, k, r, r), {"block_t": 24}, "block_t, block_e"),
        ((k, k, r, r), {"block_e": 128}, "block_t, block_e"),
    ]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            ops.rotate_kv(*args, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- the layer's choice
@pytest.mark.unit
def test_triton_kernels_rotate_up_to_the_threshold_then_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TritonKernels.rotate_kv``: ``ops.rotate_kv`` for up to ``ROTATE_TRITON_MAX_ROWS`` tokens, torch (bitwise
    ``torch_rotate``, the twin's) above it or everywhere with ``torch_rotate=True`` (``OSCAR_VLLM_TORCH_ROTATE=1``)."""
    calls: list[int] = []

    def fake(k: torch.Tensor, v: torch.Tensor, r_k: torch.Tensor, r_v: torch.Tensor, *, dtype: torch.dtype,
             query: object = None):
        calls.append(int(k.shape[0]))
        return torch.zeros(k.shape, dtype=dtype), torch.zeros(v.shape, dtype=dtype)

    monkeypatch.setattr(ops, "rotate_kv", fake)
    g = torch.Generator().manual_seed(0)
    h, d, big = 2, 64, core.ROTATE_TRITON_MAX_ROWS
    assert big == 4096  # measured on an H100: ops.rotate_kv wins or ties up to 4,096 tokens (docs/VLLM.md)
    rk, rv = (_rotation(g, form, h, d).cpu() for form in ("head", "shared"))
    k = torch.randn(big + 1, h, d, generator=g).bfloat16()
    v = torch.randn(big + 1, h, d, generator=g).bfloat16()
    twin = TorchTiers().rotate_kv(k, v, rk, rv, torch.bfloat16)
    for kern, n, to_ops in ((TritonKernels(), big, True), (TritonKernels(), big + 1, False),
                            (TritonKernels(torch_rotate=True), 1, False)):
        calls.clear()
        got = kern.rotate_kv(k[:n], v[:n], rk, rv, torch.bfloat16)
        assert calls == ([n] if to_ops else [])
        if not to_ops:
            assert torch.equal(got[0], twin[0][:n]) and torch.equal(got[1], twin[1][:n])
    assert debug.torch_rotate_forced() is False
    monkeypatch.setenv(debug.TORCH_ROTATE_ENV, "1")
    assert debug.torch_rotate_forced() is True
    monkeypatch.setenv(debug.TORCH_ROTATE_ENV, "0")
    assert debug.torch_rotate_forced() is False
    monkeypatch.setenv(debug.TORCH_ROTATE_ENV, "yes")
    with pytest.raises(ValueError, match="expected 0 or 1"):
        debug.torch_rotate_forced()


@pytest.mark.unit
def test_layer_rotate_goes_through_the_kernels() -> None:
    """``PagedInt2Layer.rotate`` on K/V views into a qkv output: the Triton kernels' result meets the criteria against
    the torch twin's, which is ``torch_rotate`` bitwise."""
    from oscar_cli.vllm import layout

    n, hq, h, d = 5, 4, 2, 64
    g = torch.Generator().manual_seed(1)
    rk, rv = _rotation(g, "head", h, d), _rotation(g, "shared", h, d)
    t = layout.LayerTensors(rk, rv, torch.zeros(h, d), torch.zeros(h, d), 0.0, 0.0)
    s = layout.Int2Settings(sink=4, recent=8)
    k, v = _kv(g, n, h, d, "qkv", torch.float16, h_q=hq)
    got, want = [core.PagedInt2Layer(t, s, 2, hq, h, d, 16, torch.float16, DEV,
                                     kernels=kern).rotate(k, v)[:2]  # type: ignore[arg-type]
                 for kern in (TritonKernels(), TorchTiers())]
    assert torch.equal(want[0], torch_rotate(k, rk, torch.float16)) and torch.equal(want[1], torch_rotate(v, rv, torch.float16))
    _check(got, ops.rotate_kv(k, v, rk, rv, dtype=torch.float32), (k, v), (rk, rv), torch.float16)


# ---------------------------------------------------------------------------- GPU: the engine's shapes vs cuBLAS
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("forms", [("shared", "shared"), ("head", "shared"), ("head", "head")],
                         ids=["shared", "k-head", "head"])
@pytest.mark.parametrize("n", [1, 64, 512])
def test_rotate_kv_bf16_engine_shapes_on_gpu(n: int, forms: tuple[str, str]) -> None:
    """bf16 K/V views into a Qwen3-8B-shaped qkv output (32 query, 8 KV heads, D = 128), up to vLLM's largest captured
    batch: the criteria against cuBLAS's float32 GEMM (``torch_rotate`` on CUDA, TF32 off as by default)."""
    assert not torch.backends.cuda.matmul.allow_tf32
    h, d = 8, 128
    g = torch.Generator().manual_seed(n)
    k, v = _kv(g, n, h, d, "qkv", torch.bfloat16, h_q=32)
    rs = (_rotation(g, forms[0], h, d), _rotation(g, forms[1], h, d))
    got = ops.rotate_kv(k, v, *rs)
    _check(got, ops.rotate_kv(k, v, *rs, dtype=torch.float32), (k, v), rs, torch.bfloat16)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_rotate_kv_replays_in_a_cuda_graph() -> None:
    """Captured once into fixed outputs, a replay over new K/V (written in place) gives the eager launch's bits."""
    n, h, d = 8, 8, 128
    g = torch.Generator().manual_seed(7)
    k, v = _kv(g, n, h, d, "qkv", torch.bfloat16, h_q=32)
    rs = (_rotation(g, "head", h, d), _rotation(g, "shared", h, d))
    out = (torch.empty(n, h, d, dtype=torch.bfloat16, device=DEV), torch.empty(n, h, d, dtype=torch.bfloat16, device=DEV))
    ops.rotate_kv(k, v, *rs, out=out)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.rotate_kv(k, v, *rs, out=out)
    k2, v2 = _kv(g, n, h, d, "qkv", torch.bfloat16, h_q=32)
    k.copy_(k2)
    v.copy_(v2)
    graph.replay()
    want = ops.rotate_kv(k, v, *rs)
    torch.cuda.synchronize()
    for a, b in zip(out, want, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


# ---------------------------------------------------------------------------- the decode's queries in the same launch
@pytest.mark.unit
@pytest.mark.parametrize(("n", "bq", "hq", "form"), [(1, 1, 8, "shared"), (5, 3, 6, "head"), (20, 17, 2, "shared"),
                                                     (0, 2, 4, "head"), (3, 9, 8, "head")],
                         ids=["n1-b1-group4", "n5-b3-group3-perhead", "n20-b17-group1", "n0-b2-queries-only",
                              "n3-b9-group4-three-programs"])
def test_rotate_kv_query_jobs_equal_the_decode_rotation(n: int, bq: int, hq: int, form: str) -> None:
    """``rotate_kv(query=GatherQuery(...))`` (``OSCAR_VLLM_DIRECT_TIERS``): K and V come out bitwise as without the
    query, and ``query.out`` holds bit for bit what the decode plan's rotation kernel writes (the same tile
    function), for GQA groups of 4, 3 (padded to 16 rows) and 1, batches of queries below, equal to and above one
    token tile, shared and per-head rotations."""
    from oscar_kernels.launch_checks import triton_modules

    h, d = 2, 64
    g = torch.Generator().manual_seed(n + 7 * bq)
    rk, rv = _rotation(g, form, h, d), _rotation(g, "shared", h, d)
    k, v = _kv(g, n, h, d, "contiguous", torch.float16)
    q = (torch.randn(bq, hq, d, generator=g) * 3).to(torch.float16).to(DEV)
    scale = ops.query_scale(None, d)
    out = torch.full_like(q, float("nan"))
    got = ops.rotate_kv(k, v, rk, rv, query=ops.GatherQuery(q, rk, out, scale))
    plain = ops.rotate_kv(k, v, rk, rv)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])
    want = torch.full_like(q, float("nan"))
    grp = hq // h
    triton_modules()[1]._rotate_q_kernel[(bq * h, d // 32)](
        q, q.stride(0), q.stride(1), rk, d * d if form == "head" else 0, want, want.stride(0), want.stride(1), scale,
        bq, H_KV=h, GROUP=grp, GP=max(16, 1 << (grp - 1).bit_length()), D=d, BLOCK_E=32, PREC="tf32x3", PDL=False)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    full = rk if form == "head" else rk.expand(h, d, d)
    exact = torch.einsum("bgd,gde->bge", q.double().cpu(), full.repeat_interleave(grp, 0).double().cpu()) * scale
    assert torch.allclose(out.cpu().double(), exact, rtol=2e-3, atol=2e-3)


@pytest.mark.unit
@pytest.mark.parametrize(("b", "hq", "qb"), [(9, 8, 4), (7, 6, 5), (17, 2, 16), (1, 2, 16)],
                         ids=["b9-group4-qb4", "b7-group3-qb5", "b17-group1-qb16", "b1-group1-qb16"])
def test_rotate_q_sequences_per_program_change_no_bit(b: int, hq: int, qb: int) -> None:
    """``_rotate_q_kernel`` with ``QB`` sequences a program (the rows one sequence's heads leave as MMA padding hold
    the next sequences', ``tier_ops.query_rows``) writes bit for bit what one sequence a program writes, the last
    program's missing sequences masked (nothing written past ``B``)."""
    from oscar_kernels.launch_checks import triton_modules

    h, d = 2, 64
    grp = hq // h
    gp = max(16, 1 << (grp - 1).bit_length())
    assert ops.query_rows(grp) == (gp, qb)
    g = torch.Generator().manual_seed(b + hq)
    rk = _rotation(g, "head", h, d)
    q = (torch.randn(b + 1, hq, d, generator=g) * 3).to(torch.float16).to(DEV)  # row b: must stay untouched
    scale = ops.query_scale(None, d)
    outs = []
    for per in (1, qb):
        out = torch.full_like(q, float("nan"))
        triton_modules()[1]._rotate_q_kernel[(-(-b // per) * h, d // 32)](
            q, q.stride(0), q.stride(1), rk, d * d, out, out.stride(0), out.stride(1), scale, b, H_KV=h, GROUP=grp,
            GP=gp, D=d, BLOCK_E=32, PREC="tf32x3", PDL=False, QB=per)
        assert torch.isnan(out[b]).all() and not torch.isnan(out[:b]).any()
        outs.append(out[:b])
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


@pytest.mark.unit
def test_rotate_kv_query_refusals_name_the_argument() -> None:
    h, d = 2, 64
    g = torch.Generator().manual_seed(2)
    rk = _rotation(g, "shared", h, d)
    k, v = _kv(g, 3, h, d, "contiguous", torch.float16)
    q = torch.zeros(2, 4, d, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match="query.out"):
        ops.rotate_kv(k, v, rk, rk, query=ops.GatherQuery(q, rk, q.float(), 1.0))
    with pytest.raises(ValueError, match="query.rotation"):
        ops.rotate_kv(k, v, rk, rk, query=ops.GatherQuery(q, rk[:, :32], q.clone(), 1.0))
    with pytest.raises(ValueError, match="block_e"):
        ops.rotate_kv(k, v, rk, rk, block_e=16, query=ops.GatherQuery(q, rk, q.clone(), 1.0))
    kb, vb = _kv(g, core.ROTATE_TRITON_MAX_ROWS + 1, h, d, "contiguous", torch.float16)
    with pytest.raises(ValueError, match="torch"):  # the layer's kernels: a cuBLAS-sized batch takes no query
        TritonKernels(direct_tiers=True).rotate_kv(kb, vb, rk, rk, torch.float16,
                                                   query=ops.GatherQuery(q, rk, q.clone(), 1.0))
    kern = TritonKernels(direct_tiers=True, torch_rotate=True)
    assert not kern.rotates_query(1, 1) and TritonKernels(direct_tiers=True).rotates_query(
        core.ROTATE_TRITON_MAX_ROWS, 1) and not TritonKernels(direct_tiers=True).rotates_query(
        core.ROTATE_TRITON_MAX_ROWS + 1, 1) and not TritonKernels().rotates_query(1, 1)
    by_batch = TritonKernels(direct_tiers=None)  # the engine's default: by the step's decodes
    n = core.DIRECT_TIERS_FROM_BATCH
    assert by_batch.rotates_query(n, n) and not by_batch.rotates_query(n, n - 1) and by_batch.direct_for(n) \
        and not by_batch.direct_for(n - 1) and not TritonKernels(direct_tiers=False).direct_for(1 << 20)
