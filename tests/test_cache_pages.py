"""The paged INT2 cache against a dense reference built from ``oscar_kernels.reference``; its memory and per-step work.

The dense reference does not use the cache: it quantizes every token's rotated row on its own (per-token INT2 is
independent of when a token is demoted), and decides each slot's tier from docs/METHOD.md §7's rules (sink = slots
``[0, S0 + max_pad)``, recent = the last ``r`` slots where ``r`` follows the chunk/decode rules, the rest INT2).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.utils._pytree as pytree
from helpers.calib import random_transform
from helpers.layers import chunked, dense_reference, run_layer
from torch.utils._python_dispatch import TorchDispatchMode

from oscar_cli.quant import LayerTransform, int2_layer, oscar_method
from oscar_cli.quant.int2_layer import Int2Layer
from oscar_cli.quant.methods import QuantMethod
from oscar_kernels.reference import rotate

pytestmark = pytest.mark.unit


CASES = [
    # id, lengths of the rows (left-padded to the longest), sink, recent, chunk, H_kv, rotations per head, page
    ("single-1", [1], 8, 16, 64, 2, 1, 16),
    ("single-7", [7], 8, 16, 64, 2, 2, 16),
    ("single-63", [63], 8, 16, 32, 1, 1, 64),
    ("single-64", [64], 8, 16, 64, 2, 1, 16),
    ("single-65", [65], 8, 16, 64, 2, 2, 64),
    ("single-257", [257], 64, 32, 100, 2, 1, 16),
    ("single-1000", [1000], 64, 256, 300, 2, 2, 64),
    ("batch-ragged", [1000, 257, 65, 7, 1], 16, 32, 256, 2, 1, 16),
    ("batch-no-windows", [65, 64, 63, 1], 0, 0, 40, 2, 1, 16),
    ("batch-no-sink", [257, 7], 0, 24, 64, 1, 1, 16),
]


@pytest.mark.parametrize("piece", [None, 24], ids=["piece-default", "piece-24"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cache_equals_dense_reference(case: tuple, piece: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every prefill chunk and decode step returns bitwise what the dense reference computes (valid slots), also
    when writes and reads go in pieces of 24 tokens (not a multiple of a token quad's 4 or of a page)."""
    if piece is not None:
        monkeypatch.setattr(int2_layer, "PIECE", piece)
    _, lengths, sink, recent, chunk, h, n_rot, page = case
    d, b, total, decode = 16, len(lengths), max(lengths), 21
    t = random_transform(len(lengths) + sink, n_rot, clip=0.9, d=d)
    meth = oscar_method([t], sink=sink, recent=recent)
    g = torch.Generator().manual_seed(total)
    k = torch.randn(b, h, total + decode, d, generator=g).bfloat16()
    v = torch.randn(b, h, total + decode, d, generator=g).bfloat16()
    pads = [total - n for n in lengths]
    chunks = chunked(total, chunk)
    got = run_layer(Int2Layer(meth, t, rotate_values=True, page_size=page), k, v, pads, chunks, decode)
    want = dense_reference(meth, t, k, v, pads, chunks, decode)
    assert len(got) == len(want)
    valid = torch.arange(total + decode)[None, :] >= torch.tensor(pads)[:, None]  # [B, T]: pads are masked
    for i, ((gk, gv), (wk, wv)) in enumerate(zip(got, want, strict=True)):
        assert gk.shape == wk.shape, f"update {i}"
        m = valid[:, None, : gk.shape[2], None].expand_as(gk)
        assert torch.equal(gk[m], wk[m]) and torch.equal(gv[m], wv[m]), f"update {i}"


def formula_bytes(meth: QuantMethod, length: int, b: int, h: int, d: int, page: int, act_bytes: int = 2) -> int:
    """DESIGN.md's KV bytes for ``length`` tokens (K and V): BF16 sink + recent window, INT2 history with 16-bit
    scale/zero rounded up to whole pages."""
    dense = min(length, meth.sink + meth.recent)
    hist = length - dense
    md = torch.finfo(meth.meta_dtype).bits // 8
    per_hist = d // 4 + 2 * (d // (meth.group_size or d)) * md
    return 2 * b * h * (dense * d * act_bytes + math.ceil(hist / page) * page * per_hist)


def test_allocated_bytes_follow_the_formula_over_10000_decode_steps() -> None:
    """KV bytes actually allocated (every tensor the layer holds) stay within 5 % of the formula, every step."""
    b, h, d, page = 1, 2, 128, 64
    meth = oscar_method([LayerTransform()], sink=64, recent=256)
    layer = Int2Layer(meth, LayerTransform(), page_size=page)
    g = torch.Generator().manual_seed(0)
    layer.append(*(torch.randn(2, b, h, 1000, d, generator=g).bfloat16()))
    one = torch.randn(b, h, 1, d, generator=g).bfloat16()
    worst = 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny ops: thread hand-offs would dominate on a busy machine
    try:
        for step in range(10_000):
            layer.append(one, one)
            if step % 50 == 0 or step == 9_999:
                length = layer.get_seq_length()
                ratio = layer.allocated_bytes() / formula_bytes(meth, length, b, h, d, page)
                worst = max(worst, abs(ratio - 1))
    finally:
        torch.set_num_threads(threads)
    assert worst < 0.05, worst
    assert layer.get_seq_length() == 11_000 and layer.pool is not None
    assert layer.pool.copied <= 32 * layer.pool.used  # growth is amortized: ~32 page copies per page handed out


