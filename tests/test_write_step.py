"""``ops.write_step``: a decode step's key pages, value pages and BF16 tiers in one launch, byte for byte what
``quantize_write`` (K, V) and ``tier_write`` write as three launches, over the backend's variants (2- and 4-bit
keys, 16- and 8-bit metadata, a key mean per head or per row, token-quad updates with or without atomics, padding
rows). CPU runs use the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from oscar_kernels import ops
from oscar_kernels.reference import QuantizedRows

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
H, D, PAGE = 2, 64, 16

CASES = [
    # id, N, INT4 keys, metadata dtype, key mean per row, exclusive token-quad words, decode-shaped slots
    ("n1-int2-bf16", 1, False, torch.bfloat16, False, True, True),
    ("n5-int2-meta8-rowmean", 5, False, torch.uint8, True, True, True),
    ("n5-int4-meta8-rowmean", 5, True, torch.uint8, True, True, True),
    ("n3-int4-bf16-atomics", 3, True, torch.bfloat16, False, False, True),
    ("n19-int2-bf16-prefill", 19, False, torch.bfloat16, True, False, False),
    ("n19-int4-meta8-prefill", 19, True, torch.uint8, False, False, False),
]


def _state(n: int, int4: bool, meta: torch.dtype, row_mean: bool, decode: bool, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    pages = max(n + 2, 4)
    if decode:  # one token per sequence, each on its own page (what exclusive words need)
        slots = torch.randperm(pages, generator=gen)[:n] * PAGE + torch.randint(0, PAGE, (n,), generator=gen)
    else:  # a prefill chunk: distinct slots sharing pages and token-quad words
        slots = torch.randperm(pages * PAGE, generator=gen)[:n]
    if n > 2:
        slots[n // 2] = -1  # a padding row: no page write
    rows, sink, ring = n + 1, 4, 8
    kc = ops.new_paged_cache(pages, H, PAGE, D, None, meta, DEV)
    vc = ops.new_paged_cache(pages, H, PAGE, D, None, meta, DEV, layout="token_quads")
    for c in (kc, vc):  # stale bytes everywhere: what is not written must stay
        c.packed.copy_(torch.randint(0, 256, c.packed.shape, generator=gen, dtype=torch.uint8))
        for t in (c.scale, c.zero):
            t.copy_(torch.randint(0, 200, t.shape, generator=gen).to(meta) if meta == torch.uint8 else
                    torch.randn(t.shape, generator=gen).to(meta))
    tiers = [torch.randn(rows, H, size, D, generator=gen).to(torch.float16) for size in (sink, sink, ring, ring)]
    perm = torch.randperm(rows * sink, generator=gen)[:n]  # distinct destinations per token
    permr = torch.randperm(rows * ring, generator=gen)[:n]
    return {
        "k": (torch.randn(n, H, D, generator=gen) * 2).to(torch.float16),
        "v": torch.randn(n, H, D, generator=gen).to(torch.float16),
        "k_cache": kc, "v_cache": vc,
        "k_low": torch.randint(0, 256, kc.packed.shape, generator=gen, dtype=torch.uint8) if int4 else None,
        "slots": slots.to(torch.int64),
        "tiers": tiers,
        "idx": (perm // sink, perm % sink, permr // ring, permr % ring),
        "k_mean": torch.randn(*((n,) if row_mean else ()), H, D, generator=gen) * 0.3,
        "v_mean": torch.randn(H, D, generator=gen) * 0.1,
    }


def _to(s: dict) -> dict:
    """A copy of a state on the test device (caches, tiers and index tuples included)."""
    def mv(x: object) -> object:
        if isinstance(x, torch.Tensor):
            return x.clone().to(DEV)
        if isinstance(x, QuantizedRows):
            return QuantizedRows(x.packed.clone().to(DEV), x.scale.clone().to(DEV), x.zero.clone().to(DEV))
        if isinstance(x, (list, tuple)):
            return type(x)(mv(t) for t in x)
        return x

    return {k: mv(v) for k, v in s.items()}


@pytest.mark.unit
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_write_step_equals_the_three_launches(case: tuple) -> None:
    name, n, int4, meta, row_mean, exclusive, decode = case
    base = _state(n, int4, meta, row_mean, decode, len(name) + n)
    a, b = _to(base), _to(base)
    k_clip = 0.0 if int4 else 0.92
    ops.quantize_write(a["k"], a["k_cache"], a["slots"], mean=a["k_mean"], clip_ratio=k_clip, layout="rows",
                       low_plane=a["k_low"])
    ops.quantize_write(a["v"], a["v_cache"], a["slots"], mean=a["v_mean"], clip_ratio=0.9, layout="token_quads",
                       exclusive_words=exclusive)
    ops.tier_write(a["k"], a["v"], *a["tiers"], *a["idx"])
    ops.write_step(b["k"], b["v"], b["k_cache"], b["v_cache"], b["slots"], tuple(b["tiers"]), *b["idx"],
                   k_mean=b["k_mean"], v_mean=b["v_mean"], k_clip=k_clip, v_clip=0.9, exclusive_words=exclusive,
                   k_low=b["k_low"])
    pairs = [("k_cache." + f, getattr(a["k_cache"], f), getattr(b["k_cache"], f)) for f in ("packed", "scale", "zero")]
    pairs += [("v_cache." + f, getattr(a["v_cache"], f), getattr(b["v_cache"], f)) for f in ("packed", "scale", "zero")]
    pairs += [(f"tier {i}", x, y) for i, (x, y) in enumerate(zip(a["tiers"], b["tiers"], strict=True))]
    if int4:
        pairs.append(("k_low", a["k_low"], b["k_low"]))
    for what, x, y in pairs:
        same = x.cpu().view(torch.uint8) == y.cpu().view(torch.uint8)
        assert bool(same.all()), f"{what}: {int((~same).sum())} bytes differ"
    assert not torch.equal(a["v_cache"].packed.cpu(), base["v_cache"].packed), "nothing was written"


@pytest.mark.unit
def test_write_step_refusals_name_the_argument() -> None:
    s = _to(_state(3, False, torch.bfloat16, False, True, 7))
    tiers = tuple(s["tiers"])
    other = ops.new_paged_cache(8, H, 32, D, None, torch.bfloat16, DEV, layout="token_quads")
    with pytest.raises(ValueError, match="one page size serves both"):
        ops.write_step(s["k"], s["v"], s["k_cache"], other, s["slots"], tiers, *s["idx"])
    with pytest.raises(ValueError, match="sink_row"):
        ops.write_step(s["k"], s["v"], s["k_cache"], s["v_cache"], s["slots"], tiers, s["idx"][0][:2], *s["idx"][1:])
    with pytest.raises(ValueError, match="low_plane"):
        ops.write_step(s["k"], s["v"], s["k_cache"], s["v_cache"], s["slots"], tiers, *s["idx"], k_clip=0.9,
                       k_low=torch.zeros_like(s["k_cache"].packed))


@pytest.mark.unit
@pytest.mark.parametrize(("raw", "want"), [(None, False), ("1", True), ("0", False), (" 1 ", True), ("on", None)])
def test_fused_write_switch(monkeypatch: pytest.MonkeyPatch, raw: str | None, want: bool | None) -> None:
    """``OSCAR_VLLM_FUSED_WRITE``: off unless 1; anything but 0 / 1 is refused in one line (None: refused)."""
    from oscar_cli.vllm import debug

    if raw is None:
        monkeypatch.delenv(debug.FUSED_WRITE_ENV, raising=False)
    else:
        monkeypatch.setenv(debug.FUSED_WRITE_ENV, raw)
    if want is None:
        with pytest.raises(ValueError, match=f"{debug.FUSED_WRITE_ENV}: expected 0 or 1"):
            debug.fused_write()
    else:
        assert debug.fused_write() is want


def _rotations(per_head: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (H, D, D) if per_head else (D, D)
    return tuple(torch.linalg.qr(torch.randn(*shape, generator=gen, dtype=torch.float64))[0].float().to(DEV)
                 for _ in range(2))  # type: ignore[return-value]


ROTATED = [
    # id, N, INT4 keys, metadata dtype, key mean per row, exclusive words, decode-shaped slots, per-head rotations
    ("n1-int2-bf16-shared", 1, False, torch.bfloat16, False, True, True, False),
    ("n5-int4-meta8-rowmean-perhead", 5, True, torch.uint8, True, True, True, True),
    ("n19-int2-meta8-prefill-perhead", 19, False, torch.uint8, False, False, False, True),
]


@pytest.mark.unit
@pytest.mark.parametrize("case", ROTATED, ids=[c[0] for c in ROTATED])
def test_write_step_with_rotation_equals_rotate_kv_then_write_step(case: tuple) -> None:
    """``rotation=(R_K, R_V)``: unrotated rows in, the bytes of ``rotate_kv`` followed by the plain fused write
    (pages, metadata, low plane and both tiers), for shared and per-head rotations, padding rows included."""
    name, n, int4, meta, row_mean, exclusive, decode, per_head = case
    base = _state(n, int4, meta, row_mean, decode, len(name) + 3 * n)
    a, b = _to(base), _to(base)
    rk, rv = _rotations(per_head, n)
    k_clip = 0.0 if int4 else 0.92
    kr, vr = ops.rotate_kv(a["k"], a["v"], rk, rv, dtype=a["k"].dtype)
    common = dict(k_clip=k_clip, v_clip=0.9, exclusive_words=exclusive)
    ops.write_step(kr, vr, a["k_cache"], a["v_cache"], a["slots"], tuple(a["tiers"]), *a["idx"], k_mean=a["k_mean"],
                   v_mean=a["v_mean"], k_low=a["k_low"], **common)
    ops.write_step(b["k"], b["v"], b["k_cache"], b["v_cache"], b["slots"], tuple(b["tiers"]), *b["idx"],
                   k_mean=b["k_mean"], v_mean=b["v_mean"], k_low=b["k_low"], rotation=(rk, rv), **common)
    for what in ("k_cache", "v_cache"):
        for f in ("packed", "scale", "zero"):
            x, y = getattr(a[what], f).cpu(), getattr(b[what], f).cpu()
            same = x.view(torch.uint8) == y.view(torch.uint8)
            assert bool(same.all()), f"{what}.{f}: {int((~same).sum())} bytes differ"
    for i, (x, y) in enumerate(zip(a["tiers"], b["tiers"], strict=True)):
        assert torch.equal(x.cpu().view(torch.uint8), y.cpu().view(torch.uint8)), f"tier {i} differs"
    if int4:
        assert torch.equal(a["k_low"].cpu(), b["k_low"].cpu()), "k_low differs"


@pytest.mark.unit
@pytest.mark.parametrize(("b_q", "h_q", "per_head"), [(1, 8, False), (5, 6, True), (3, 2, False)],
                         ids=["b1-group4", "b5-group3-perhead", "b3-of-5-group1"])
def test_write_step_query_job_equals_the_decode_rotation(b_q: int, h_q: int, per_head: bool) -> None:
    """``query=StepQuery(q, out, scale)``: ``out`` is bit for bit what ``DecodePlan``'s rotation kernel writes
    (the same tile function), for GQA groups of 4, 3 (padded to 16 rows) and 1, per-head rotations, and fewer
    decodes than the step's tokens; and within float32 rounding of the float64 product."""
    n = 5
    s = _to(_state(n, False, torch.bfloat16, False, True, 11 + b_q))
    rk, rv = _rotations(per_head, h_q)
    gen = torch.Generator().manual_seed(h_q)
    q = (torch.randn(b_q, h_q, D, generator=gen) * 3).to(torch.float16).to(DEV)
    scale = ops.query_scale(None, D)
    out = torch.full_like(q, float("nan"))
    ops.write_step(s["k"], s["v"], s["k_cache"], s["v_cache"], s["slots"], tuple(s["tiers"]), *s["idx"],
                   k_mean=s["k_mean"], v_mean=s["v_mean"], rotation=(rk, rv), query=ops.StepQuery(q, out, scale))
    want = torch.full_like(q, float("nan"))
    g = h_q // H
    r = rk.contiguous()
    from oscar_kernels.launch_checks import triton_modules

    triton_modules()[1]._rotate_q_kernel[(b_q * H, D // 32)](
        q, q.stride(0), q.stride(1), r, D * D if per_head else 0, want, want.stride(0), want.stride(1), scale,
        H_KV=H, GROUP=g, GP=max(16, 1 << (g - 1).bit_length()), D=D, BLOCK_E=32, PREC="tf32x3", PDL=False)
    assert torch.equal(out.cpu().view(torch.int16), want.cpu().view(torch.int16))
    rot = rk if per_head else rk.expand(H, D, D)
    exact = torch.einsum("bgd,gde->bge", q.double().cpu(), rot.repeat_interleave(g, 0).double().cpu()) * scale
    assert torch.allclose(out.cpu().double(), exact, rtol=2e-3, atol=2e-3)


@pytest.mark.unit
def test_write_step_query_refusals_name_the_argument() -> None:
    s = _to(_state(3, False, torch.float16, False, True, 5))
    tiers = tuple(s["tiers"])
    rk, rv = _rotations(False, 1)
    q = torch.zeros(3, 4, D, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match="rotation=\\(R_K, R_V\\)"):
        ops.write_step(s["k"], s["v"], s["k_cache"], s["v_cache"], s["slots"], tiers, *s["idx"],
                       query=ops.StepQuery(q, torch.empty_like(q), 1.0))
    with pytest.raises(ValueError, match="query.q"):
        big = torch.zeros(4, 4, D, dtype=torch.float16, device=DEV)  # more decodes than the step's tokens
        ops.write_step(s["k"], s["v"], s["k_cache"], s["v_cache"], s["slots"], tiers, *s["idx"], rotation=(rk, rv),
                       query=ops.StepQuery(big, torch.empty_like(big), 1.0))
    with pytest.raises(ValueError, match="query.out"):
        ops.write_step(s["k"], s["v"], s["k_cache"], s["v_cache"], s["slots"], tiers, *s["idx"], rotation=(rk, rv),
                       query=ops.StepQuery(q, torch.empty(3, 4, D, dtype=torch.bfloat16, device=DEV), 1.0))


@pytest.mark.unit
@pytest.mark.parametrize(("fused", "key_mean", "torch_ops", "launches"),
                         [("0", "constant", 0, 8), ("1", "constant", 0, 4), ("0", "rope", 10, 8), ("1", "rope", 0, 4)])
def test_decode_step_launch_count(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fused: str,
                                  key_mean: str, torch_ops: int, launches: int) -> None:
    """scripts/cpu_vllm_decode_ops.py on a batch-1 decode step: eight launches per layer unfused, plus ten torch ops
    for the key means of the rope format; four and no torch op with ``OSCAR_VLLM_FUSED_WRITE=1`` (the write with both
    rotations and the key means, the tier gather, stage 1, the merge)."""
    from helpers.scripts import load_script

    monkeypatch.setenv("OSCAR_VLLM_FUSED_WRITE", fused)
    monkeypatch.setattr("sys.argv", ["cpu_vllm_decode_ops.py", "--batch", "1", "--history", "256",
                                     "--key-mean", key_mean])
    load_script("cpu_vllm_decode_ops").main()
    assert f": {torch_ops} torch ops + {launches} kernel launches = {torch_ops + launches} per layer" in \
        capsys.readouterr().out


@pytest.mark.unit
@pytest.mark.parametrize("shared", [True, False], ids=["shared-rotation", "per-head-rotation"])
def test_rope_mean_matrix_gives_the_position_means(shared: bool) -> None:
    """``scaling · table[p] @ M[h]`` is ``position_means`` (RoPE of the pre-RoPE mean, then ``R_K``) at every
    position, to float32 rounding, for positions up to 128K and YaRN's attention scaling."""
    from oscar_cli.quant.key_mean import position_means
    from oscar_kernels.reference import rope_cos_sin

    gen = torch.Generator().manual_seed(4)
    m_pre = torch.randn(H, D, generator=gen) * 5
    rk, _ = _rotations(not shared, 2)
    rk = rk.cpu()
    inv_freq = 1e6 ** -(torch.arange(0, D, 2, dtype=torch.float32) / D)
    pos = torch.tensor([0, 1, 17, 4095, 65_537, 131_071])
    scaling = 1.2079
    table = ops.position_table(inv_freq, 131_072, "cpu")
    got = scaling * torch.einsum("nd,hde->nhe", table[pos].double(), ops.rope_mean_matrix(m_pre, rk).double())
    cos, sin = rope_cos_sin(inv_freq, scaling, pos[None])
    want = position_means(m_pre, rk if rk.dim() == 3 else rk[None], cos, sin)[0].transpose(0, 1).double()
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))


