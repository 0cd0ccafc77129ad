"""Triton INT2 decode attention vs the float64 reference, with the flash-attention error budget.

``|kernel - ref64|max <= 2·|ref_same_dtype - ref64|max + 2 ulp·max|ref64|``; both references dequantize the same
codes. CPU runs use the Triton interpreter (fp16 activations: bf16 ``tl.dot`` is wrong there) on tiny grids;
``-m gpu`` runs the full grid on CUDA, including CUDA-graph capture + replay.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from oscar_kernels import ops
from oscar_kernels import reference as ref

CUDA = torch.cuda.is_available()
# tiny tiles in the interpreter; on CUDA the smallest legal INT2 tile (the V dot reduces over block_n / 4 >= 16)
TINY = ops.DecodeConfig(block_n=64 if CUDA else 16, block_nb=16, num_warps=4, num_stages=1)


def _orth(d: int, gen: torch.Generator) -> torch.Tensor:
    qm, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    return qm.float()


def make_case(seed: int, b: int, h_q: int, h_kv: int, d: int, hist: list[int], sink: list[int], recent: list[int],
              page: int, dtype: torch.dtype, device: str, meta: torch.dtype = torch.bfloat16,
              q_mag: float = 1.0, v_mag: float = 1.0, v_ramp: float = 0.0, bias_mag: float = 0.0,
              int4_keys: bool = False) -> dict:
    """Random paged INT2 cache (pages shuffled), ragged tiers, rotations; everything the op and refs need.

    ``int4_keys``: keys by formula 9, the pages holding the high plane and ``lo_rows`` the quarter-packed low plane
    ``[B, H_kv, T, D/4]`` of the same rows (:func:`add_low_plane` makes the kernel's argument from it).
    ``v_ramp``: value magnitudes grow along the sequence by ``2^v_ramp`` overall (per-tile scales differ).
    ``bias_mag``: a per-key logit bias ``[B, H_q, cap]`` of that scale (a smooth wave plus noise, like the
    position-dependent key mean's term), else none."""
    gen = torch.Generator().manual_seed(seed)
    t_h = max(max(hist), 1)
    n_pp = math.ceil(t_h / page)
    y_k = torch.randn(b, h_kv, n_pp * page, d, generator=gen) * 2.0
    y_v = torch.randn(b, h_kv, n_pp * page, d, generator=gen) * v_mag
    y_v = y_v * torch.exp2(torch.linspace(-v_ramp / 2, v_ramp / 2, n_pp * page))[:, None]
    qk, lo = ref.quantize_rows_int4(y_k, meta_dtype=meta) if int4_keys else \
        (ref.quantize_rows(y_k, clip_ratio=0.96, meta_dtype=meta), None)
    qv = ref.quantize_rows(y_v, clip_ratio=0.92, meta_dtype=meta)
    n_pages = b * n_pp + 3
    perm = torch.randperm(n_pages, generator=gen)[: b * n_pp].reshape(b, n_pp)
    kc = ops.new_paged_cache(n_pages, h_kv, page, d, None, meta, "cpu")
    vc = ops.new_paged_cache(n_pages, h_kv, page, d, None, meta, "cpu", layout="token_quads")
    for src, dst in ((qk, kc), (qv, vc)):
        for name in ("packed", "scale", "zero"):
            s = getattr(src, name).reshape(b, h_kv, n_pp, page, -1).permute(0, 2, 1, 3, 4)
            if dst is vc and name == "packed":  # values: token quads per page [.., D, P/4]
                s = ref.rows_to_token_quads(s, ref.token_quad_row(page))
            getattr(dst, name)[perm.reshape(-1)] = s.reshape(b * n_pp, h_kv, *s.shape[-2:])
    s_cap, r_cap = max(max(sink), 1), max(max(recent), 1)
    case = {
        "q": (torch.randn(b, h_q, d, generator=gen) * q_mag).to(dtype),
        "k_cache": kc, "v_cache": vc, "qk": qk, "qv": qv,
        "block_table": perm.to(torch.int32),
        "hist_len": torch.tensor(hist, dtype=torch.int32),
        "sink_k": (torch.randn(b, h_kv, s_cap, d, generator=gen) * 2).to(dtype),
        "sink_v": torch.randn(b, h_kv, s_cap, d, generator=gen).to(dtype),
        "sink_len": torch.tensor(sink, dtype=torch.int32),
        "recent_k": (torch.randn(b, h_kv, r_cap, d, generator=gen) * 2).to(dtype),
        "recent_v": torch.randn(b, h_kv, r_cap, d, generator=gen).to(dtype),
        "recent_len": torch.tensor(recent, dtype=torch.int32),
        "rotation_k": _orth(d, gen), "rotation_v": _orth(d, gen), "mean_v": torch.randn(d, generator=gen) * 0.1,
    }
    if lo is not None:
        case["lo_rows"] = lo
    if bias_mag:
        cap = n_pp * page
        wave = torch.sin(torch.arange(cap) * 0.05 + torch.rand(b, h_q, 1, generator=gen) * 6.28)
        case["logit_bias"] = (bias_mag * (wave + 0.3 * torch.randn(b, h_q, cap, generator=gen))).float()
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else
                ref.QuantizedRows(*(t.to(device) for t in (v.packed, v.scale, v.zero))) if isinstance(v, ref.QuantizedRows)
                else v) for k, v in case.items()}


# a case's cache arguments, in the order decode_attention and DecodePlan take them after q
CACHE_KEYS = ("k_cache", "v_cache", "block_table", "hist_len", "sink_k", "sink_v", "sink_len",
              "recent_k", "recent_v", "recent_len")


def run_op(c: dict, **kw: object) -> torch.Tensor:
    if "logit_bias" in c:
        kw = {"logit_bias": c["logit_bias"], **kw}
    return ops.decode_attention(c["q"], *(c[k] for k in CACHE_KEYS), rotation_k=c["rotation_k"],
                                rotation_v=c["rotation_v"], mean_v=c["mean_v"], **kw)  # type: ignore[arg-type]