class AllocationCounter(TorchDispatchMode):
    """Bytes of the new storages every aten op creates (outputs that share no input's storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for o in pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs:
                n = o.untyped_storage().nbytes()
                self.bytes += n
                self.largest = max(self.largest, n)
        return out


def step_allocations(history: int, steps: int) -> tuple[set[int], int, int]:
    """(bytes allocated per step, over the steps without pool growth; the largest allocation; growths)."""
    b, h, d = 2, 2, 64
    meth = oscar_method([LayerTransform()], sink=64, recent=256)
    layer = Int2Layer(meth, LayerTransform())
    g = torch.Generator().manual_seed(1)
    layer.append(*(torch.randn(2, b, h, history, d, generator=g).bfloat16()))
    one = torch.randn(b, h, 1, d, generator=g).bfloat16()
    assert layer.pool is not None
    per_step: set[int] = set()
    largest = grown = 0
    for _ in range(steps):
        before = (layer.pool.grows, layer.pool.table.shape[1])
        with AllocationCounter() as c:
            layer.append(one, one)
        if (layer.pool.grows, layer.pool.table.shape[1]) != before:
            grown += 1
            continue
        largest = max(largest, c.largest)
        per_step.add(c.bytes)
    return per_step, largest, grown


def test_decode_step_allocations_do_not_grow_with_the_history() -> None:
    """Storing a decode step allocates the same bytes at 1K and 16K tokens of history (no O(T) copy); the pool
    grows rarely (amortized), never per step."""
    small = step_allocations(1024, 160)
    large = step_allocations(16384, 160)
    assert large[0] == small[0] and large[1] == small[1], (small, large)
    assert large[1] <= 2 * 2 * (256 + 8) * 64 * 2  # at most the recent window (the shift after a demotion)
    assert large[2] <= 1 and small[2] <= 3


@pytest.mark.parametrize("piece", [None, 24], ids=["piece-default", "piece-24"])
def test_kernel_path_equals_dense_reference(piece: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton path (quantize_write + paged decode_attention; on CPU the interpreter) against the dense
    reference's attention: ragged batch, GQA, a sink, and W = 0 (the new token demoted on arrival); the prefill
    written in one piece or in pieces of 24 tokens."""
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs CUDA or the Triton interpreter (conftest sets it on CPU-only machines)")
    if piece is not None:
        monkeypatch.setattr(int2_layer, "PIECE", piece)
    from oscar_kernels.reference import attention_partial

    h_q, h, d = 4, 2, 64
    steps = 0
    for lengths, sink, recent in (([120, 97, 90], 8, 16), ([40, 33], 0, 0)):
        t = random_transform(3, 1, clip=0.0, d=d)  # no clip: the interpreter's tl.sort takes minutes
        meth = oscar_method([t], sink=sink, recent=recent)
        b, total, decode = len(lengths), max(lengths), 3
        g = torch.Generator().manual_seed(7)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        k = torch.randn(b, h, total + decode, d, generator=g).half().to(dev)
        v = torch.randn(b, h, total + decode, d, generator=g).half().to(dev)
        pads = [total - n for n in lengths]
        layer = Int2Layer(meth, t, rotate_values=True, backend="triton", page_size=16)
        want = dense_reference(meth, t, k, v, pads, [total], decode)
        run_layer(layer, k, v, pads, [total], 0)
        for i in range(decode):
            s = total + i
            q = torch.randn(b, h_q, 1, d, generator=g).half().to(dev)
            kn, vn = layer.update(k[..., s : s + 1, :], v[..., s : s + 1, :])
            assert layer.kernel_step and kn.shape[2] == 1
            out = layer.kernel_attention(q, kn, vn, d**-0.5).float()  # rotated value space (+ mu_V)
            wk, wv = want[1 + i]
            mask = (torch.arange(s + 1)[None, :] >= torch.tensor(pads)[:, None])[:, None, None, :].to(dev)
            qr = rotate(q, t.k_rotation[0].to(dev)).float()
            ref, _ = attention_partial(qr, wk.float(), wv.float(), d**-0.5, mask)
            err = (out - ref).abs().max().item()
            assert err < 2e-2 * max(1.0, ref.abs().max().item()), (lengths, i, err)
            steps += 1
    assert steps == 6