@pytest.mark.unit
@pytest.mark.parametrize(("n", "int4", "meta"), [(1, False, torch.bfloat16), (7, True, torch.uint8),
                                                 (19, False, torch.uint8)], ids=["n1-int2", "n7-int4-meta8",
                                                                                 "n19-int2-meta8"])
def test_write_step_rope_mean_in_the_launch(n: int, int4: bool, meta: torch.dtype) -> None:
    """``rope_mean``: keys centred in the launch by ``scaling · table[p] @ M``, against the unfused form (the mean
    tensor from ``position_means``): the tiers bitwise (they hold uncentred rows), the values bitwise, the keys'
    codes equal but where the two float32 means straddle a rounding boundary (none here), their metadata to the
    metadata's rounding."""
    from oscar_cli.quant.key_mean import position_means
    from oscar_kernels.reference import rope_cos_sin

    base = _state(n, int4, meta, True, n < 10, 40 + n)
    a, b = _to(base), _to(base)
    rk, rv = _rotations(True, n)
    gen = torch.Generator().manual_seed(n)
    m_pre = torch.randn(H, D, generator=gen) * 4
    inv_freq = 1e4 ** -(torch.arange(0, D, 2, dtype=torch.float32) / D)
    pos = torch.randint(0, 5000, (n,), generator=gen)
    if n > 2:
        pos[n // 2] = -7  # a padding row (its slot is -1): any position, clamped into the table
    scaling = 1.07
    cos, sin = rope_cos_sin(inv_freq, scaling, pos.clamp(min=0)[None])
    mean = position_means(m_pre, rk.cpu(), cos, sin)[0].transpose(0, 1).contiguous().to(DEV)
    k_clip = 0.0 if int4 else 0.92
    common = dict(v_mean=a["v_mean"], k_clip=k_clip, v_clip=0.9, exclusive_words=n < 10, rotation=(rk, rv))
    ops.write_step(a["k"], a["v"], a["k_cache"], a["v_cache"], a["slots"], tuple(a["tiers"]), *a["idx"],
                   k_mean=mean, k_low=a["k_low"], **common)
    rm = ops.StepRopeMean(pos.to(DEV), ops.position_table(inv_freq, 5000, DEV),
                          ops.rope_mean_matrix(m_pre, rk).to(DEV), scaling)
    ops.write_step(b["k"], b["v"], b["k_cache"], b["v_cache"], b["slots"], tuple(b["tiers"]), *b["idx"],
                   k_low=b["k_low"], rope_mean=rm, **common)
    for i, (x, y) in enumerate(zip(a["tiers"], b["tiers"], strict=True)):
        assert torch.equal(x.cpu(), y.cpu()), f"tier {i}"
    for f in ("packed", "scale", "zero"):
        assert torch.equal(getattr(a["v_cache"], f).cpu(), getattr(b["v_cache"], f).cpu()), f"v_cache.{f}"
    assert torch.equal(a["k_cache"].packed.cpu(), b["k_cache"].packed.cpu())
    if int4:
        assert torch.equal(a["k_low"].cpu(), b["k_low"].cpu())
    for f in ("scale", "zero"):
        x, y = getattr(a["k_cache"], f).cpu(), getattr(b["k_cache"], f).cpu()
        if meta == torch.uint8:
            assert int((x.int() - y.int()).abs().max()) <= 1, f
        else:
            assert torch.allclose(x.float(), y.float(), rtol=2 ** -7, atol=1e-6), f


@pytest.mark.unit
def test_write_step_rope_mean_refusals() -> None:
    s = _to(_state(3, False, torch.float16, False, True, 9))
    rk, rv = _rotations(False, 1)
    good = ops.StepRopeMean(torch.zeros(3, dtype=torch.int64, device=DEV), torch.zeros(8, D, device=DEV),
                            torch.zeros(H, D, D, device=DEV), 1.0)
    args = (s["k"], s["v"], s["k_cache"], s["v_cache"], s["slots"], tuple(s["tiers"]), *s["idx"])
    with pytest.raises(ValueError, match="rope_mean: the in-launch key mean needs rotation"):
        ops.write_step(*args, rope_mean=good)
    with pytest.raises(ValueError, match="rope_mean.positions"):
        ops.write_step(*args, rotation=(rk, rv), rope_mean=good._replace(positions=good.positions.int()))
    with pytest.raises(ValueError, match="rope_mean.matrix"):
        ops.write_step(*args, rotation=(rk, rv), rope_mean=good._replace(matrix=torch.zeros(1, D, D, device=DEV)))
