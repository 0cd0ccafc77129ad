"""The position-dependent key mean's logit term (``ops.rope_mean_logits``: one float32 GEMM over the shared
position table) vs its float64 spec (``reference.rope_mean_logits``), and its refusals.

Criterion: every entry within ``16·eps32`` of the term's absolute sum ``sm_scale·a·Σ_k |q_k||m_k|`` (over both
halves) of the float64 reference: float32 table entries (rounded from float64 angles), ``A``/``B`` in float32 and a
float32 dot of ``D`` terms each cost a few float32 roundings of terms of that size. CPU runs torch's CPU GEMM; ``-m
gpu`` runs cuBLAS (TF32 off for the product, whatever the caller set) on a serving-sized case.
"""

from __future__ import annotations

import pytest
import torch

from oscar_kernels import ops
from oscar_kernels import reference as ref

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
           pos0: list[int], length: int, sm_scale: float, ulps: int = 16) -> None:
    h_q, h_kv = q.shape[1], m.shape[0]
    mm = m.double().abs().repeat_interleave(h_q // h_kv, dim=0)  # [H_q, D]
    size = sm_scale * scaling * (q.double().abs() * mm).sum(-1)  # [B, H_q]
    for i, p0 in enumerate(pos0):
        pos = torch.arange(p0, p0 + length, dtype=torch.int64)[None]
        want = ref.rope_mean_logits(q[i : i + 1].cpu(), m.cpu(), inv, scaling, pos, sm_scale)[0]  # [H_q, L]
        err = (got[i].double().cpu() - want).abs()
        tol = ulps * EPS32 * size[i].cpu()[:, None]
        assert bool((err <= tol).all()), f"row {i}: max err {float(err.max()):.3g}, tol {float(tol.min()):.3g}"


@pytest.mark.parametrize("d", [64, 128], ids=["D64", "D128"])
@pytest.mark.parametrize("h_q,h_kv", [(4, 4), (6, 2), (12, 2)], ids=["g1", "g3", "g6"])
@pytest.mark.parametrize("pos0", [[0, 0, 0], [5, 131_000, 5], [131, 0, 4096]], ids=["shared", "two-starts", "three-starts"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rope_mean_logits_match_the_float64_spec(d: int, h_q: int, h_kv: int, pos0: list[int], dtype: torch.dtype) -> None:
    """Rows grouped by their first position (one product for a shared start), histories past 128K and near 0,
    YaRN's attention scaling multiplying the term (the table carries plain cos/sin)."""
    q, m = _case(d + h_q + pos0[1], 3, h_q, h_kv, d, dtype)
    inv, scaling, length = _inv_freq(d), 1.2772588722239781, 300
    table = ops.position_table(inv, max(pos0) + length, DEV)
    got = ops.rope_mean_logits(q, m, table, scaling, pos0, 0.088, torch.empty(3, h_q, length, device=DEV))
    _check(got, q, m, inv, scaling, pos0, length, 0.088)


def test_rope_mean_logits_override_tf32_and_restore_it() -> None:
    """A caller's ``allow_tf32 = True`` does not reach the product (TF32's 10-bit mantissa is too coarse for a term
    of tens of logits) and is restored after it."""
    q, m = _case(1, 2, 8, 2, 128, torch.bfloat16)
    inv = _inv_freq(128, 10_000.0) / torch.linspace(1.0, 4.0, 64)  # YaRN-like per-channel frequencies
    table = ops.position_table(inv, 65_200, DEV)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        got = ops.rope_mean_logits(q, m, table, 1.0, [65_000, 5], 0.088, torch.empty(2, 8, 150, device=DEV))
        assert torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    _check(got, q, m, inv, 1.0, [65_000, 5], 150, 0.088)


def test_position_table_rows_are_float64_angles_rounded_once() -> None:
    inv = _inv_freq(128)
    t = ops.position_table(inv, 70_001, "cpu")
    assert t.shape == (70_001, 128) and t.dtype == torch.float32
    ang = 70_000 * inv.double()
    assert torch.equal(t[70_000], torch.cat((torch.cos(ang), torch.sin(ang))).float())


def _args(d: int = 64, h_q: int = 4, h_kv: int = 2) -> dict:
    q, m = _case(0, 2, h_q, h_kv, d, torch.float32)
    return {"q": q, "mean_pre": m, "table": ops.position_table(_inv_freq(d), 256, DEV), "scaling": 1.0,
            "position0": [0, 3], "sm_scale": 0.125, "out": torch.empty(2, h_q, 100, device=DEV)}


@pytest.mark.parametrize("change,match", [
    ({"mean_pre": torch.zeros(3, 64)}, "mean_pre"),
    ({"mean_pre": torch.zeros(2, 128)}, "mean_pre"),
    ({"out": torch.zeros(2, 4, 16, dtype=torch.bfloat16)}, "out"),
    ({"out": torch.zeros(2, 16, 4).transpose(1, 2)}, "out"),
    ({"position0": [0]}, "position0"),
    ({"position0": [0, 200]}, "table"),
    ({"table": torch.zeros(400, 128)}, "table"),
], ids=["kv-heads-not-dividing", "mean-head-dim", "out-bf16", "out-strided", "one-position-for-two-rows",
        "table-too-short", "table-head-dim"])
def test_rope_mean_logits_refuses_bad_arguments(change: dict, match: str) -> None:
    a = _args()
    for k, v in change.items():
        a[k] = v.to(DEV) if isinstance(v, torch.Tensor) else v
    with pytest.raises((ValueError, TypeError), match=match):
        ops.rope_mean_logits(**a)


def test_position_table_refuses_bad_frequencies() -> None:
    with pytest.raises(ValueError, match="inv_freq"):
        ops.position_table(torch.ones(48), 10, "cpu")


@pytest.mark.gpu
def test_rope_mean_logits_serving_shape_on_cuda() -> None:
    """Qwen2.5-Coder-1.5B's shape (12 query / 2 KV heads, D 128) at batch 4 over 128K slots."""
    if not CUDA:
        pytest.skip("needs CUDA")
    q, m = _case(5, 4, 12, 2, 128, torch.bfloat16)
    pos0 = [64, 64, 0, 17]
    table = ops.position_table(_inv_freq(128), 131_072 + 64, DEV)
    got = ops.rope_mean_logits(q, m, table, 1.0, pos0, 128 ** -0.5, torch.empty(4, 12, 131_072, device=DEV))
    _check(got, q, m, _inv_freq(128), 1.0, pos0, 131_072, 128 ** -0.5)


@pytest.mark.unit
@pytest.mark.parametrize("rotation", ["shared", "per-head", "none"])
@pytest.mark.parametrize("scaling", [1.0, 1.2079], ids=["rope", "yarn-scaling"])
def test_rope_mean_matrix_gives_the_position_means(rotation: str, scaling: float) -> None:
    """``table[p] @ rope_mean_matrix(m_pre, R, a)`` is ``position_means`` (RoPE of the pre-RoPE mean scaled by ``a``,
    then ``R_K``) at positions up to 128K, to float32 rounding; a bad mean or rotation is refused naming it."""
    from oscar_cli.quant.key_mean import position_means
    from oscar_kernels.reference import rope_cos_sin
    from oscar_kernels.rope_ops import rope_mean_matrix

    h, d = 2, 64
    gen = torch.Generator().manual_seed(4)
    m_pre = torch.randn(h, d, generator=gen) * 5
    shape = {"shared": (1, d, d), "per-head": (h, d, d), "none": None}[rotation]
    r = torch.linalg.qr(torch.randn(*shape, generator=gen, dtype=torch.float64))[0].float() if shape else \
        torch.eye(d)[None]
    inv_freq = 1e6 ** -(torch.arange(0, d, 2, dtype=torch.float32) / d)
    pos = torch.tensor([0, 1, 17, 4095, 65_537, 131_071])
    table = ops.position_table(inv_freq, 131_072, "cpu")
    got = torch.einsum("nd,hde->nhe", table[pos], rope_mean_matrix(m_pre, r, scaling))
    cos, sin = rope_cos_sin(inv_freq, scaling, pos[None])
    want = position_means(m_pre, r, cos, sin)[0].transpose(0, 1)
    assert torch.allclose(got, want, rtol=0, atol=2e-6 * float(want.abs().max()))
    with pytest.raises(ValueError, match="mean_pre"):
        rope_mean_matrix(m_pre[:, :63], r)
    with pytest.raises(ValueError, match="rotation"):
        rope_mean_matrix(m_pre, torch.eye(d)[None].expand(3, d, d))