def references(c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 oracle, same-dtype torch reference), ``[B, H_q, D]``, from the same codes."""
    dtype = c["q"].dtype
    outs64, outs_lp = [], []
    d = c["q"].shape[-1]
    scale = d ** -0.5
    for i in range(c["q"].shape[0]):
        hl, sl, rl = int(c["hist_len"][i]), int(c["sink_len"][i]), int(c["recent_len"][i])
        hk = ref.QuantizedRows(*(t[i : i + 1, :, :hl] for t in (c["qk"].packed, c["qk"].scale, c["qk"].zero)))
        hv = ref.QuantizedRows(*(t[i : i + 1, :, :hl] for t in (c["qv"].packed, c["qv"].scale, c["qv"].zero)))
        sk, sv = c["sink_k"][i : i + 1, :, :sl], c["sink_v"][i : i + 1, :, :sl]
        rk, rv = c["recent_k"][i : i + 1, :, :rl], c["recent_v"][i : i + 1, :, :rl]
        q = c["q"][i : i + 1, :, None, :]
        q64 = q.double() @ c["rotation_k"].double()
        bias = c["logit_bias"][i : i + 1, :, :hl] if "logit_bias" in c else None
        o64 = ref.decode_attention_reference(q64, sk, sv, hk, hv, rk, rv, scale, torch.float64, hist_bias=bias)
        outs64.append((o64[:, :, 0] + c["mean_v"].double()) @ c["rotation_v"].double().T)
        # same-dtype reference: q, keys, values, scores and P in the activation dtype, fp32 softmax
        qa = (q.float() @ c["rotation_k"]).to(dtype)
        k = torch.cat([sk, ref.dequantize_rows(hk, dtype), rk], 2)
        v = torch.cat([sv, ref.dequantize_rows(hv, dtype), rv], 2)
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        if k.shape[2] == 0:
            o = torch.zeros_like(qa)
        else:
            logits = (qa @ k.transpose(-1, -2)).float() * scale
            if bias is not None:
                logits[..., sl : sl + hl] += bias.to(logits.device)[:, :, None, :]
            p = torch.softmax(logits, -1)
            o = p.to(dtype) @ v
        outs_lp.append(((o.float()[:, :, 0] + c["mean_v"]) @ c["rotation_v"].T).to(dtype))
    return torch.cat(outs64), torch.cat(outs_lp)


def assert_budget(out: torch.Tensor, c: dict) -> None:
    assert torch.isfinite(out).all(), "non-finite output (unwritten or NaN)"
    r64, lp = references(c)
    err = (out.double() - r64).abs()
    err_lp = (lp.double() - r64).abs().max().item()
    floor = 2 * torch.finfo(out.dtype).eps * r64.abs().max().item() + 1e-6
    budget = 2 * err_lp + floor
    worst = int(err.argmax())
    assert err.max().item() <= budget, (
        f"max_diff {err.max().item():.3e} > budget {budget:.3e} (same-dtype ref err {err_lp:.3e}) "
        f"at {list(torch.unravel_index(torch.tensor(worst), err.shape))}")


def _poisoned(c: dict) -> torch.Tensor:
    b, h_q, d = c["q"].shape
    return torch.full((b, h_q, d), float("nan"), dtype=c["q"].dtype, device=c["q"].device)


# ---- CPU (interpreter) cases: tiny grids --------------------------------------------------------------

CPU_CASES = [
    # id, (B, H_q, H_kv, D), hist, sink, recent, page, splits
    ("ragged-1-31-page16", (2, 8, 2, 64), [1, 31], [4, 4], [5, 3], 16, 2),
    ("hist97-page-boundary", (1, 4, 1, 64), [97], [3], [16], 16, 3),
    ("short-no-hist", (2, 4, 2, 64), [0, 0], [2, 4], [0, 7], 16, 2),
    ("D128-page64", (1, 4, 1, 128), [64], [1], [2], 64, 2),
    # pages above 64 tokens: token-quad rows of 64 tokens, tiles on both sides of a row boundary inside a page
    ("page128-two-rows-ragged", (2, 4, 2, 64), [150, 70], [2, 1], [3, 4], 128, 3),
    # BF16 rows split over ops.TIER_PARTS programs in tiles of 16: ranges straddle sink/recent, one is empty
    ("tier-parts-straddle-ragged", (2, 4, 2, 64), [5, 0], [20, 3], [30, 0], 16, 1),
]


WHOLE_BYTE = ops.DecodeConfig(block_n=64 if CUDA else 16, block_nb=16, num_warps=1, num_stages=1)  # one warp
CONFIGS = {"four-warps": (TINY, 31), "one-warp": (WHOLE_BYTE, 13),
           "one-warp-q-hoisted": (replace(WHOLE_BYTE, hoist_q=True), 11)}  # config, seed multiplier


@pytest.mark.unit
@pytest.mark.parametrize("config_id", list(CONFIGS))
@pytest.mark.parametrize("case", CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_decode_interpreter(case: tuple, config_id: str) -> None:
    """The fp16 subnormal-field unpack (the whole byte as the top field; q and P rescaled by powers of two) against
    the float64 oracle, with four warps and one, q operands converted in the loop or before it."""
    name, (b, h_q, h_kv, d), hist, sink, recent, page, splits = case
    config, seed = CONFIGS[config_id]
    dev = "cuda" if CUDA else "cpu"
    c = make_case(len(name) * seed + b, b, h_q, h_kv, d, hist, sink, recent, page, torch.float16, dev,
                  meta=torch.float16)
    before = c["q"].clone()
    out = run_op(c, num_splits=splits, config=config, out=_poisoned(c))
    assert torch.equal(c["q"], before), "q was modified"
    assert_budget(out, c)


@pytest.mark.unit
@pytest.mark.parametrize("config_id", ["four-warps", "one-warp"])
@pytest.mark.parametrize("case", [CPU_CASES[0], CPU_CASES[1], CPU_CASES[4]], ids=[CPU_CASES[i][0] for i in (0, 1, 4)])
def test_decode_logit_bias_interpreter(case: tuple, config_id: str) -> None:
    """A per-key logit bias on the INT2 history (the position-dependent key mean's term) against the float64 oracle:
    ragged rows, masked tails, page boundaries; the BF16 tiers take none."""
    name, (b, h_q, h_kv, d), hist, sink, recent, page, splits = case
    config, seed = CONFIGS[config_id]
    dev = "cuda" if CUDA else "cpu"
    c = make_case(len(name) * seed + 7, b, h_q, h_kv, d, hist, sink, recent, page, torch.float16, dev,
                  meta=torch.float16, bias_mag=4.0)
    out = run_op(c, num_splits=splits, config=config, out=_poisoned(c))
    assert_budget(out, c)
    plain = run_op({k: v for k, v in c.items() if k != "logit_bias"}, num_splits=splits, config=config)
    if max(hist) > 0:
        assert (plain.float() - out.float()).abs().max() > 1e-2, "the bias changed nothing"


def add_rope_mean(c: dict, pos0: list[int], scaling: float = 1.0, seed: int = 0) -> None:
    """Give case ``c`` a position-dependent key mean (``rope_mean``: ``m_pre`` with a few large channels, the
    position table, first positions ``pos0``) and, as ``logit_bias``, its term from the GEMM form
    (``ops.rope_mean_logits``, checked against the float64 spec in test_rope_ops), which the references add."""
    b, h_q, d = (int(x) for x in c["q"].shape)
    h_kv = int(c["k_cache"].packed.shape[1])
    cap = int(c["block_table"].shape[1]) * int(c["k_cache"].packed.shape[2])
    dev = c["q"].device
    gen = torch.Generator().manual_seed(seed)
    mean_pre = (torch.randn(h_kv, d, generator=gen) * torch.exp2(torch.linspace(-3, 2, d))).to(dev)
    inv = 1.0 / 1_000_000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    table = ops.position_table(inv, max(pos0) + cap, dev)
    c["rope_mean"] = ops.RopeMean(mean_pre, table, torch.tensor(pos0, dtype=torch.int32, device=dev), scaling)
    c["logit_bias"] = ops.rope_mean_logits(c["q"], mean_pre, table, scaling, pos0, d ** -0.5,
                                           torch.empty(b, h_q, cap, device=dev))


ROPE_CASES = [
    # id, (B, H_q, H_kv, D), hist, sink, recent, page, splits, first positions
    ("ragged-1-31-page16", (2, 8, 2, 64), [1, 31], [4, 4], [5, 3], 16, 2, [4, 4]),
    ("hist97-past-128k", (1, 4, 1, 64), [97], [3], [16], 16, 3, [131_000]),
    ("qwen-heads-D128-two-starts", (2, 12, 2, 128), [70, 45], [2, 1], [3, 4], 64, 2, [64, 3]),
    ("page128-two-rows-ragged", (2, 4, 2, 64), [150, 70], [2, 1], [3, 4], 128, 3, [0, 7]),
]


def add_low_plane(c: dict, first: list[int]) -> None:
    """Give INT4-key case ``c`` (``make_case(int4_keys=True)``) its low plane as the kernel takes it (``low_plane``:
    slot-indexed rows, row ``b``'s history starting at slot ``first[b]``, other slots garbage) and, as
    ``logit_bias``, the plane's float64 logit term ``sm_scale·(scale/4)·(q·R_K)·lo``, which the references add."""
    lo = c["lo_rows"]
    b, h_kv, t, dq = (int(x) for x in lo.shape)
    h_q, d = int(c["q"].shape[1]), 4 * dq
    dev = c["q"].device
    slots = max(first) + t + 5
    codes = torch.randint(0, 256, (b, h_kv, slots, dq), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(sum(first) + t)).to(dev)
    for i, f in enumerate(first):
        codes[i, :, f : f + t] = lo[i]
    c["low_plane"] = ops.LowPlane(codes, torch.tensor(first, dtype=torch.int32, device=dev))
    q64 = c["q"].double() @ c["rotation_k"].double().to(dev)  # [B, H_q, D]
    lo64 = ref.unpack_int2(lo).double().repeat_interleave(h_q // h_kv, 1)  # [B, H_q, T, D]
    scale = ref.decode_meta(c["qk"].scale, c["qk"].zero)[0][..., 0].double().repeat_interleave(h_q // h_kv, 1)
    c["logit_bias"] = (torch.einsum("bhd,bhtd->bht", q64, lo64) * scale / 4 * d ** -0.5).float()


# the rope cases' shapes, with the first low-plane slot of each row instead of its first position
LOW_PLANE_CASES = [(*case[:-1], first) for case, first in zip(ROPE_CASES, ([0, 6], [11], [3, 0], [0, 80]), strict=True)]


@pytest.mark.unit
@pytest.mark.parametrize("config_id", ["four-warps", "one-warp-q-hoisted"])
@pytest.mark.parametrize("case", LOW_PLANE_CASES, ids=[c[0] for c in LOW_PLANE_CASES])
def test_decode_int4_keys_low_plane_in_tile_interpreter(case: tuple, config_id: str) -> None:
    """INT4 keys (formula 9) with the low plane read in stage 1 (``low_plane``: slot-indexed rows from a first slot
    per row, masked tails, page boundaries, 6 query heads per KV head padded to 8) against the float64 oracle of
    the high plane plus the low plane's exact logit term; close to the same kernel given that term as
    ``logit_bias``, and far from the high plane alone."""
    name, (b, h_q, h_kv, d), hist, sink, recent, page, splits, first = case
    config, seed = CONFIGS[config_id]
    dev = "cuda" if CUDA else "cpu"
    c = make_case(len(name) * seed + 9, b, h_q, h_kv, d, hist, sink, recent, page, torch.float16, dev,
                  meta=torch.float16, int4_keys=True)
    add_low_plane(c, first)
    fused = run_op({k: v for k, v in c.items() if k != "logit_bias"}, low_plane=c["low_plane"], num_splits=splits,
                   config=config, out=_poisoned(c))
    assert_budget(fused, c)
    unfused = run_op(c, num_splits=splits, config=config)
    tol = 4 * torch.finfo(torch.float16).eps * unfused.abs().max()
    assert (fused.float() - unfused.float()).abs().max() <= tol
    coarse = run_op({k: v for k, v in c.items() if k != "logit_bias"}, num_splits=splits, config=config)
    assert (coarse.float() - fused.float()).abs().max() > 10 * tol, "the low plane changed nothing"


def paged_low_plane(c: dict) -> ops.LowPlane:
    """INT4-key case ``c``'s low plane paged like its key codes (the vLLM backend's form): each row's low rows in
    the pages its block table names, at the key rows' offsets; every other byte garbage."""
    kc, lo, table = c["k_cache"].packed, c["lo_rows"], c["block_table"]
    codes = torch.randint(0, 256, tuple(kc.shape), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(int(kc.numel()))).to(kc.device)
    b, h_kv, t, dq = (int(x) for x in lo.shape)
    page = int(kc.shape[2])
    for i in range(b):
        for j in range(t // page):
            codes[int(table[i, j])] = lo[i, :, j * page:(j + 1) * page]
    return ops.LowPlane(codes)


@pytest.mark.unit
@pytest.mark.parametrize("meta", ["meta16", "meta8"])
@pytest.mark.parametrize("case", LOW_PLANE_CASES, ids=[c[0] for c in LOW_PLANE_CASES])
def test_decode_int4_keys_paged_low_plane_matches_slot_indexed(case: tuple, meta: str) -> None:
    """The paged low plane (``LowPlane(codes)``, no first slot: read through the key pages' block table, what the
    vLLM backend stores) gives what the slot-indexed plane gives on the same rows (bitwise in the interpreter,
    within an ulp on CUDA), with 16-bit and 8-bit metadata; and it is read (dropping it changes the output)."""
    name, (b, h_q, h_kv, d), hist, sink, recent, page, splits, first = case
    dev = "cuda" if CUDA else "cpu"
    md = torch.uint8 if meta == "meta8" else torch.float16
    c = make_case(len(name) + 17, b, h_q, h_kv, d, hist, sink, recent, page, torch.float16, dev, meta=md,
                  int4_keys=True)
    add_low_plane(c, first)
    base = {k: v for k, v in c.items() if k != "logit_bias"}
    slot = run_op(base, low_plane=c["low_plane"], num_splits=splits, config=TINY)
    paged = run_op(base, low_plane=paged_low_plane(c), num_splits=splits, config=TINY, out=_poisoned(c))
    _same_output(paged, slot)
    coarse = run_op(base, num_splits=splits, config=TINY)
    assert not torch.equal(coarse, paged), "the paged low plane changed nothing"


@pytest.mark.unit
@pytest.mark.parametrize("change", ["rows-strided", "one-head", "int32"])
def test_decode_paged_low_plane_must_match_the_key_pages(change: str) -> None:
    """A paged low plane must have the key pages' shape and strides (it is addressed by their offsets)."""
    c = make_case(3, 2, 4, 2, 64, [40, 9], [2, 2], [2, 2], 16, torch.float16, "cpu", meta=torch.float16,
                  int4_keys=True)
    codes = paged_low_plane(c).codes
    bad = {"rows-strided": torch.cat([codes, codes], -1)[..., ::2], "one-head": codes[:, :1],
           "int32": codes.to(torch.int32)}[change]
    with pytest.raises(ValueError, match="low_plane.codes.*paged"):
        run_op({k: v for k, v in c.items() if k != "logit_bias"}, low_plane=ops.LowPlane(bad))


@pytest.mark.unit
@pytest.mark.parametrize("change,match", [
    ("codes-heads", "low_plane.codes"),
    ("codes-int32", "low_plane.codes"),
    ("codes-strided-rows", "low_plane.codes"),
    ("first-int64", "low_plane.first"),
    ("first-for-one-row", "low_plane.first"),
])
def test_decode_low_plane_bad_arguments_are_refused(change: str, match: str) -> None:
    c = make_case(3, 2, 4, 2, 64, [40, 9], [2, 2], [2, 2], 16, torch.float16, "cpu", meta=torch.float16,
                  int4_keys=True)
    add_low_plane(c, [0, 2])
    codes, first = c["low_plane"].codes, c["low_plane"].first
    bad = {"codes-heads": ops.LowPlane(codes[:, :1], first),
           "codes-int32": ops.LowPlane(codes.to(torch.int32), first),
           "codes-strided-rows": ops.LowPlane(torch.cat([codes, codes], -1)[..., ::2], first),
           "first-int64": ops.LowPlane(codes, first.long()),
           "first-for-one-row": ops.LowPlane(codes, first[:1])}[change]
    with pytest.raises(ValueError, match=match):
        run_op({k: v for k, v in c.items() if k != "logit_bias"}, low_plane=bad)


@pytest.mark.unit
def test_decode_low_plane_slots_are_range_checked_in_debug_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """``OSCAR_KERNEL_DEBUG=1``: a first slot that puts a row's history past the plane is one error, not a read out
    of bounds."""
    c = make_case(3, 2, 4, 2, 64, [40, 9], [2, 2], [2, 2], 16, torch.float16, "cpu", meta=torch.float16,
                  int4_keys=True)
    add_low_plane(c, [0, 2])
    short = ops.LowPlane(c["low_plane"].codes[:, :, :30], c["low_plane"].first)
    monkeypatch.setenv("OSCAR_KERNEL_DEBUG", "1")
    with pytest.raises(ValueError, match="low_plane.first"):
        run_op({k: v for k, v in c.items() if k != "logit_bias"}, low_plane=short)


@pytest.mark.unit
@pytest.mark.parametrize("prec", ["fp16", "tf32x3"])
@pytest.mark.parametrize("config_id", ["four-warps", "one-warp", "one-warp-q-hoisted"])
@pytest.mark.parametrize("case", ROPE_CASES, ids=[c[0] for c in ROPE_CASES])
def test_decode_rope_mean_in_tile_interpreter(case: tuple, config_id: str, prec: str) -> None:
    """The position-dependent key mean's term computed in stage 1 (``rope_mean``: per-residue angle addition over the
    position table) against the float64 oracle given the GEMM form's term: ragged rows and first positions, masked
    tails, page boundaries, positions past 128K, 6 query heads per KV head padded to 8; and close to the same
    kernel reading the GEMM form's ``logit_bias`` (a different float32 summation of the same term)."""
    name, (b, h_q, h_kv, d), hist, sink, recent, page, splits, pos0 = case
    config, seed = CONFIGS[config_id]
    config = replace(config, rope_prec=prec)
    dev = "cuda" if CUDA else "cpu"
    c = make_case(len(name) * seed + 5, b, h_q, h_kv, d, hist, sink, recent, page, torch.float16, dev,
                  meta=torch.float16)
    add_rope_mean(c, pos0, scaling=1.2, seed=seed)
    assert float(c["logit_bias"].abs().max()) > 2.0, "a term too small to test"
    fused = run_op({k: v for k, v in c.items() if k != "logit_bias"}, rope_mean=c["rope_mean"], num_splits=splits,
                   config=config, out=_poisoned(c))
    assert_budget(fused, c)
    unfused = run_op(c, num_splits=splits, config=config)
    tol = (4 if prec == "tf32x3" else 16) * torch.finfo(torch.float16).eps * unfused.abs().max()
    assert (fused.float() - unfused.float()).abs().max() <= tol


@pytest.mark.unit
def test_default_config_drops_the_register_cap_for_the_rope_term() -> None:
    """From batch 16 the plain decode caps registers at 168; with the rope term in the tile it does not (its operands
    spill under the cap), and a plan given ``rope_mean`` and no config takes that choice."""
    assert ops.default_config(16).maxnreg == 168 and ops.default_config(16, rope_mean=True).maxnreg is None
    assert ops.default_config(1, rope_mean=True) == ops.default_config(1)
    c = make_case(3, 16, 4, 2, 64, [20] * 16, [2] * 16, [2] * 16, 16, torch.float16, "cpu", meta=torch.float16)
    add_rope_mean(c, [100] * 16)
    plan = ops.DecodePlan(c["q"], *(c[k] for k in CACHE_KEYS), rope_mean=c["rope_mean"])
    assert plan.config.maxnreg is None


@pytest.mark.unit
@pytest.mark.parametrize("change,match", [
    ("mean-heads", "rope_mean.mean_pre"),
    ("table-dim", "rope_mean.table"),
    ("table-shorter-than-a-tile", "rope_mean.table"),
    ("positions-int64", "rope_mean.position0"),
    ("positions-for-one-row", "rope_mean.position0"),
    ("precision", "rope_prec"),
])
def test_decode_rope_mean_bad_arguments_are_refused(change: str, match: str) -> None:
    c = make_case(3, 2, 4, 2, 64, [40, 9], [2, 2], [2, 2], 16, torch.float16, "cpu", meta=torch.float16)
    add_rope_mean(c, [0, 5])
    r, cfg = c["rope_mean"], TINY
    if change == "mean-heads":
        r = replace(r, mean_pre=torch.zeros(1, 64))
    elif change == "table-dim":
        r = replace(r, table=torch.zeros(400, 128))
    elif change == "table-shorter-than-a-tile":
        r = replace(r, table=r.table[: TINY.block_n - 1].contiguous())
    elif change == "positions-int64":
        r = replace(r, position0=r.position0.long())
    elif change == "positions-for-one-row":
        r = replace(r, position0=r.position0[:1])
    else:
        cfg = replace(TINY, rope_prec="bf16")
    with pytest.raises(ValueError, match=match):
        run_op({k: v for k, v in c.items() if k != "logit_bias"}, rope_mean=r, config=cfg)


@pytest.mark.unit
def test_decode_logit_bias_shorter_than_the_table_is_refused() -> None:
    c = make_case(3, 1, 4, 1, 64, [40], [2], [2], 16, torch.float16, "cpu", meta=torch.float16, bias_mag=1.0)
    with pytest.raises(ValueError, match="logit_bias"):
        run_op({**c, "logit_bias": c["logit_bias"][:, :, :40]}, config=TINY)
    with pytest.raises(ValueError, match="logit_bias"):
        run_op({**c, "logit_bias": c["logit_bias"].double()}, config=TINY)


@pytest.mark.unit
def test_decode_long_ragged_splits_past_4096() -> None:
    """Histories of 4097 and 4095 tokens (one past and one short of 4096) over 8 splits of many tiles, pages of 16:
    the split and tile boundaries of the GPU grid's longest lengths; the interpreter (~30 s) checks the semantics,
    the GPU grid the compiled pipeline. At this
    length one lost token is inside the error budget; a lost 16-token tile is not (checked by mutation: 5.4e-3 >
    3.3e-3)."""
    dev = "cuda" if CUDA else "cpu"
    c = make_case(4097, 2, 4, 1, 64, [4097, 4095], [2, 3], [3, 0], 16, torch.float16, dev, meta=torch.float16)
    assert_budget(run_op(c, num_splits=8, config=WHOLE_BYTE, out=_poisoned(c)), c)


@pytest.mark.unit
@pytest.mark.parametrize(("page", "block_n"), [(16, 32), (16, 64), (32, 64), (48, 64), (64, 128)])
def test_decode_pages_smaller_than_the_tile(page: int, block_n: int) -> None:
    """A tile over several pages: V loaded page by page (16-byte rows of each page's block), ragged ends inside a
    page; pages that do not divide the tile (48) take per-quad addresses."""
    dev = "cuda" if CUDA else "cpu"
    c = make_case(page + block_n, 2, 8, 2, 64, [97, 40], [2, 3], [5, 4], page, torch.float16, dev,
                  meta=torch.float16)
    cfg = replace(WHOLE_BYTE, block_n=max(block_n, 64) if CUDA else block_n)
    assert_budget(run_op(c, num_splits=2, config=cfg, out=_poisoned(c)), c)


@pytest.mark.unit
def test_decode_hoisted_q_operands_change_nothing() -> None:
    """``hoist_q`` only moves the q operands' layout conversion before the loop (through dots on a K tile whose
    loads are all masked off): in the interpreter the output is bitwise the in-order kernel's; compiled for a GPU,
    ptxas may contract multiply-adds differently in the two kernels, so there both meet the error budget and agree
    closely."""
    dev = "cuda" if CUDA else "cpu"
    c = make_case(21, 2, 8, 2, 64, [97, 40], [3, 2], [5, 3], 16, torch.float16, dev, meta=torch.float16)
    base = run_op(c, num_splits=3, config=WHOLE_BYTE, out=_poisoned(c))
    hoisted = run_op(c, num_splits=3, config=replace(WHOLE_BYTE, hoist_q=True), out=_poisoned(c))
    if CUDA:
        assert_budget(hoisted, c)
        torch.testing.assert_close(hoisted, base, rtol=0, atol=1e-2)
    else:
        assert torch.equal(base, hoisted)


@pytest.mark.unit
@pytest.mark.parametrize(("q_mag", "v_mag", "v_ramp"),
                         [(300.0, 1.0, 0.0), (0.002, 1.0, 0.0), (1.0, 2000.0, 0.0), (1.0, 1e-4, 0.0), (1.0, 1.0, 16.0),
                          (1.0, 1.0, -16.0)],
                         ids=["large-q", "tiny-q", "large-v", "tiny-v", "growing-v", "shrinking-v"])
def test_decode_subnormal_fields_extreme_scales(q_mag: float, v_mag: float, v_ramp: float) -> None:
    """The per-program q scale and the per-tile V scale keep fp16 operands finite and out of the subnormals."""
    dev = "cuda" if CUDA else "cpu"
    c = make_case(5, 1, 4, 1, 64, [90], [2], [3], 16, torch.float16, dev, meta=torch.float16, q_mag=q_mag,
                  v_mag=v_mag, v_ramp=v_ramp)
    assert_budget(run_op(c, num_splits=1, config=WHOLE_BYTE, out=_poisoned(c)), c)


@pytest.mark.unit
@pytest.mark.parametrize("merge_cols", [32, 64], ids=["merge-32-cols", "merge-all-cols"])
def test_decode_merge_column_split(merge_cols: int) -> None:
    """The merge either re-reads the partials per 32 output dims (more programs) or reads them once (all D)."""
    dev = "cuda" if CUDA else "cpu"
    c = make_case(9, 2, 8, 2, 64, [40, 7], [2, 3], [3, 0], 16, torch.float16, dev, meta=torch.float16)
    assert_budget(run_op(c, num_splits=3, config=replace(TINY, merge_cols=merge_cols), out=_poisoned(c)), c)
    with pytest.raises(ValueError, match="merge_cols"):
        run_op(c, num_splits=3, config=replace(TINY, merge_cols=48))


@pytest.mark.unit
@pytest.mark.parametrize(("merge_heads", "merge_cols"), [(2, 64), (4, 64), (4, 32)],
                         ids=["two-heads-all-cols", "four-heads-all-cols", "four-heads-32-cols"])
def test_decode_merge_heads_share_the_rotation(merge_heads: int, merge_cols: int) -> None:
    """``merge_heads``: one merge program for several query heads of a KV head (each ``R_V`` chunk loaded once for
    them) gives the one-head merge's output within float32 rounding (another reduction layout), for every batch row
    and head; a count that is not a power of two dividing the group is refused by name."""
    dev = "cuda" if CUDA else "cpu"
    c = make_case(9, 3, 8, 2, 64, [40, 7, 90], [2, 3, 1], [3, 0, 2], 16, torch.float16, dev, meta=torch.float16)
    base = run_op(c, num_splits=3, config=replace(TINY, merge_cols=merge_cols), out=_poisoned(c))
    got = run_op(c, num_splits=3, config=replace(TINY, merge_cols=merge_cols, merge_heads=merge_heads),
                 out=_poisoned(c))
    assert_budget(got, c)
    torch.testing.assert_close(got, base, rtol=0, atol=2e-3)
    for bad in (3, 8):  # not a power of two; does not divide the group of 4
        with pytest.raises(ValueError, match="merge_heads"):
            run_op(c, num_splits=3, config=replace(TINY, merge_heads=bad))


@pytest.mark.unit
@pytest.mark.parametrize("hist", [40, 150])
def test_decode_contiguous_entry_matches_paged(hist: int) -> None:
    """The non-paged layout (values in token-quad rows of 64 tokens: 150 tokens are three row blocks)."""
    dev = "cuda" if CUDA else "cpu"
    c = make_case(7, 1, 4, 1, 64, [hist], [2], [3], 64, torch.float16, dev, meta=torch.float16)
    out = ops.decode_attention_contiguous(
        c["q"][:, :, None, :], c["qk"], ref.QuantizedRows(ref.rows_to_token_quads(c["qv"].packed), c["qv"].scale,
                                                           c["qv"].zero), c["sink_k"], c["sink_v"], c["recent_k"], c["recent_v"],
        hist_len=hist, sink_len=2, recent_len=3, rotation_k=c["rotation_k"], rotation_v=c["rotation_v"],
        mean_v=c["mean_v"], num_splits=2, config=TINY)
    assert out.shape == (1, 4, 1, 64)
    assert_budget(out[:, :, 0], c)


@pytest.mark.unit
def test_decode_bad_inputs_name_the_tensor() -> None:
    c = make_case(3, 1, 4, 1, 64, [8], [1], [1], 16, torch.float16, "cpu", meta=torch.float16)
    with pytest.raises(ValueError, match=r"q: expected .*got torch.float32 \(1, 4, 64\) on cpu"):
        c2 = dict(c, q=c["q"].float())
        run_op(c2)
    with pytest.raises(ValueError, match=r"block_table: expected int32"):
        run_op(dict(c, block_table=c["block_table"].long()))
    with pytest.raises(ValueError, match=r"sink_k: expected"):
        run_op(dict(c, sink_k=c["sink_k"][:, :, :, :32]))
    # values of a 128-token page as one [D, P/4] block instead of two 64-token rows [2·D, 16]
    c = make_case(5, 1, 4, 1, 64, [200], [1], [1], 128, torch.float16, "cpu", meta=torch.float16)
    old = ref.QuantizedRows(torch.zeros(c["v_cache"].packed.shape[0], 1, 64, 32, dtype=torch.uint8),
                            c["v_cache"].scale, c["v_cache"].zero)
    with pytest.raises(ValueError, match=r"v_cache.packed: expected uint8 \[\d+, 1, 128, 16\] \(token quads\)"):
        run_op(dict(c, v_cache=old))
    # pages above 64 tokens must be whole 64-token rows
    k80 = ops.new_paged_cache(2, 1, 80, 64, None, torch.float16, "cpu")
    with pytest.raises(ValueError, match="pages above 64 tokens must be multiples of 64"):
        run_op(dict(c, k_cache=k80, v_cache=k80, block_table=torch.zeros(1, 3, dtype=torch.int32)))


@pytest.mark.unit
def test_decode_tier_strides_only_matter_where_indexed() -> None:
    """A one-token tier's K and V may differ in the stride of their size-1 dim (never used); a real difference in
    shape or in a used stride is refused with both layouts named."""
    c = make_case(4, 2, 4, 2, 64, [20, 9], [2, 1], [1, 1], 16, torch.float16, "cpu", meta=torch.float16)
    rv = c["recent_v"]
    rv = rv.as_strided(rv.shape, (rv.stride(0), rv.stride(1), 2 * 64 * 64, 1))  # as a view of [B, 1, H, D] has it
    assert rv.stride() != c["recent_v"].stride() and torch.equal(rv, c["recent_v"])
    c2 = dict(c, recent_v=rv)
    assert_budget(run_op(c2, num_splits=2, config=TINY), c2)
    sv = c["sink_v"].new_empty(2, 2, 2, 64).transpose(1, 2).copy_(c["sink_v"])  # 2 tokens: the token stride is used
    with pytest.raises(ValueError, match=r"sink_k/sink_v must share shape and strides .*\(2, 2, 2, 64\)"):
        run_op(dict(c, sink_v=sv), num_splits=2, config=TINY)
    with pytest.raises(ValueError, match=r"recent_k/recent_v must share shape"):
        run_op(dict(c, recent_v=torch.cat([c["recent_v"]] * 2, 2)), num_splits=2, config=TINY)


META8_CASES = [CPU_CASES[i] for i in (0, 1, 3, 4)]


def _same_output(a: torch.Tensor, b: torch.Tensor) -> None:
    """Two readings of the same metadata bytes (byte tiles, 32-bit words): bitwise equal in the interpreter; on CUDA
    the compiled loops may round a sum in another order, so within one unit in the last place (measured on an H100:
    1 of 1,024 outputs 6.1e-5 apart, in one of 16 cases)."""
    if a.device.type == "cpu":
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=2.0 ** -10, atol=2.0 ** -14)


@pytest.mark.unit
@pytest.mark.parametrize("words", [False, True], ids=["byte-tiles", "words"])
@pytest.mark.parametrize("config_id", ["four-warps", "one-warp"])
@pytest.mark.parametrize("case", META8_CASES, ids=[c[0] for c in META8_CASES])
def test_decode_meta8_interpreter(case: tuple, config_id: str, words: bool) -> None:
    """Formula 10's 8-bit metadata decoded in the tile (e5m3 scale byte, zero byte in 1/16 steps) against the
    float64 oracle of the same bytes: ragged rows, masked tails (their zero bytes decode to finite values), page
    boundaries, D 128, pages of two token-quad rows."""
    name, (b, h_q, h_kv, d), hist, sink, recent, page, splits = case
    config, seed = CONFIGS[config_id]
    dev = "cuda" if CUDA else "cpu"
    c = make_case(len(name) * seed + 5, b, h_q, h_kv, d, hist, sink, recent, page, torch.float16, dev, meta=torch.uint8)
    assert c["k_cache"].scale.dtype == torch.uint8
    out = run_op(c, num_splits=splits, config=replace(config, meta_words=words), out=_poisoned(c))
    assert_budget(out, c)
    if words:  # the same bytes, read four at a time: the same output (bitwise in the interpreter)
        _same_output(out, run_op(c, num_splits=splits, config=replace(config, meta_words=False), out=_poisoned(c)))


@pytest.mark.unit
@pytest.mark.parametrize("hist", [[37, 130], [1, 66]], ids=["ragged", "one-token"])
def test_decode_meta8_ignores_stale_bytes_past_the_end(hist: list[int]) -> None:
    """``meta_words`` reads a token quad's four metadata bytes as one 32-bit word: the bytes of a quad's tokens past
    the row's end must not count, here the largest scale and zero (255) in every slot past the end (left by an
    earlier request in a real cache), which would otherwise set the tile's value scale and change the valid tokens'
    rounding (a peaked softmax makes that visible bitwise)."""
    dev = "cuda" if CUDA else "cpu"
    page = 16
    c = make_case(77, 2, 4, 2, 64, hist, [3, 5], [7, 2], page, torch.float16, dev, meta=torch.uint8, q_mag=4.0)
    words = replace(TINY, meta_words=True)
    clean = run_op(c, num_splits=2, config=words, out=_poisoned(c))
    for rows in (c["k_cache"], c["v_cache"]):
        for part in (rows.scale, rows.zero):
            for bi, n in enumerate(hist):
                for slot in range(n, int(c["block_table"].shape[1]) * page):
                    part[int(c["block_table"][bi, slot // page]), :, slot % page] = 255
    stale = run_op(c, num_splits=2, config=words, out=_poisoned(c))
    assert torch.equal(stale, clean)  # bitwise: those bytes never reach the arithmetic
    assert_budget(stale, c)


@pytest.mark.unit
def test_decode_meta8_refuses_metadata_off_a_word_boundary() -> None:
    dev = "cuda" if CUDA else "cpu"
    c = make_case(78, 1, 4, 2, 64, [40], [3], [2], 16, torch.float16, dev, meta=torch.uint8)
    k, v = c["k_cache"], c["v_cache"]
    shifted = []  # the same bytes, one byte into a fresh buffer
    for t in (k.scale, k.zero, v.scale, v.zero):
        moved = torch.zeros(t.numel() + 1, dtype=torch.uint8, device=t.device)[1:].view(t.shape)
        moved.copy_(t)
        shifted.append(moved)
    c2 = dict(c, k_cache=ref.QuantizedRows(k.packed, shifted[0], shifted[1]),
              v_cache=ref.QuantizedRows(v.packed, shifted[2], shifted[3]))
    with pytest.raises(ValueError, match="4-byte boundary"):
        run_op(c2, num_splits=2, config=replace(TINY, meta_words=True))
    assert_budget(run_op(c2, num_splits=2, config=replace(TINY, meta_words=False)), c)  # byte tiles: any address


@pytest.mark.unit
@pytest.mark.parametrize("offset", [0, 1, 2], ids=["aligned", "one-byte-off", "two-bytes-off"])
def test_decode_meta8_default_reads_words_where_the_metadata_allows(offset: int) -> None:
    """``meta_words=None`` (the default): 32-bit words when all four metadata tensors sit on 4-byte boundaries
    (oscar's caches), byte tiles otherwise; the same output either way (``_same_output``)."""
    dev = "cuda" if CUDA else "cpu"
    c = make_case(79, 2, 4, 2, 64, [40, 9], [3, 1], [2, 4], 16, torch.float16, dev, meta=torch.uint8)
    parts = []
    for rows in (c["k_cache"], c["v_cache"]):
        for t in (rows.scale, rows.zero):
            moved = torch.zeros(t.numel() + 4, dtype=torch.uint8, device=t.device)[offset:offset + t.numel()]
            parts.append(moved.view(t.shape).copy_(t))
    c2 = dict(c, k_cache=ref.QuantizedRows(c["k_cache"].packed, parts[0], parts[1]),
              v_cache=ref.QuantizedRows(c["v_cache"].packed, parts[2], parts[3]))
    plan = ops.DecodePlan(c2["q"], *(c2[k] for k in CACHE_KEYS), rotation_k=c2["rotation_k"],  # type: ignore[arg-type]
                          rotation_v=c2["rotation_v"], mean_v=c2["mean_v"], num_splits=2, config=TINY,
                          out=_poisoned(c2))
    assert plan.config.meta_words is None and plan.meta_words == (offset == 0)
    bytes_out = run_op(c2, num_splits=2, config=replace(TINY, meta_words=False), out=_poisoned(c2))
    _same_output(plan.run().clone(), bytes_out)
    assert_budget(bytes_out, c)


@pytest.mark.unit
def test_decode_meta8_with_the_low_plane_interpreter() -> None:
    """INT4 keys (formula 9) with 8-bit metadata: the low plane's quarter of the decoded scale, in the tile."""
    name, (b, h_q, h_kv, d), hist, sink, recent, page, splits, first = LOW_PLANE_CASES[0]
    dev = "cuda" if CUDA else "cpu"
    c = make_case(41, b, h_q, h_kv, d, hist, sink, recent, page, torch.float16, dev, meta=torch.uint8, int4_keys=True)
    add_low_plane(c, first)
    fused = run_op({k: v for k, v in c.items() if k != "logit_bias"}, low_plane=c["low_plane"], num_splits=splits,
                   config=TINY, out=_poisoned(c))
    assert_budget(fused, c)


# ---- GPU grid --------------------------------------------------------------------------------------

GPU_HEADS = [(32, 8), (28, 4), (8, 8)]
GPU_LENS = [1, 31, 97, 4095, 4097]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="requires CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", GPU_HEADS, ids=[f"{a}q{b}kv" for a, b in GPU_HEADS])
@pytest.mark.parametrize("length", GPU_LENS, ids=[f"len{n}" for n in GPU_LENS])  # "-k len97" is only 97
def test_decode_gpu_grid(length: int, heads: tuple[int, int], d: int, dtype: torch.dtype) -> None:
    b = {1: 3, 31: 17, 97: 1, 4095: 3, 4097: 1}[length]
    hist = [max(length - 320, 0) if i == 0 else (length * (i + 1)) % (length + 1) for i in range(b)]
    sink = [min(64, length)] * b
    recent = [min(256, max(length - 64, 0))] * b
    page = 16 if length % 2 else 64
    c = make_case(length * 7 + d, b, heads[0], heads[1], d, hist, sink, recent, page, dtype, "cuda")
    out = run_op(c, out=_poisoned(c))
    assert_budget(out, c)
    if heads == (32, 8) and d == 128:  # the other tile and launch configurations, on one head layout
        for cfg in (ops.DecodeConfig(num_warps=4), ops.DecodeConfig(block_n=128, num_warps=2),
                    ops.DecodeConfig(min_gp=16), ops.DecodeConfig(maxnreg=128), ops.DecodeConfig(pdl=False),
                    ops.DecodeConfig(merge_cols=128), ops.DecodeConfig(hist_stages=2),
                    ops.DecodeConfig(hoist_q=True), ops.DecodeConfig(hoist_q=True, maxnreg=168),
                    ops.DecodeConfig(prefetch=False), ops.DecodeConfig(prefetch=False, hoist_q=False, maxnreg=168)):
            assert_budget(run_op(c, out=_poisoned(c), config=cfg), c)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="requires CUDA")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("length", [97, 4097])
def test_decode_gpu_meta8(length: int, d: int) -> None:
    """8-bit metadata on the GPU, the default config and the hoisted-q one."""
    hist = [max(length - 320, 0), length // 3]
    c = make_case(length + d, 2, 32, 8, d, hist, [64, 64], [256, 40], 16, torch.bfloat16, "cuda", meta=torch.uint8)
    assert_budget(run_op(c, out=_poisoned(c)), c)
    assert_budget(run_op(c, out=_poisoned(c), config=ops.DecodeConfig(hoist_q=True)), c)
    assert_budget(run_op(c, out=_poisoned(c), config=ops.DecodeConfig(hoist_q=True, meta_words=True)), c)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="requires CUDA")
@pytest.mark.parametrize("page", [128, 256])
@pytest.mark.parametrize("length", [1000, 4097])
def test_decode_gpu_large_pages(length: int, page: int) -> None:
    """Pages above 64 tokens (token-quad rows of 64 tokens), with other tile and prefetch settings."""
    b = 3
    hist = [length - 320, (length * 2) % (length + 1), 17]
    c = make_case(length + page, b, 32, 8, 128, hist, [64] * b, [256] * b, page, torch.bfloat16, "cuda")
    for cfg in (None, ops.DecodeConfig(hoist_q=True), ops.DecodeConfig(block_n=128, num_warps=2),
                ops.DecodeConfig(prefetch=False)):
        assert_budget(run_op(c, out=_poisoned(c), config=cfg), c)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="requires CUDA")
@pytest.mark.parametrize("length", [97, 4097, 33_000], ids=["len97", "len4097", "len33000"])
def test_decode_gpu_logit_bias(length: int) -> None:
    """The per-key logit bias on CUDA (Qwen2.5-Coder-1.5B's heads, the default and the prefetch-off tile)."""
    b = 3
    hist = [length - 320 if length > 320 else length, 17, 0]
    c = make_case(length + 5, b, 12, 2, 128, hist, [64] * b, [256] * b, 64, torch.bfloat16, "cuda", bias_mag=4.0)
    for cfg in (None, ops.DecodeConfig(prefetch=False)):
        assert_budget(run_op(c, out=_poisoned(c), config=cfg), c)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="requires CUDA")
@pytest.mark.parametrize("prec", ["fp16", "tf32x3"])
@pytest.mark.parametrize("length", [97, 4097, 33_000], ids=["len97", "len4097", "len33000"])
def test_decode_gpu_rope_mean_in_tile(length: int, prec: str) -> None:
    """The position-dependent key mean's term inside stage 1 on CUDA (Qwen2.5-Coder-1.5B's heads; batch 3 and 16,
    the second with and without ``default_config(16)``'s register cap), histories starting past 128K in one row."""
    for b in (3, 16):
        hist = ([length - 320 if length > 320 else length, 17, 0] * 6)[:b]
        c = make_case(length + 5 + b, b, 12, 2, 128, hist, [64] * b, [256] * b, 64, torch.bfloat16, "cuda")
        add_rope_mean(c, ([64, 131_000, 3] * 6)[:b], scaling=1.2, seed=b)
        for cfg in (ops.default_config(b, rope_mean=True), ops.default_config(b),
                    replace(ops.default_config(b), prefetch=False)):
            cfg = replace(cfg, rope_prec=prec)
            fused = run_op({k: v for k, v in c.items() if k != "logit_bias"}, rope_mean=c["rope_mean"],
                           out=_poisoned(c), config=cfg)
            assert_budget(fused, c)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="requires CUDA")
@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
def test_decode_cuda_graph_replay_equals_eager(prefetch: bool) -> None:
    c = make_case(11, 3, 32, 8, 128, [3000, 17, 0], [64, 64, 5], [256, 100, 0], 64, torch.bfloat16, "cuda")
    s = 8
    cfg = replace(ops.default_config(3), prefetch=prefetch)
    ws = ops.make_workspace(3, 32, 128, s, torch.device("cuda"))
    out = _poisoned(c)
    eager = run_op(c, num_splits=s, workspace=ws, out=out, config=cfg).clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_op(c, num_splits=s, workspace=ws, out=out, config=cfg)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_op(c, num_splits=s, workspace=ws, out=out, config=cfg)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    # new data in the same buffers (lengths are device tensors): replay follows
    c["hist_len"].copy_(torch.tensor([2500, 40, 3], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert_budget(out, c)


@pytest.mark.unit
def test_decode_plan_refill_in_place_and_empty_rows() -> None:
    """A DecodePlan re-run after refilling its tensors follows the new data; a row with no keys gives zeros."""
    dev = "cuda" if CUDA else "cpu"
    c = make_case(5, 2, 4, 1, 64, [20, 9], [2, 0], [3, 0], 16, torch.float16, dev, meta=torch.float16)
    plan = ops.DecodePlan(c["q"], *(c[k] for k in CACHE_KEYS), rotation_k=c["rotation_k"], rotation_v=c["rotation_v"],
                          mean_v=c["mean_v"], num_splits=2, config=TINY, out=_poisoned(c))
    assert_budget(plan.run(), c)
    c["q"].copy_(torch.randn_like(c["q"].float()).to(c["q"].dtype))
    c["hist_len"].copy_(torch.tensor([13, 0], dtype=torch.int32))
    plan.out.fill_(float("nan"))
    out = plan.run()
    assert_budget(out, c)
    # row 1 has no keys at all: zeros (then + mu_V, rotated back), never NaN
    want = (c["mean_v"].float() @ c["rotation_v"].T).to(out.dtype)
    torch.testing.assert_close(out[1], want.expand_as(out[1]), rtol=0, atol=2e-3)


# ---- the BF16 tiers read in place (ops.TierIndex: the vLLM backend's OSCAR_VLLM_DIRECT_TIERS) ------------------

DIRECT_CASES = [CPU_CASES[0], CPU_CASES[2], CPU_CASES[5]]  # ragged rows, no INT2 history, ranges straddling tiers


def _tier_storage(c: dict, rows_total: int, ring: int, means: str, seed: int) -> tuple[tuple[torch.Tensor, ...],
                                                                                           ops.TierIndex]:
    """The case's tiers as the vLLM layer keeps them: storage ``[rows_total + 1, H_kv, S or ring, D]`` (uncentred,
    rows in a shuffled order, ring slots wrapped by each sequence's length) and the :class:`ops.TierIndex` that reads
    the case's ``sink_len`` / ``recent_len`` rows of it."""
    gen = torch.Generator().manual_seed(seed)
    b, h_kv, s_cap, d = c["sink_k"].shape
    dt, dev = c["q"].dtype, c["q"].device
    store = tuple((torch.randn(rows_total + 1, h_kv, t, d, generator=gen) * 2).to(dt).to(dev)
                  for t in (s_cap, s_cap, ring, ring))
    rows = torch.randperm(rows_total, generator=gen)[:b].to(torch.int64).to(dev)
    seq = c["recent_len"].cpu().long() + torch.randint(0, 3 * ring, (b,), generator=gen)  # wrapped at any offset
    from oscar_cli.vllm.layout import ring_gather_index

    idx = ring_gather_index(seq, c["recent_len"].cpu(), ring).to(dev)
    shape = (h_kv, d) if means == "per-head" else (d,)
    km, vm = (torch.randn(*shape, generator=gen).to(dev) for _ in range(2))
    return store, ops.TierIndex(rows, idx, km, vm)


@pytest.mark.unit
@pytest.mark.parametrize("means", ["per-head", "shared"])
@pytest.mark.parametrize("case", DIRECT_CASES, ids=[c[0] for c in DIRECT_CASES])
def test_decode_reads_the_tiers_in_place_bitwise(case: tuple, means: str) -> None:
    """``tier_index=ops.TierIndex(...)``: stage 1 reads the sink and ring storage through each sequence's row and
    ring order and centres what it reads; the output is bit for bit the gather-then-decode path's (``ops.tier_gather``
    into ``[B, ...]`` copies, then the plain decode), which it replaces. fp16 in the interpreter (its bf16 cast
    truncates where the GPU rounds), bf16 on CUDA."""
    name, (b, h_q, h_kv, d), hist, sink, recent, page, splits = case
    dev = "cuda" if CUDA else "cpu"
    dt = torch.bfloat16 if CUDA else torch.float16
    c = make_case(len(name) + 5, b, h_q, h_kv, d, hist, sink, recent, page, dt, dev, meta=torch.float16)
    store, index = _tier_storage(c, b + 3, max(recent) + 5, means, len(name))
    gathered = ops.tier_gather(*store, index.rows, index.ring_index, index.k_mean, index.v_mean)
    kw = dict(rotation_k=c["rotation_k"], rotation_v=c["rotation_v"], mean_v=c["mean_v"], num_splits=splits,
              config=TINY)
    want = ops.decode_attention(c["q"], c["k_cache"], c["v_cache"], c["block_table"], c["hist_len"], gathered[0],
                                gathered[1], c["sink_len"], gathered[2], gathered[3], c["recent_len"],
                                **kw)  # type: ignore[arg-type]
    plan = ops.DecodePlan(c["q"], c["k_cache"], c["v_cache"], c["block_table"], c["hist_len"], store[0], store[1],
                          c["sink_len"], store[2], store[3], c["recent_len"], tier_index=index, out=_poisoned(c),
                          **kw)  # type: ignore[arg-type]
    got = plan.run()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert plan._stage1[2]["DIRECT_TIERS"]


@pytest.mark.unit
@pytest.mark.parametrize("setting", [None, True, False])
def test_tier_prefetch_by_path(setting: bool | None) -> None:
    """``DecodeConfig.tier_prefetch``: None (the default) prefetches the gathered copies' rows and not the rows of
    tiers read in place (on an H100 that prefetch cost time from 6 requests on: docs/VLLM.md); True / False force
    either path. The plan's stage-1 launch carries the choice (no kernel runs here)."""
    name, (b, h_q, h_kv, d), hist, sink, recent, page, splits = DIRECT_CASES[0]
    c = make_case(2, b, h_q, h_kv, d, hist, sink, recent, page, torch.float16, "cpu", meta=torch.float16)
    store, index = _tier_storage(c, b + 3, max(recent) + 5, "per-head", 2)
    gathered = ops.tier_gather(*store, index.rows, index.ring_index, index.k_mean, index.v_mean)
    kw = dict(rotation_k=c["rotation_k"], rotation_v=c["rotation_v"], num_splits=splits,
              config=replace(TINY, tier_prefetch=setting))
    head = (c["q"], c["k_cache"], c["v_cache"], c["block_table"], c["hist_len"])
    in_place = ops.DecodePlan(*head, store[0], store[1], c["sink_len"], store[2], store[3], c["recent_len"],
                              tier_index=index, **kw)  # type: ignore[arg-type]
    copies = ops.DecodePlan(*head, gathered[0], gathered[1], c["sink_len"], gathered[2], gathered[3],
                            c["recent_len"], **kw)  # type: ignore[arg-type]
    assert in_place._stage1[2]["TIER_PREFETCH"] is (False if setting is None else setting)
    assert copies._stage1[2]["TIER_PREFETCH"] is (True if setting is None else setting)


@pytest.mark.unit
def test_decode_tier_index_refusals_name_the_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    name, (b, h_q, h_kv, d), hist, sink, recent, page, _ = DIRECT_CASES[0]
    dev = "cuda" if CUDA else "cpu"
    c = make_case(1, b, h_q, h_kv, d, hist, sink, recent, page, torch.float16, dev, meta=torch.float16)
    store, index = _tier_storage(c, b + 3, max(recent) + 5, "per-head", 1)
    args = (c["q"], c["k_cache"], c["v_cache"], c["block_table"], c["hist_len"], store[0], store[1], c["sink_len"],
            store[2], store[3], c["recent_len"])
    kw = dict(rotation_k=c["rotation_k"], rotation_v=c["rotation_v"], config=TINY)
    bad = {"tier_index.rows": replace(index, rows=index.rows.int()),
           "tier_index.ring_index": replace(index, ring_index=index.ring_index[:1]),
           "tier_index.k_mean": replace(index, k_mean=index.k_mean.half()),
           "tier_index.v_mean": replace(index, v_mean=index.v_mean[:, :8])}
    for what, ti in bad.items():
        with pytest.raises(ValueError, match=what.replace(".", r"\.")):
            ops.DecodePlan(*args, tier_index=ti, **kw)  # type: ignore[arg-type]
    short = replace(index, ring_index=index.ring_index[:, :1])  # recent_len is up to 5: more than 1 column
    with pytest.raises(ValueError, match="recent_len"):
        monkeypatch.setenv("OSCAR_KERNEL_DEBUG", "1")
        ops.DecodePlan(*args, tier_index=short, **kw)  # type: ignore[arg-type]
    far = replace(index, ring_index=index.ring_index + int(store[2].shape[2]))
    with pytest.raises(ValueError, match="tier_index.ring_index: entries outside"):
        ops.DecodePlan(*args, tier_index=far, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tier_index.rows: entries outside"):
        ops.DecodePlan(*args, tier_index=replace(index, rows=index.rows + 100), **kw)  # type: ignore[arg-type]
