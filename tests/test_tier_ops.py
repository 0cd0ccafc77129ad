"""Triton tier copies (``ops.tier_write``, ``ops.tier_gather``) vs their torch twin (``oscar_cli.vllm.core.TorchTiers``,
the index assignments and centred gathers the vLLM layer ran before): bitwise.

CPU runs use the Triton interpreter with fp16 and fp32 tiers (its float32 -> bf16 cast truncates instead of rounding
to nearest, so the bf16 gather is checked on CUDA only, ``-m gpu``; the bf16 write is a plain copy and runs here).
"""

from __future__ import annotations

import pytest
import torch
from helpers.bitwise import assert_bitwise as _assert_bitwise
from helpers.bitwise import bits as _bits

from oscar_cli.vllm import layout
from oscar_cli.vllm.core import PagedInt2Layer, TorchTiers, TritonKernels, build_step
from oscar_kernels import ops

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TWIN = TorchTiers()


def _tiers(seed: int, rows: int, h: int, s: int, r: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)

    def rand(t: int) -> torch.Tensor:  # spread over many binades, both signs, some exact zeros
        x = torch.randn(rows + 1, h, t, d, generator=g) * torch.exp2(torch.randint(-6, 7, (rows + 1, h, t, 1),
                                                                                   generator=g).float())
        x[..., ::7] = 0.0
        return x.to(dtype).to(DEV)

    return rand(s), rand(s), rand(r), rand(r)


def _step_indices(seq: list[int], recent: list[int], ring: int) -> torch.Tensor:
    return layout.ring_gather_index(torch.tensor(seq, dtype=torch.int32), torch.tensor(recent, dtype=torch.int32),
                                    ring).to(DEV)


GATHER_CASES = [
    # id, B, H_kv, D, S (sink slots; 1 is the tier of S0 = 0), R (ring slots), per-head mean
    ("b1-h1-d64-s4-r7", 1, 1, 64, 4, 7, True),
    ("b3-h2-d64-s8-r15", 3, 2, 64, 8, 15, True),
    ("b3-h2-d128-s1-r33", 3, 2, 128, 1, 33, False),
    ("b1-h2-d128-s8-r33", 1, 2, 128, 8, 33, True),
    ("b3-h1-d128-s4-r15", 3, 1, 128, 4, 15, False),
    ("b3-h2-d64-s1-r7", 3, 2, 64, 1, 7, True),
]


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", GATHER_CASES, ids=[c[0] for c in GATHER_CASES])
def test_tier_gather_bitwise(case: tuple, dtype: torch.dtype) -> None:
    """The batch's sink rows and ring rows (oldest first, the step's ring index: wrapped, short, full, and rows on
    the scratch row as under graph capture), centred, into slices of persistent buffers and freshly allocated."""
    name, b, h, d, s, r, per_head = case
    rows_total = 4
    tiers = _tiers(len(name), rows_total, h, s, r, d, dtype)
    g = torch.Generator().manual_seed(b * 7 + s)
    mshape = (h, d) if per_head else (1, d)
    k_mean, v_mean = (torch.randn(*mshape, generator=g).expand(h, d).contiguous().to(DEV) for _ in range(2))
    rows = torch.tensor([2, rows_total, 0][:b], dtype=torch.int64, device=DEV)  # row 4: scratch
    seq = [50, 3, 2 * r + 5][:b]
    rec = [r, 1, r - 2][:b]
    idx = _step_indices(seq, rec, r)
    want = TWIN.tier_gather(tiers, rows, idx, k_mean, v_mean, None)  # type: ignore[arg-type]
    before = [t.clone() for t in tiers]
    got = ops.tier_gather(*tiers, rows, idx, k_mean, v_mean)
    for i, nm in enumerate(("sink_k", "sink_v", "recent_k", "recent_v")):
        _assert_bitwise(got[i], want[i], nm)
        assert got[i].is_contiguous()
    persistent = [torch.full((rows_total, h, x.shape[2], d), float("nan"), dtype=dtype, device=DEV) for x in want]
    out = tuple(x[:b] for x in persistent)
    got2 = ops.tier_gather(*tiers, rows, idx, k_mean, v_mean, out=out)  # type: ignore[arg-type]
    for i in range(4):
        assert got2[i].data_ptr() == persistent[i].data_ptr()
        _assert_bitwise(got2[i], want[i], f"out[{i}]")
        assert torch.isnan(persistent[i][b:]).all(), "wrote past the batch"
    for t, t0 in zip(tiers, before, strict=True):
        assert torch.equal(t, t0), "a tier was modified"


