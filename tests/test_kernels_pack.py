"""Triton quantize-on-write vs oscar_kernels.reference: codes, scale, zero and packed bytes bitwise.

Bitwise holds for the same float32 rotated rows (reference "What can be asserted"); with a rotation inside the
kernel the float32 matmul's summation order differs from torch's, so codes may flip only where the reference's
pre-rounding value sits within float32 rounding of a .5 boundary — asserted as such.
CPU runs use the Triton interpreter on tiny grids; ``-m gpu`` adds bf16 inputs, page size 64 and big blocks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oscar_kernels import ops
from oscar_kernels import reference as ref

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _rows(seed: int, b: int, h: int, t: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, t, d, generator=gen) * torch.rand(b, h, t, 1, generator=gen).mul(4).add(0.05)
    x[..., ::5, 3] *= 30.0  # outlier channel
    return x.to(dtype).to(DEV)


def _ref_cpu(x: torch.Tensor, *args: object) -> ref.QuantizedRows:
    """The reference on CPU: torch's CUDA ``t / 3.0`` multiplies by a rounded reciprocal, not IEEE division."""
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    return ref.quantize_rows(x.cpu(), *cpu)  # type: ignore[arg-type]


def _assert_same(a: ref.QuantizedRows, r: ref.QuantizedRows) -> None:
    for name in ("packed", "scale", "zero"):
        x, y = getattr(a, name).cpu(), getattr(r, name).cpu()
        assert x.dtype == y.dtype and x.shape == y.shape, f"{name}: {x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}"
        bad = (x != y).nonzero()
        assert bad.numel() == 0, f"{name}: {bad.shape[0]} mismatches, first at {bad[0].tolist()}"


PACK_CASES = [
    # id, (B, H_kv, T, D), G, clip, meta, per-head mean
    ("D64-noclip-fp16meta", (1, 2, 17, 64), None, 0.0, torch.float16, False),
    ("D64-clip092-bf16meta", (1, 1, 16, 64), None, 0.92, torch.bfloat16, True),
    ("D128-G32-fp32meta", (2, 1, 5, 128), 32, 0.0, torch.float32, False),
    ("D128-clip096-bf16meta", (1, 1, 3, 128), None, 0.96, torch.bfloat16, False),
    # formula 10's 8-bit metadata (e5m3 scale byte, centred zero byte)
    ("D64-clip092-meta8", (1, 2, 17, 64), None, 0.92, torch.uint8, True),
    ("D128-G32-noclip-meta8", (2, 1, 5, 128), 32, 0.0, torch.uint8, False),
    ("D128-clip096-meta8", (1, 1, 9, 128), None, 0.96, torch.uint8, False),
]


@pytest.mark.unit
@pytest.mark.parametrize("case", PACK_CASES, ids=[c[0] for c in PACK_CASES])
def test_quantize_bitwise_on_rotated_rows(case: tuple) -> None:
    """No rotation in the kernel: float32 rows in, bitwise equal out (centre + clip + quantize + pack)."""
    name, (b, h, t, d), g, clip, meta, per_head = case
    x = _rows(len(name), b, h, t, d, torch.float16)
    gen = torch.Generator().manual_seed(1)
    mean = (torch.randn(h, d, generator=gen) if per_head else torch.randn(d, generator=gen)).to(DEV) * 0.3
    before = x.clone()
    got = ops.quantize_rows(x, None, mean, clip, g, meta)
    assert torch.equal(x, before), "input modified"
    _assert_same(got, _ref_cpu(x, None, mean, clip, g, meta))


@pytest.mark.unit
def test_quantize_with_rotation_matches_up_to_rounding_ties() -> None:
    b, h, t, d = 1, 2, 9, 64
    x = _rows(5, b, h, t, d, torch.float16)
    gen = torch.Generator().manual_seed(2)
    r = torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))[0].float().to(DEV)
    got = ops.quantize_rows(x, r, None, 0.0, None, torch.float32)
    want = _ref_cpu(x, r, None, 0.0, None, torch.float32)
    x, r = x.cpu(), r.cpu()
    got = ref.QuantizedRows(got.packed.cpu(), got.scale.cpu(), got.zero.cpu())
    torch.testing.assert_close(got.scale, want.scale, rtol=1e-5, atol=0)
    torch.testing.assert_close(got.zero, want.zero, rtol=1e-5, atol=1e-6)
    cg, cw = ref.unpack_int2(got.packed).int(), ref.unpack_int2(want.packed).int()
    y = ref.rotate(x, r)
    pos = (y - want.zero.float()) / want.scale.float() + 0.5
    near_tie = (pos - pos.round()).abs() < 1e-4
    assert ((cg == cw) | near_tie).all(), "a code differs away from a rounding boundary"
    assert (cg != cw).float().mean() < 0.01


