"""The position-dependent key mean's logit term (``ops.rope_mean_logits``, Triton) vs its float64 spec
(``reference.rope_mean_logits``), and the launcher's refusals.

Criterion: every entry within ``8·eps32`` of the term's absolute sum ``sm_scale·a·Σ_k |q_k||m_k|`` (over both
halves) of the float64 reference: the kernel's float32 tables (from float64 angles), its two angle additions and a
float32-accurate product each cost a few float32 roundings of terms of that size. Slots past a row's length keep what
``out`` held. CPU runs use the Triton interpreter; ``-m gpu`` runs the same cases on CUDA (tf32x3 products) and a
serving-sized one.
"""

from __future__ import annotations

import pytest
import torch

from oscar_kernels import ops
from oscar_kernels import reference as ref
from oscar_kernels.rope_ops import FINE

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
EPS32 = float(torch.finfo(torch.float32).eps)


def _inv_freq(d: int, base: float = 1_000_000.0) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)


def _case(seed: int, b: int, h_q: int, h_kv: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, h_q, d, generator=g) * 3.0).to(dtype)
    m = torch.randn(h_kv, d, generator=g) * torch.exp2(torch.linspace(-4, 4, d))  # a few large channels, like k_proj biases
    return q.to(DEV), m.to(DEV)