@pytest.mark.unit
def test_tier_gather_one_mean_for_all_heads_and_random_slots() -> None:
    """A ``[D]`` mean (stride 0 over heads) and ring indices in any order (repeats included)."""
    b, h, d, s, r = 3, 2, 64, 4, 15
    tiers = _tiers(9, 3, h, s, r, d, torch.float16)
    g = torch.Generator().manual_seed(4)
    mean = torch.randn(d, generator=g).to(DEV)
    rows = torch.tensor([1, 3, 1], dtype=torch.int64, device=DEV)
    idx = torch.randint(0, r, (b, r), generator=g).to(DEV)
    got = ops.tier_gather(*tiers, rows, idx, mean, -mean)
    want = TWIN.tier_gather(tiers, rows, idx, mean.expand(h, d), -mean.expand(h, d), None)  # type: ignore[arg-type]
    for i in range(4):
        _assert_bitwise(got[i], want[i], f"out[{i}]")


@pytest.mark.unit
@pytest.mark.parametrize(("b", "hq", "per_head"), [(1, 8, False), (3, 6, True), (2, 2, False)],
                         ids=["b1-group4", "b3-group3-perhead", "b2-group1"])
def test_tier_gather_query_jobs_equal_the_decode_rotation(b: int, hq: int, per_head: bool) -> None:
    """``query=GatherQuery(...)``: the gather's four outputs are unchanged and ``out`` holds bit for bit what the
    decode plan's rotation kernel writes (the same tile function), for GQA groups of 4, 3 (padded to 16 rows) and 1,
    shared and per-head rotations; it is within float32 rounding of the float64 product."""
    from oscar_kernels.launch_checks import triton_modules

    h, d, s, r = 2, 64, 4, 15
    tiers = _tiers(b + hq, 3, h, s, r, d, torch.float16)
    g = torch.Generator().manual_seed(hq)
    mean = torch.randn(h, d, generator=g).to(DEV)
    rows = torch.tensor([1, 3, 0][:b], dtype=torch.int64, device=DEV)
    idx = torch.randint(0, r, (b, r), generator=g).to(DEV)
    rot = torch.linalg.qr(torch.randn(*((h,) if per_head else ()), d, d, generator=g, dtype=torch.float64))[0]
    rot = rot.float().to(DEV)
    q = (torch.randn(b, hq, d, generator=g) * 3).to(torch.float16).to(DEV)
    scale = ops.query_scale(None, d)
    out = torch.full_like(q, float("nan"))
    got = ops.tier_gather(*tiers, rows, idx, mean, -mean, query=ops.GatherQuery(q, rot, out, scale))
    plain = ops.tier_gather(*tiers, rows, idx, mean, -mean)
    for i in range(4):
        _assert_bitwise(got[i], plain[i], f"out[{i}]")
    want = torch.full_like(q, float("nan"))
    grp = hq // h
    triton_modules()[1]._rotate_q_kernel[(b * h, d // 32)](
        q, q.stride(0), q.stride(1), rot.contiguous(), d * d if per_head else 0, want, want.stride(0), want.stride(1),
        scale, b, H_KV=h, GROUP=grp, GP=max(16, 1 << (grp - 1).bit_length()), D=d, BLOCK_E=32, PREC="tf32x3", PDL=False)
    _assert_bitwise(out, want, "query.out")
    full = rot if per_head else rot.expand(h, d, d)
    exact = torch.einsum("bgd,gde->bge", q.double().cpu(), full.repeat_interleave(grp, 0).double().cpu()) * scale
    assert torch.allclose(out.cpu().double(), exact, rtol=2e-3, atol=2e-3)
    twin_out = torch.full_like(q, float("nan"))  # the torch twin (tests' TorchKernels) takes the same query
    twin = TWIN.tier_gather(tiers, rows, idx, mean, -mean, None, query=ops.GatherQuery(q, rot, twin_out, scale))
    for i in range(4):
        _assert_bitwise(twin[i], plain[i], f"twin out[{i}]")
    assert torch.allclose(twin_out.cpu().double(), exact, rtol=2e-3, atol=2e-3)


@pytest.mark.unit
def test_tier_gather_query_refusals_name_the_argument() -> None:
    h, d, s, r = 2, 64, 4, 15
    tiers = _tiers(5, 3, h, s, r, d, torch.float16)
    mean = torch.zeros(h, d, device=DEV)
    rows = torch.tensor([1, 2], dtype=torch.int64, device=DEV)
    idx = torch.zeros(2, r, dtype=torch.int64, device=DEV)
    q = torch.zeros(2, 4, d, dtype=torch.float16, device=DEV)
    rot = torch.eye(d, device=DEV)
    with pytest.raises(ValueError, match="query.q"):
        ops.tier_gather(*tiers, rows, idx, mean, mean, query=ops.GatherQuery(q[:1], rot, q[:1].clone(), 1.0))
    with pytest.raises(ValueError, match="query.out"):
        ops.tier_gather(*tiers, rows, idx, mean, mean, query=ops.GatherQuery(q, rot, q.float(), 1.0))
    with pytest.raises(ValueError, match="query.rotation"):
        ops.tier_gather(*tiers, rows, idx, mean, mean, query=ops.GatherQuery(q, rot[:, :32], q.clone(), 1.0))


WRITE_CASES = [
    # id, H_kv, D, S0, W (ring = W + 16 - 1), dtype
    ("h1-d64-s4-w8-fp16", 1, 64, 4, 8, torch.float16),
    ("h2-d128-s8-w16-fp32", 2, 128, 8, 16, torch.float32),
    ("h2-d64-s0-w8-bf16", 2, 64, 0, 8, torch.bfloat16),
    ("h1-d128-s8-w0-fp16", 1, 128, 8, 0, torch.float16),
]


@pytest.mark.unit
@pytest.mark.parametrize("case", WRITE_CASES, ids=[c[0] for c in WRITE_CASES])
def test_tier_write_bitwise(case: tuple) -> None:
    """A mixed step's tokens (a decode past the sink, a chunk crossing the sink boundary and wrapping the ring, a
    decode inside the sink) plus padding tokens, all sent to the scratch row's slot 0: every real row is bitwise the
    index assignments'; the scratch slots hold one of the tokens sent there."""
    name, h, d, s0, w, dtype = case
    st = layout.Int2Settings(sink=s0, recent=w)
    ring = max(st.ring, 1)
    rows_total = 3
    tiers = _tiers(len(name), rows_total, h, max(s0, 1), ring, d, dtype)
    # requests on rows 2, 0, 1: (tokens this step, length after it)
    long = 2 * ring + s0 + 3
    lens = [(1, 40), (long - max(s0 - 2, 0), long), (1, max(s0, 1))]
    pad = 3
    req, pos, slots = [], [], []
    for i, (n, total) in enumerate(lens):
        req += [i] * n
        pos += list(range(total - n, total))
        slots += list(range(100 * i, 100 * i + n))
    req += [0] * pad
    pos += [0] * pad
    slots += [-1] * pad
    idx = tuple(x.to(DEV) for x in layout.tier_write_index(
        torch.tensor(req), torch.tensor(pos), torch.tensor(slots), torch.tensor([t for _, t in lens], dtype=torch.int32),
        torch.tensor([2, 0, 1]), st, rows_total))
    n = len(req)
    g = torch.Generator().manual_seed(n)
    k = torch.randn(n, h, d, generator=g).to(dtype).to(DEV)
    v = torch.randn(h, n, d, generator=g).to(dtype).to(DEV).transpose(0, 1)  # as the per-head rotation's einsum
    want = tuple(t.clone() for t in tiers)
    TWIN.tier_write(k, v, want, *idx)  # type: ignore[arg-type]
    got = tuple(t.clone() for t in tiers)
    ops.tier_write(k, v, *got, *idx)
    for i, nm in enumerate(("sink_k", "sink_v", "ring_k", "ring_v")):
        _assert_bitwise(got[i][:rows_total], want[i][:rows_total], nm)
        _assert_bitwise(got[i][rows_total, :, 1:], tiers[i][rows_total, :, 1:], f"{nm} scratch beyond slot 0")
        row, slot = (idx[0], idx[1]) if i < 2 else (idx[2], idx[3])
        sent = ((row == rows_total) & (slot == 0)).nonzero().flatten()
        x = k if i % 2 == 0 else v
        cands = [_bits(x[j]) for j in sent.tolist()] or [_bits(tiers[i][rows_total, :, 0])]
        assert any(torch.equal(_bits(got[i][rows_total, :, 0]), c) for c in cands), f"{nm} scratch slot 0"
    assert bool((idx[0] < rows_total).any()) == (s0 > 0) and bool((idx[2] < rows_total).any()) == (w > 0)


@pytest.mark.unit
def test_tier_ops_refuse_mismatched_arguments() -> None:
    tiers = _tiers(1, 2, 2, 4, 7, 64, torch.float16)
    rows = torch.zeros(2, dtype=torch.int64, device=DEV)
    idx = torch.zeros(2, 7, dtype=torch.int64, device=DEV)
    mean = torch.zeros(2, 64, device=DEV)
    with pytest.raises(ValueError, match="sink_v"):
        ops.tier_gather(tiers[0], tiers[1].float(), *tiers[2:], rows, idx, mean, mean)
    with pytest.raises(ValueError, match="ring_index"):
        ops.tier_gather(*tiers, rows, idx[:1], mean, mean)
    with pytest.raises(ValueError, match="rows"):
        ops.tier_gather(*tiers, rows.int(), idx, mean, mean)
    with pytest.raises(ValueError, match="k_mean"):
        ops.tier_gather(*tiers, rows, idx, mean.half(), mean)
    bad_out = tuple(torch.empty(2, 2, t.shape[2], 64, dtype=torch.float16, device=DEV) for t in tiers)
    with pytest.raises(ValueError, match=r"out\[2\]"):
        ops.tier_gather(*tiers, rows, idx[:, :5], mean, mean, out=bad_out)  # type: ignore[arg-type]
    k = torch.zeros(3, 2, 64, dtype=torch.float16, device=DEV)
    i3 = torch.zeros(3, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="sink_k"):
        ops.tier_write(k, k, tiers[0].float(), tiers[1].float(), *tiers[2:], i3, i3, i3, i3)
    with pytest.raises(ValueError, match="ring_slot"):
        ops.tier_write(k, k, *tiers, i3, i3, i3, i3.int())
    with pytest.raises(ValueError, match="k, v"):
        ops.tier_write(k, k.transpose(1, 2).contiguous().transpose(1, 2), *tiers, i3, i3, i3, i3)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("b", [1, 3, 64])
def test_tier_ops_bf16_on_gpu(b: int) -> None:
    """bf16 tiers at the engine's shapes (S0 = 64, ring = 256 + 16 - 1, D = 128, 8 KV heads), up to 64 sequences."""
    h, d, s, r, rows_total = 8, 128, 64, 271, 64
    tiers = _tiers(b, rows_total, h, s, r, d, torch.bfloat16)
    g = torch.Generator().manual_seed(b)
    k_mean, v_mean = (torch.randn(h, d, generator=g).to(DEV) for _ in range(2))
    rows = torch.randperm(rows_total + 1, generator=g)[:b].to(DEV)
    seq = torch.randint(1, 5000, (b,), generator=g, dtype=torch.int32)
    idx = layout.ring_gather_index(seq, torch.minimum(seq, torch.tensor(r)), r).to(DEV)
    got = ops.tier_gather(*tiers, rows, idx, k_mean, v_mean)
    want = TWIN.tier_gather(tiers, rows, idx, k_mean, v_mean, None)  # type: ignore[arg-type]
    for i in range(4):
        _assert_bitwise(got[i], want[i], f"out[{i}]")
    x = torch.randn(b, h, d, generator=g).bfloat16().to(DEV)
    pos = torch.randint(0, s, (b,), generator=g).to(DEV)
    slot = torch.randint(0, r, (b,), generator=g).to(DEV)
    want_t = tuple(t.clone() for t in tiers)
    TWIN.tier_write(x, -x, want_t, rows, pos, rows, slot)  # type: ignore[arg-type]
    ops.tier_write(x, -x, *tiers, rows, pos, rows, slot)
    for a, w in zip(tiers, want_t, strict=True):
        _assert_bitwise(a, w, "tier")


# ---------------------------------------------------------------------------- the layer, Triton tiers vs torch twin
class _Record:
    """Layer kernels without the INT2 part: quantize-on-write skipped, the decode records its tier inputs; the K/V
    rotation in torch for both twins (the tier ops are under test here: on CUDA ``ops.rotate_kv`` may round an element
    one ulp away from cuBLAS, tests/test_rotate_ops.py)."""

    rotate_kv = TorchTiers.rotate_kv

    def __init__(self) -> None:
        self.inputs: list[tuple[torch.Tensor, ...]] = []

    def quantize_write(self, *args: object, **kwargs: object) -> None:
        pass

    def decode(self, q, kp, vp, table, hist_len, sink, sink_len, recent, recent_len, t, scale, out,  # type: ignore[no-untyped-def]
               rope=None, low=None):
        self.inputs.append(tuple(x.clone() for x in (*sink, *recent, sink_len, recent_len)))
        return out


class _TritonTiers(_Record, TritonKernels):
    def __init__(self) -> None:
        # the tier write its own launch (the page writes are stubbed); the gather without the decode's query jobs, as
        # the twin gathers (those jobs leave the gather's outputs unchanged: test_tier_gather_query_jobs_...)
        TritonKernels.__init__(self, fused_write=False, fused_gather=False)
        _Record.__init__(self)


class _TorchTiers(_Record, TorchTiers):
    pass


@pytest.mark.unit
def test_layer_steps_same_tiers_and_decode_inputs_with_triton_or_torch() -> None:
    """Five engine steps (four with decodes) through ``PagedInt2Layer.forward`` (prefill chunks past the ring, a mixed batch with
    padding tokens, decodes with a padding request on the scratch row, a per-head K rotation): the tiers and every
    decode's centred sink / recent inputs are bitwise the torch twin's."""
    hq, hkv, d, p, rows_n = 4, 2, 64, 4, 3
    s = layout.Int2Settings(sink=4, recent=8)  # ring 8 + 16 - 1 = 23 slots
    g = torch.Generator().manual_seed(0)
    rot = torch.linalg.qr(torch.randn(hkv, d, d, generator=g, dtype=torch.float64))[0].float()
    t = layout.LayerTensors(rot, torch.eye(d), 0.3 * torch.randn(hkv, d, generator=g),
                            0.1 * torch.randn(hkv, d, generator=g), 0.9, 0.9)
    layers = [PagedInt2Layer(t, s, rows_n, hq, hkv, d, p, torch.float16, DEV, kernels=k())  # type: ignore[arg-type]
              for k in (_TritonTiers, _TorchTiers)]
    kv = torch.zeros(64, p, hkv, d // 2 + 8, dtype=torch.uint8, device=DEV)
    kp, vp = layout.carve_pages(kv, d)
    state = [torch.zeros(rows_n + 1, 2, dtype=torch.int32, device=DEV) for _ in layers]
    done = {0: 0, 1: 0}
    # per step: [(request, tokens)], padding tokens, padding requests (one-token, on the scratch row)
    steps = [([(0, 30)], 2, 0), ([(0, 1), (1, 7)], 3, 0), ([(0, 1), (1, 1)], 0, 1), ([(0, 1), (1, 1)], 0, 0),
             ([(0, 1), (1, 20)], 1, 0)]
    for k, (reqs, pad, pad_reqs) in enumerate(steps):
        qsl, seq, slots, rows = [0], [], [], []
        for r, n in reqs:
            a = done[r]
            slots += [r * 32 + i for i in range(a, a + n)]
            qsl.append(qsl[-1] + n)
            seq.append(a + n)
            rows.append(r)
            done[r] += n
        nd = sum(1 for _, n in reqs if n == 1)
        if pad_reqs:  # a FULL-graph padded decode batch: dummy requests after the real decodes
            assert nd == len(reqs)
            qsl += [qsl[-1] + 1] * pad_reqs
            seq += [1] * pad_reqs
            slots += [-1] * pad_reqs
            rows += [rows_n] * pad_reqs
        slots += [-1] * pad
        ntok = len(slots)
        table = torch.arange(len(seq) * 16, dtype=torch.int32).view(len(seq), 16) % 64
        q, key, val = (torch.randn(ntok, h, d, generator=g).half().to(DEV) for h in (hq, hkv, hkv))
        for layer, stt in zip(layers, state, strict=True):
            st = build_step(torch.tensor(qsl, dtype=torch.int32, device=DEV), qsl,
                            torch.tensor(seq, dtype=torch.int32, device=DEV), seq, table.to(DEV),
                            torch.tensor(slots, dtype=torch.int64, device=DEV), ntok, rows, stt, s)
            out = torch.zeros(ntok, hq, d, dtype=torch.float16, device=DEV)
            layer.forward(q, key, val, kp, vp, st, out)
        for i, (x, y) in enumerate(zip(layers[0].tiers, layers[1].tiers, strict=True)):
            _assert_bitwise(x[:rows_n], y[:rows_n], f"step {k}: tier {i}")
    ra, rb = (layer.kernels.inputs for layer in layers)  # type: ignore[attr-defined]
    assert len(ra) == len(rb) == len(steps) - 1  # the first step is a prefill alone
    for k, (xa, xb) in enumerate(zip(ra, rb, strict=True)):
        for i, (x, y) in enumerate(zip(xa, xb, strict=True)):
            if i < 4:
                _assert_bitwise(x, y, f"decode {k}: input {i}")
            else:
                assert torch.equal(x, y)