@pytest.mark.unit
def test_quantize_write_paged_slots_and_skip() -> None:
    """Scatter into shuffled pages of size 16; slot -1 rows are not written; other slots untouched."""
    n, h, d, page = 20, 2, 64, 16
    x = _rows(9, 1, n, h, d, torch.float16)[0]  # [N, H_kv, D]
    cache = ops.new_paged_cache(4, h, page, d, None, torch.float16, DEV)
    cache.packed.fill_(0xAB)
    slots = torch.randperm(4 * page, generator=torch.Generator().manual_seed(0))[:n].to(DEV)
    slots[3] = -1
    ops.quantize_write(x, cache, slots)
    want = _ref_cpu(x, None, None, 0.0, None, torch.float16)  # [N, H_kv, D/4]
    want = ref.QuantizedRows(*(t.to(DEV) for t in (want.packed, want.scale, want.zero)))
    ok = slots >= 0
    flat = cache.packed.permute(0, 2, 1, 3).reshape(4 * page, h, d // 4)
    assert torch.equal(flat[slots[ok]], want.packed[ok])
    untouched = torch.ones(4 * page, dtype=torch.bool, device=DEV)
    untouched[slots[ok]] = False
    assert (flat[untouched] == 0xAB).all()


@pytest.mark.unit
@pytest.mark.filterwarnings("ignore:All-NaN slice")
@pytest.mark.parametrize("layout", ["rows", "token_quads"])
@pytest.mark.parametrize("clip", [0.0, 0.92], ids=["noclip", "clip092"])
def test_quantize_write_a_mean_per_row_bitwise(layout: str, clip: float) -> None:
    """A mean per row ``[N, H_kv, D]`` (the position-dependent key mean): the same bytes as the reference on the
    rows centred first in float32; a skipped row's mean may hold anything (here NaN): nothing of it is stored."""
    n, h, d, page = 21, 2, 64, 16
    x = _rows(11, 1, n, h, d, torch.float16)[0]  # [N, H_kv, D]
    mean = (torch.randn(n, h, d, generator=torch.Generator().manual_seed(3)) * 2.0).to(DEV)
    slots = torch.randperm(2 * page, generator=torch.Generator().manual_seed(4))[:n].to(DEV)
    slots[5] = -1
    mean[5] = float("nan")
    cache = ops.new_paged_cache(2, h, page, d, None, torch.bfloat16, DEV, layout=layout)
    ops.quantize_write(x, cache, slots, mean=mean, clip_ratio=clip, layout=layout)
    ok = slots >= 0
    want = _ref_cpu((x.float() - mean)[ok], None, None, clip, None, torch.bfloat16)
    s = slots[ok].cpu()
    codes = ref.unpack_int2(cache.packed.cpu()) if layout == "rows" else ref.unpack_token_quads(cache.packed.cpu(),
                                                                                                 head_dim=d)
    assert torch.equal(codes[s // page, :, s % page], ref.unpack_int2(want.packed))
    for name in ("scale", "zero"):
        got = getattr(cache, name).cpu()[s // page, :, s % page]
        assert torch.equal(got, getattr(want, name)), name
    with pytest.raises(ValueError, match="mean"):
        ops.quantize_write(x, cache, slots, mean=mean[:-1], layout=layout)


def _token_quad_case(seed: int, n: int, h: int, d: int, page: int, pages: int) -> tuple:
    x = _rows(seed, 1, n, h, d, torch.float16)[0]  # [N, H_kv, D]
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(pages * page, generator=gen)[:n].to(DEV)
    return x, slots


def _token_quads_want(cache: ref.QuantizedRows, x: torch.Tensor, slots: torch.Tensor, page: int) -> torch.Tensor:
    """Expected token-quad bytes: the cache's previous codes with the written slots replaced by the reference's."""
    d = int(x.shape[-1])
    codes = ref.unpack_token_quads(cache.packed.cpu(), head_dim=d)  # [pages, H, P, D]
    rows = ref.unpack_int2(_ref_cpu(x, None, None, 0.0, None, torch.float16).packed)  # [N, H, D]
    ok = (slots >= 0).cpu()
    s = slots.cpu()[ok]
    codes[s // page, :, s % page] = rows[ok]
    return ref.pack_token_quads(codes, ref.token_quad_row(page))


@pytest.mark.unit
@pytest.mark.parametrize("page", [16, 64, 128])
def test_quantize_write_token_quads_bitwise(page: int) -> None:
    """Values in token quads: each row sets only its own 2 bits of D shared bytes, whatever the other rows of its
    quad hold or whether they are written in the same launch (shuffled slots, a skipped row, a second launch)."""
    n, h, d, pages = 37, 2, 64, 3
    x, slots = _token_quad_case(page + 1, n, h, d, page, pages)
    cache = ops.new_paged_cache(pages, h, page, d, None, torch.float16, DEV, layout="token_quads")
    cache.packed.copy_(torch.randint(0, 256, cache.packed.shape, generator=torch.Generator().manual_seed(3),
                                     dtype=torch.uint8).to(DEV))  # stale bits everywhere
    slots[5] = -1
    want = _token_quads_want(cache, x, slots, page)
    ops.quantize_write(x, cache, slots, layout="token_quads")
    got = cache.packed.cpu()
    assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ"
    # per-token metadata: same slots as the row layout
    meta = _ref_cpu(x, None, None, 0.0, None, torch.float16)
    ok = slots >= 0
    flat = cache.scale.permute(0, 2, 1, 3).reshape(pages * page, h, 1)
    assert torch.equal(flat[slots[ok]].cpu(), meta.scale[ok.cpu()])
    # a second launch over a few of the same slots (decode-style, one token at a time) keeps the neighbours
    x2, _ = _token_quad_case(page + 2, 4, h, d, page, pages)
    s2 = slots[ok][:4].clone()
    want2 = _token_quads_want(cache, x2, s2, page)
    for i in range(4):
        ops.quantize_write(x2[i : i + 1], cache, s2[i : i + 1], layout="token_quads")
    assert torch.equal(cache.packed.cpu(), want2)


def _stale_token_quads(pages: int, h: int, page: int, d: int, seed: int) -> ref.QuantizedRows:
    cache = ops.new_paged_cache(pages, h, page, d, None, torch.float16, DEV, layout="token_quads")
    cache.packed.copy_(torch.randint(0, 256, cache.packed.shape, generator=torch.Generator().manual_seed(seed),
                                     dtype=torch.uint8).to(DEV))  # stale bits everywhere
    return cache


@pytest.mark.unit
@pytest.mark.parametrize("page", [16, 32, 64, 128])
@pytest.mark.parametrize("n", [1, 6])
def test_token_quads_exclusive_and_xor_equal_and_or_and_reference(page: int, n: int) -> None:
    """Decode-shaped writes (one token per sequence, each sequence on its own page; a padding row of slot -1):
    the atomic-free read-modify-write (``exclusive_words``), the load + ``atomic_xor`` and the ``atomic_and`` +
    ``atomic_or`` updates give the same bytes as ``reference.pack_token_quads``, the pages' stale bits of every
    other token kept; a second step (the next token of each sequence, same quads) too."""
    h, d = 2, 64
    pages = n + 2
    gen = torch.Generator().manual_seed(page * 10 + n)
    order = torch.randperm(pages, generator=gen)[:n]  # distinct pages, shuffled
    offs = torch.randint(0, page - 1, (n,), generator=gen)
    slots = (order * page + offs).to(DEV)
    if n > 1:
        slots[n // 2] = -1  # padding / skipped row
    x = _rows(page + n, 1, n, h, d, torch.float16)[0]
    caches = {key: _stale_token_quads(pages, h, page, d, page + n) for key in ("exclusive", "xor", "and_or")}
    want = _token_quads_want(caches["xor"], x, slots, page)
    ops.quantize_write(x, caches["exclusive"], slots, layout="token_quads", exclusive_words=True)
    ops.quantize_write(x, caches["xor"], slots, layout="token_quads", tq_update="xor")
    ops.quantize_write(x, caches["and_or"], slots, layout="token_quads", tq_update="and_or")
    for key, cache in caches.items():
        got = cache.packed.cpu()
        assert torch.equal(got, want), f"{key}: {int((got != want).sum())} bytes differ"
    nxt = torch.where(slots >= 0, slots + 1, slots)  # the next position: the same word
    x2 = _rows(page + n + 1, 1, n, h, d, torch.float16)[0]
    want2 = _token_quads_want(caches["xor"], x2, nxt, page)
    ops.quantize_write(x2, caches["exclusive"], nxt, layout="token_quads", exclusive_words=True, block_t=1)
    ops.quantize_write(x2, caches["xor"], nxt, layout="token_quads", block_t=1)
    ops.quantize_write(x2, caches["and_or"], nxt, layout="token_quads", tq_update="and_or", block_t=1)
    for key, cache in caches.items():
        assert torch.equal(cache.packed.cpu(), want2), key


@pytest.mark.unit
@pytest.mark.parametrize("page", [16, 32, 64, 128])
@pytest.mark.parametrize("tq_update", ["xor", "and_or"])
@pytest.mark.parametrize("block_t", [1, 16])
def test_token_quads_shared_words_in_one_launch(page: int, tq_update: str, block_t: int) -> None:
    """The shared-word updates: every token of a 16-token word (4 quads) and a few scattered tokens written in one launch,
    in shuffled order, by one program (block 16) or one per row (block 1), over stale bits: reference bytes."""
    h, d, pages = 2, 64, 2
    gen = torch.Generator().manual_seed(page + block_t)
    # one whole 16-token word group of page 1 (its 4 quads), and 5 scattered tokens of page 0 (partial quads)
    whole = torch.arange(16) + page + (page // 2 // 16) * 16
    part = torch.randperm(page, generator=gen)[:5]
    slots = torch.cat([whole, part, torch.tensor([-1])])[torch.randperm(22, generator=gen)].to(DEV)
    x = _rows(page + 7, 1, 22, h, d, torch.float16)[0]
    cache = _stale_token_quads(pages, h, page, d, page)
    want = _token_quads_want(cache, x, slots, page)
    ops.quantize_write(x, cache, slots, layout="token_quads", tq_update=tq_update, block_t=block_t)
    got = cache.packed.cpu()
    assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ"


@pytest.mark.unit
def test_token_quads_cache_shape_and_refusals() -> None:
    c = ops.new_paged_cache(2, 3, 64, 128, None, torch.bfloat16, DEV, layout="token_quads")
    assert c.packed.shape == (2, 3, 128, 16) and c.scale.shape == (2, 3, 64, 1)
    c = ops.new_paged_cache(2, 3, 256, 128, None, torch.bfloat16, DEV, layout="token_quads")  # 4 rows of 64 tokens
    assert c.packed.shape == (2, 3, 4 * 128, 16) and c.scale.shape == (2, 3, 256, 1)
    for bad in (8, 96):
        with pytest.raises(ValueError, match="multiple of 16"):
            ops.new_paged_cache(2, 3, bad, 128, None, torch.bfloat16, DEV, layout="token_quads")
    with pytest.raises(ValueError, match="layout: expected one of"):
        ops.new_paged_cache(2, 3, 64, 128, None, torch.bfloat16, DEV, layout="cols")
    x = torch.zeros(1, 3, 128, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match=r"tq_update: expected one of \('xor', 'and_or'\), got 'cas'"):
        ops.quantize_write(x, c, torch.zeros(1, dtype=torch.int64, device=DEV), layout="token_quads", tq_update="cas")
    with pytest.raises(ValueError, match=r"cache.packed: expected token-quad pages"):
        ops.quantize_write(x, ops.new_paged_cache(2, 3, 64, 128, device=DEV), torch.zeros(1, dtype=torch.int64,
                                                                                            device=DEV),
                           layout="token_quads")


@pytest.mark.unit
def test_quantize_bad_inputs_name_the_tensor() -> None:
    cache = ops.new_paged_cache(2, 2, 16, 64, None, torch.bfloat16, DEV)
    x = torch.zeros(3, 2, 64, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match=r"slots: expected int64 \[3\]"):
        ops.quantize_write(x, cache, torch.zeros(3, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match=r"x: expected .*got torch.float16 \(3, 2, 60\)"):
        ops.quantize_write(x[..., :60], cache, torch.zeros(3, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match=r"rotation: expected float32"):
        ops.quantize_write(x, cache, torch.zeros(3, dtype=torch.int64, device=DEV), rotation=torch.eye(64, dtype=torch.float64, device=DEV))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="requires CUDA")
@pytest.mark.parametrize(
    ("clip", "meta", "d", "dtype"),
    [(0.0, torch.bfloat16, 128, torch.bfloat16), (0.96, torch.bfloat16, 128, torch.bfloat16),
     (0.92, torch.float16, 64, torch.float16), (0.96, torch.float32, 128, torch.float16),
     (0.92, torch.bfloat16, 64, torch.bfloat16), (0.92, torch.uint8, 64, torch.bfloat16),
     (0.96, torch.uint8, 128, torch.bfloat16)],
    ids=["noclip-bf16", "clip96-bf16", "clip92-fp16-D64", "clip96-fp32m", "clip92-bf16-D64", "clip92-meta8-D64",
         "clip96-meta8"])
def test_quantize_gpu_grid(clip: float, meta: torch.dtype, d: int, dtype: torch.dtype) -> None:
    x = _rows(int(clip * 100) + d, 2, 8, 4097, d, dtype)
    mean = torch.randn(8, d, device=DEV) * 0.2
    _assert_same(ops.quantize_rows(x, None, mean, clip, None, meta), _ref_cpu(x, None, mean, clip, None, meta))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="requires CUDA")
@pytest.mark.parametrize("page", [16, 64, 128])
@pytest.mark.parametrize("block_t", [1, 16])
def test_token_quads_updates_concurrent_on_gpu(page: int, block_t: int) -> None:
    """Concurrent programs on the GPU: 2048 consecutive slots (every word written by 16 rows, of up to 16
    programs) by ``xor`` and ``and_or``, and 512 decode slots (one per page) by all three updates, over stale
    bytes, 8 heads of D = 128: the reference's bytes."""
    h, d, pages = 8, 128, 512
    cache = _stale_token_quads(pages, h, page, d, page)
    stale = cache.packed.clone()
    gen = torch.Generator().manual_seed(page + block_t)
    dense = torch.arange(2048, dtype=torch.int64) + page
    dense = dense[torch.randperm(2048, generator=gen)].to(DEV)
    decode = (torch.randperm(pages, generator=gen) * page + torch.randint(0, page, (pages,), generator=gen)).to(DEV)
    for slots, updates in ((dense, ("xor", "and_or")), (decode, ("xor", "and_or", "exclusive"))):
        x = _rows(int(slots.shape[0]) + page, 1, int(slots.shape[0]), h, d, torch.float16)[0]
        want = _token_quads_want(cache, x, slots, page)
        for update in updates:
            cache.packed.copy_(stale)
            ops.quantize_write(x, cache, slots, layout="token_quads", block_t=block_t,
                               exclusive_words=update == "exclusive", tq_update="and_or" if update == "and_or" else "xor")
            got = cache.packed.cpu()
            assert torch.equal(got, want), f"{update}: {int((got != want).sum())} bytes differ"
        cache.packed.copy_(stale)


# --- clip threshold: bit-pattern select (default) vs tl.sort vs the reference, block sizes from N ---------------

def _awkward_row(kind: str, d: int, idx: int, gen: torch.Generator) -> torch.Tensor:
    """One float32 row of ``d`` values whose sorted magnitudes are awkward around ``idx`` (the clip index)."""
    m = torch.rand(d, generator=gen).mul(2.0).add(0.25).sort().values  # distinct magnitudes, ascending
    if kind == "tie-straddle":  # equal magnitudes over idx-3 .. idx+3 of the sorted order
        m[max(idx - 3, 0): idx + 4] = 1.5
        m[idx + 4:] += 2.0
    elif kind == "tie-starts-at-idx":
        m[idx: idx + 5] = 1.25
        m[idx + 5:] += 2.0
    elif kind == "tie-ends-at-idx":
        m[max(idx - 4, 0): idx + 1] = 1.25
        m[idx + 1:] += 2.0
    elif kind == "all-equal":
        m[:] = 0.75
    elif kind == "zeros":
        m[:] = 0.0
    elif kind == "signed-zeros":  # zeros below and at idx: tau = +0.0 although the row holds -0.0
        m[: idx + 1] = 0.0
    elif kind == "wide-range":  # magnitudes over 1e-30 .. 1e30: every exponent bit matters
        m = torch.logspace(-30, 30, d).to(torch.float32)
    elif kind != "distinct":
        raise AssertionError(kind)
    sign = torch.where(torch.rand(d, generator=gen) < 0.5, -1.0, 1.0)
    row = m * sign  # a zero times -1 is -0.0: both signs of zero
    return row[torch.randperm(d, generator=gen)]


def _awkward_x(kind: str, n: int, h: int, d: int, ratio: float, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    idx = min(int(ratio * d), d - 1)
    x = torch.stack([_awkward_row(kind, d, idx, gen) for _ in range(n * h)]).reshape(n, h, d)
    assert x.to(dtype).float().isfinite().all()
    return x.to(dtype).to(DEV)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns (so -0.0 != +0.0): uint8 stays, floats are viewed as same-width integers."""
    t = t.cpu().contiguous()
    return t if t.dtype == torch.uint8 else t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _write(x: torch.Tensor, ratio: float, g: int | None, meta: torch.dtype, layout: str, method: str,
           block_t: int | None, slots: torch.Tensor, pages: int, page: int) -> ref.QuantizedRows:
    cache = ops.new_paged_cache(pages, int(x.shape[1]), page, int(x.shape[2]), g, meta, DEV, layout=layout)
    ops.quantize_write(x, cache, slots, clip_ratio=ratio, layout=layout, clip_method=method, block_t=block_t)
    return cache


def _want_cache(x: torch.Tensor, ratio: float, g: int | None, meta: torch.dtype, layout: str, slots: torch.Tensor,
                pages: int, page: int) -> ref.QuantizedRows:
    """The reference's rows scattered into an empty paged cache of ``layout``."""
    n, h, d = (int(s) for s in x.shape)
    want = ref.quantize_rows(x.cpu().permute(1, 0, 2)[None], None, None, ratio, g, meta)  # [1, H, N, ...]
    s = slots.cpu()
    empty = ops.new_paged_cache(pages, h, page, d, g, meta, "cpu")
    scale, zero = empty.scale.clone(), empty.zero.clone()
    scale[s // page, :, s % page] = want.scale[0].permute(1, 0, 2)
    zero[s // page, :, s % page] = want.zero[0].permute(1, 0, 2)
    codes = torch.zeros(pages, h, page, d, dtype=torch.uint8)
    codes[s // page, :, s % page] = ref.unpack_int2(want.packed[0]).permute(1, 0, 2)
    packed = ref.pack_token_quads(codes, ref.token_quad_row(page)) if layout == "token_quads" else ref.pack_int2(codes)
    return ref.QuantizedRows(packed, scale, zero)


def _assert_bits(got: ref.QuantizedRows, want: ref.QuantizedRows, what: str) -> None:
    for name in ("packed", "scale", "zero"):
        a, b = _bits(getattr(got, name)), _bits(getattr(want, name))
        assert a.shape == b.shape, f"{what} {name}: {tuple(a.shape)} vs {tuple(b.shape)}"
        bad = (a != b).nonzero()
        assert bad.numel() == 0, f"{what} {name}: {bad.shape[0]} mismatches, first at {bad[0].tolist()}"


CLIP_CASES = [
    # id, row kind, N, D, G, ratio, layout, x dtype, meta dtype, block_t (None: from N)
    ("tie-straddle-N1-rows-bf16", "tie-straddle", 1, 128, None, 0.96, "rows", torch.bfloat16, torch.bfloat16, None),
    ("tie-straddle-N1-tq-bf16", "tie-straddle", 1, 128, None, 0.96, "token_quads", torch.bfloat16, torch.bfloat16,
     None),
    ("tie-starts-at-idx-N3-D64-fp32m", "tie-starts-at-idx", 3, 64, None, 0.75, "rows", torch.float16, torch.float32,
     None),
    ("tie-ends-at-idx-N3-D64-tq", "tie-ends-at-idx", 3, 64, None, 0.75, "token_quads", torch.float32, torch.float32,
     None),
    ("all-equal-N17-G32", "all-equal", 17, 128, 32, 0.96, "rows", torch.float16, torch.bfloat16, None),
    ("zeros-N3-tq", "zeros", 3, 64, None, 0.92, "token_quads", torch.bfloat16, torch.bfloat16, None),
    ("signed-zeros-N3-fp32m", "signed-zeros", 3, 64, 16, 0.5, "rows", torch.float32, torch.float32, None),
    ("idx0-N1-D64", "distinct", 1, 64, None, 0.001, "rows", torch.float32, torch.float32, None),
    ("idx0-ties-N3-tq", "tie-ends-at-idx", 3, 128, 64, 0.001, "token_quads", torch.float16, torch.float16, None),
    ("idxlast-N3-D128", "tie-starts-at-idx", 3, 128, None, 1.0, "rows", torch.bfloat16, torch.float32, None),
    ("wide-range-N17-fp32", "wide-range", 17, 64, 32, 0.9, "token_quads", torch.float32, torch.float32, None),
    ("distinct-N33-rows", "distinct", 33, 64, None, 0.96, "rows", torch.float16, torch.bfloat16, None),
    ("distinct-N33-tq-block2", "distinct", 33, 64, 32, 0.96, "token_quads", torch.bfloat16, torch.bfloat16, 2),
    ("tie-straddle-N17-block8", "tie-straddle", 17, 128, None, 0.96, "rows", torch.float32, torch.bfloat16, 8),
]


@pytest.mark.unit
@pytest.mark.parametrize("case", CLIP_CASES, ids=[c[0] for c in CLIP_CASES])
def test_clip_select_equals_sort_and_reference(case: tuple) -> None:
    """The select threshold is exactly ``sort(|y|)[clip_idx]``: select == sort == reference, bit for bit (codes,
    scale, zero, packed bytes; -0.0 told from +0.0), with ties at, across and ending at the clip index, zero rows,
    mixed signed zeros, clip_idx 0 and D-1, both layouts and block sizes from N (1, 4, 16) or given."""
    name, kind, n, d, g, ratio, layout, dtype, meta, block_t = case
    page = 16
    pages = (n + page - 1) // page + 1
    x = _awkward_x(kind, n, 2 if n < 8 else 1, d, ratio, dtype, len(name))  # 1 head at large N: interpreter time
    slots = torch.randperm(pages * page, generator=torch.Generator().manual_seed(n))[:n].to(DEV)
    sel = _write(x, ratio, g, meta, layout, "select", block_t, slots, pages, page)
    srt = _write(x, ratio, g, meta, layout, "sort", block_t, slots, pages, page)
    _assert_bits(sel, srt, "select vs sort")
    _assert_bits(sel, _want_cache(x, ratio, g, meta, layout, slots, pages, page), "select vs reference")


@pytest.mark.unit
@pytest.mark.parametrize("block_t", [1, 2, 4, 8, 16, 32], ids=lambda b: f"block{b}")
def test_quantize_write_any_block_size_same_bytes(block_t: int) -> None:
    """Every power-of-two block gives the bytes of the reference (N = 5: partial last blocks, and blocks past N)."""
    x = _awkward_x("tie-straddle", 5, 2, 64, 0.92, torch.bfloat16, 7)
    slots = torch.randperm(32, generator=torch.Generator().manual_seed(1))[:5].to(DEV)
    got = _write(x, 0.92, None, torch.bfloat16, "rows", "select", block_t, slots, 2, 16)
    _assert_bits(got, _want_cache(x, 0.92, None, torch.bfloat16, "rows", slots, 2, 16), f"block_t={block_t}")


@pytest.mark.unit
def test_auto_block_t_and_refusals() -> None:
    from oscar_kernels.write_ops import auto_block_t

    assert [auto_block_t(n, False) for n in (1, 2, 3, 5, 8, 9, 16, 17, 512)] == [1, 2, 4, 8, 8, 16, 16, 16, 16]
    assert auto_block_t(1, True) == 16
    cache = ops.new_paged_cache(1, 1, 16, 64, None, torch.bfloat16, DEV)
    x = torch.zeros(1, 1, 64, dtype=torch.bfloat16, device=DEV)
    slots = torch.zeros(1, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match=r"clip_method: expected one of \('select', 'sort'\), got 'radix'"):
        ops.quantize_write(x, cache, slots, clip_ratio=0.9, clip_method="radix")
    for bad in (0, 3, 12):
        with pytest.raises(ValueError, match="block_t: expected a power of two"):
            ops.quantize_write(x, cache, slots, block_t=bad)
    with pytest.raises(ValueError, match=r"block_t: expected a power of two \(>= 16 with a rotation\), got 8"):
        ops.quantize_write(x, cache, slots, rotation=torch.eye(64, device=DEV), block_t=8)


@pytest.mark.unit
@given(data=st.data())
@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
def test_clip_select_equals_sort_property(data: st.DataObject) -> None:
    """Rows of few distinct magnitudes (ties everywhere, signed zeros) and any ratio: select == sort == reference."""
    d = data.draw(st.sampled_from([64, 128]), label="D")
    n = data.draw(st.integers(1, 4), label="N")
    ratio = data.draw(st.floats(0.0005, 1.0), label="ratio")
    halves = data.draw(st.lists(st.integers(-6, 6), min_size=n * d, max_size=n * d), label="values/2")
    x = (torch.tensor(halves, dtype=torch.float32) * 0.5).reshape(n, 1, d)
    x = torch.where(x == 0, torch.where(torch.arange(n * d).reshape(n, 1, d) % 3 == 0, -0.0, 0.0), x).to(DEV)
    slots = torch.arange(n, dtype=torch.int64, device=DEV)
    sel = _write(x, ratio, None, torch.float32, "rows", "select", None, slots, 1, 16)
    srt = _write(x, ratio, None, torch.float32, "rows", "sort", None, slots, 1, 16)
    _assert_bits(sel, srt, "select vs sort")
    _assert_bits(sel, _want_cache(x, ratio, None, torch.float32, "rows", slots, 1, 16), "select vs reference")


@pytest.mark.unit
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), log_mag=st.sampled_from([-24, -12, -3, 0, 5, 14, 18]),
       offset=st.sampled_from([0.0, 0.5, 3.0, 40.0]), clip=st.sampled_from([0.0, 0.92]),
       d=st.sampled_from([64, 128]))
def test_quantize_meta8_bitwise_at_every_magnitude(seed: int, log_mag: int, offset: float, clip: float, d: int) -> None:
    """Formula 10 in the write kernel, bitwise the reference's, across its branches: steps below ``2^-16`` (byte 0)
    and above 61440 (byte 255), rows off centre whose step widens so the zero fits, clipped and unclipped rows."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, 2, 7, d, generator=gen) + offset) * 2.0**log_mag
    x[0, 1, 3] = 0.0  # a zero row: the smallest step
    got = ops.quantize_rows(x.to(DEV), None, None, clip, None, torch.uint8)
    _assert_same(got, _ref_cpu(x, None, None, clip, None, torch.uint8))


INT4_CASES = [
    # id, D, meta dtype, mean form (None, per head, per row), magnitude
    ("D64-bf16meta-no-mean", 64, torch.bfloat16, None, 1.0),
    ("D128-fp16meta-head-mean", 128, torch.float16, "head", 1.0),
    ("D128-meta8-row-mean", 128, torch.uint8, "row", 1.0),
    ("D64-meta8-head-mean-large", 64, torch.uint8, "head", 2.0**14),
    ("D128-fp32meta-row-mean-tiny", 128, torch.float32, "row", 2.0**-20),
]


@pytest.mark.unit
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # masked rows of the last tile (never stored)
@pytest.mark.parametrize("case", INT4_CASES, ids=[c[0] for c in INT4_CASES])
def test_quantize_write_int4_planes_bitwise(case: tuple) -> None:
    """INT4 keys (``low_plane``): the high plane, scale and zero into the pages and the low plane into an array of
    the codes' layout, bitwise ``reference.quantize_rows_int4`` on the centred rows (16-bit and formula 10's 8-bit
    metadata, a mean per head or per row); skipped rows (slot -1) and every other slot keep their bytes."""
    name, d, meta, mean_form, mag = case
    n, h, page, pages = 19, 2, 16, 3
    x = _rows(len(name), 1, n, h, d, torch.float16)[0].float() * mag  # [N, H_kv, D]
    gen = torch.Generator().manual_seed(d + n)
    mean = None if mean_form is None else (torch.randn(*((n,) if mean_form == "row" else ()), h, d, generator=gen)
                                           * mag).to(DEV)
    slots = torch.randperm(pages * page, generator=gen)[:n].to(DEV)
    slots[4] = -1
    cache = ops.new_paged_cache(pages, h, page, d, None, meta, DEV)
    cache.packed.fill_(0xAB)
    low = torch.full_like(cache.packed, 0xCD)
    ops.quantize_write(x, cache, slots, mean=mean, low_plane=low)
    ok = (slots >= 0).cpu()
    centred = x.cpu() if mean is None else x.cpu() - mean.cpu()
    want, want_lo = ref.quantize_rows_int4(centred.transpose(0, 1), None, None, None, meta)  # [H, N, ...]
    s = slots.cpu()[ok]
    for got, exp in ((cache.packed, want.packed), (cache.scale, want.scale), (cache.zero, want.zero), (low, want_lo)):
        assert torch.equal(got.cpu()[s // page, :, s % page], exp.transpose(0, 1)[ok])
    untouched = torch.ones(pages * page, dtype=torch.bool)
    untouched[s] = False
    for arr, fill in ((cache.packed, 0xAB), (low, 0xCD)):
        flat = arr.cpu().permute(0, 2, 1, 3).reshape(pages * page, h, d // 4)
        assert (flat[untouched] == fill).all()


@pytest.mark.unit
def test_quantize_write_int4_refusals() -> None:
    """A low plane needs the rows layout, no clip, and the codes' shape and strides."""
    x = _rows(1, 1, 4, 2, 64, torch.float16)[0]
    slots = torch.arange(4, dtype=torch.int64, device=DEV)
    cache = ops.new_paged_cache(1, 2, 16, 64, None, torch.bfloat16, DEV)
    low = torch.zeros_like(cache.packed)
    with pytest.raises(ValueError, match="without a clip"):
        ops.quantize_write(x, cache, slots, clip_ratio=0.9, low_plane=low)
    with pytest.raises(ValueError, match="low_plane"):
        ops.quantize_write(x, cache, slots, low_plane=low[:, :1])
    tq = ops.new_paged_cache(1, 2, 16, 64, None, torch.bfloat16, DEV, layout="token_quads")
    with pytest.raises(ValueError, match="rows layout"):
        ops.quantize_write(x, tq, slots, layout="token_quads", low_plane=torch.zeros_like(tq.packed))