def _check(got: torch.Tensor, q: torch.Tensor, m: torch.Tensor, inv: torch.Tensor, scaling: float,
           pos0: list[int], lengths: list[int], sm_scale: float, fill: float) -> None:
    h_q, h_kv = q.shape[1], m.shape[0]
    mm = m.double().abs().repeat_interleave(h_q // h_kv, dim=0)  # [H_q, D]
    size = sm_scale * scaling * (q.double().abs() * mm).sum(-1)  # [B, H_q]
    for i, (p0, n) in enumerate(zip(pos0, lengths, strict=True)):
        pos = torch.arange(p0, p0 + n, dtype=torch.int64)[None]
        want = ref.rope_mean_logits(q[i : i + 1].cpu(), m.cpu(), inv, scaling, pos, sm_scale)[0]  # [H_q, n]
        err = (got[i, :, :n].double().cpu() - want).abs()
        tol = 8 * EPS32 * size[i].cpu()[:, None]
        assert bool((err <= tol).all()), f"row {i}: max err {float(err.max()):.3g}, tol {float(tol.min()):.3g}"
        assert bool((got[i, :, n:] == fill).all()), f"row {i}: slots past the length were written"


@pytest.mark.parametrize("d", [64, 128], ids=["D64", "D128"])
@pytest.mark.parametrize("h_q,h_kv", [(4, 4), (6, 2), (12, 2)], ids=["g1", "g3", "g6"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_rope_mean_logits_match_the_float64_spec(d: int, h_q: int, h_kv: int, dtype: torch.dtype) -> None:
    """Ragged rows (one empty), history starts far out (past 128K, on and off a coarse row) and near 0."""
    q, m = _case(d + h_q, 3 if d == 64 else 4, h_q, h_kv, d, dtype)
    pos0 = [0, 131_071, FINE * 9, 37][: q.shape[0]]
    lengths = [70, 33, 0, 129][: q.shape[0]]
    inv, scaling, sm = _inv_freq(d), 1.0, d ** -0.5
    tables = ops.rope_tables(inv, scaling, max(p + n for p, n in zip(pos0, lengths, strict=True)), DEV)
    out = torch.full((q.shape[0], h_q, 160), -7.0, device=DEV)
    got = ops.rope_mean_logits(q, m, tables, torch.tensor(pos0, dtype=torch.int32, device=DEV),
                               torch.tensor(lengths, dtype=torch.int32, device=DEV), sm, out=out, block=32)
    assert got is out
    _check(got, q, m, inv, scaling, pos0, lengths, sm, -7.0)


@pytest.mark.parametrize("block", [16, 64, 128])
@pytest.mark.parametrize("scaling", [1.0, 1.2772588722239781], ids=["plain", "yarn-mscale"])
def test_rope_mean_logits_blocks_and_attention_scaling(block: int, scaling: float) -> None:
    """Any legal block; YaRN's attention scaling multiplies the term (the tables carry plain cos/sin)."""
    q, m = _case(block, 2, 8, 2, 128, torch.bfloat16)
    pos0, lengths = [65_000, 5], [150, 97]
    inv = _inv_freq(128, 10_000.0) / torch.linspace(1.0, 4.0, 64)  # YaRN-like per-channel frequencies
    tables = ops.rope_tables(inv, scaling, 65_200, DEV)
    out = torch.zeros(2, 8, 150, device=DEV)
    got = ops.rope_mean_logits(q, m, tables, torch.tensor(pos0, dtype=torch.int32, device=DEV),
                               torch.tensor(lengths, dtype=torch.int32, device=DEV), 0.088, out=out, block=block)
    _check(got, q, m, inv, scaling, pos0, lengths, 0.088, 0.0)


def test_rope_mean_logits_allocates_the_longest_row_when_no_out_is_given() -> None:
    q, m = _case(1, 2, 2, 1, 64, torch.float32)
    tables = ops.rope_tables(_inv_freq(64), 1.0, 300, DEV)
    got = ops.rope_mean_logits(q, m, tables, torch.tensor([3, 100], dtype=torch.int32, device=DEV),
                               torch.tensor([20, 45], dtype=torch.int32, device=DEV), 0.125)
    assert got.shape == (2, 2, 45) and got.dtype == torch.float32
    _check(got, q, m, _inv_freq(64), 1.0, [3, 100], [20, 45], 0.125, 0.0)


def test_rope_tables_cover_whole_coarse_rows_from_float64_angles() -> None:
    inv = _inv_freq(128)
    t = ops.rope_tables(inv, 1.0, FINE * 3 + 1, "cpu")
    assert t.positions == FINE * 4 and t.coarse.shape == (4, 128) and t.fine.shape == (FINE, 128)
    ang = 3 * FINE * inv.double()
    assert torch.equal(t.coarse[3], torch.cat((torch.cos(ang), torch.sin(ang))).float())


def _args(d: int = 64, h_q: int = 4, h_kv: int = 2) -> dict:
    q, m = _case(0, 2, h_q, h_kv, d, torch.float32)
    return {"q": q, "mean_pre": m, "tables": ops.rope_tables(_inv_freq(d), 1.0, 256, DEV),
            "position0": torch.zeros(2, dtype=torch.int32, device=DEV),
            "hist_len": torch.full((2,), 10, dtype=torch.int32, device=DEV), "sm_scale": 0.125}


@pytest.mark.parametrize("change,match", [
    ({"q": torch.zeros(2, 4, 96)}, "q"),
    ({"q": torch.zeros(2, 4, 64, dtype=torch.float64)}, "q"),
    ({"mean_pre": torch.zeros(3, 64)}, "mean_pre"),
    ({"mean_pre": torch.zeros(2, 64, dtype=torch.float16)}, "mean_pre"),
    ({"position0": torch.zeros(2, dtype=torch.int64)}, "position0"),
    ({"hist_len": torch.zeros(3, dtype=torch.int32)}, "hist_len"),
    ({"out": torch.zeros(2, 4, 16, dtype=torch.bfloat16)}, "out"),
    ({"out": torch.zeros(2, 16, 4).transpose(1, 2)}, "out"),
    ({"block": 24}, "block"),
], ids=["head-dim-96", "q-float64", "kv-heads-not-dividing", "mean-fp16", "position0-int64", "hist-len-batch",
        "out-bf16", "out-strided", "block-not-pow2"])
def test_rope_mean_logits_refuses_bad_arguments(change: dict, match: str) -> None:
    a = _args()
    for k, v in change.items():
        a[k] = v.to(DEV) if isinstance(v, torch.Tensor) else v
    with pytest.raises((ValueError, TypeError), match=match):
        ops.rope_mean_logits(**a)


def test_rope_tables_refuse_bad_frequencies_and_scaling() -> None:
    with pytest.raises(ValueError, match="inv_freq"):
        ops.rope_tables(torch.ones(48), 1.0, 10, "cpu")
    with pytest.raises(ValueError, match="scaling"):
        ops.rope_tables(_inv_freq(64), float("nan"), 10, "cpu")


@pytest.mark.gpu
def test_rope_mean_logits_serving_shape_on_cuda() -> None:
    """Qwen2.5-Coder-1.5B's shape (12 query / 2 KV heads, D 128) at batch 4 up to 128K, the layer's default block."""
    if not CUDA:
        pytest.skip("needs CUDA")
    q, m = _case(5, 4, 12, 2, 128, torch.bfloat16)
    pos0, lengths = [4, 0, 100_000, 17], [131_000, 4096, 31_000, 1]
    tables = ops.rope_tables(_inv_freq(128), 1.0, 131_072, DEV)
    got = ops.rope_mean_logits(q, m, tables, torch.tensor(pos0, dtype=torch.int32, device=DEV),
                               torch.tensor(lengths, dtype=torch.int32, device=DEV), 128 ** -0.5,
                               out=torch.zeros(4, 12, 131_072, device=DEV))
    _check(got, q, m, _inv_freq(128), 1.0, pos0, lengths, 128 ** -0.5, 0.0)
