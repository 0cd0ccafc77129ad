"""Rotation construction against docs/METHOD.md §3 and the §11 invariants 1-5."""

from __future__ import annotations

import pytest
import torch

from oscar_cli.calibration.rotation import (
    baseline_rotation,
    bit_reversal,
    bit_reversal_permutation,
    build_rotations,
    check_orthogonal,
    compose_rotation,
    eigh_ascending,
    hadamard_matrix,
    orthogonality_error,
)
from oscar_cli.errors import CalibrationError

pytestmark = pytest.mark.unit


def _random_psd(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(4 * d, d, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3.0, d, dtype=torch.float64)
    return a.T @ a / (4 * d)


@pytest.mark.parametrize("composition", ["r_h_pbr", "r_h", "plain", "pbr", "br", "h_pbr"])
def test_vector1_orthogonality(composition: str) -> None:
    r, _ = compose_rotation(_random_psd(128, 0), composition)
    assert orthogonality_error(r.float()) < 1e-6


def test_vector2_hadamard_and_bit_reversal_prefixes() -> None:
    h = hadamard_matrix(128)
    assert torch.equal(h, h.T)
    assert torch.allclose(h @ h.T, torch.eye(128, dtype=torch.float64), atol=1e-12)
    assert torch.all(h[0] == h[0, 0])  # row 0 constant (natural order)
    assert bit_reversal(128)[:10].tolist() == [0, 64, 32, 96, 16, 80, 48, 112, 8, 72]
    lam = torch.arange(128, dtype=torch.float64) + 1.0  # ascending, distinct
    pi = bit_reversal_permutation(lam)
    assert pi[:8].tolist() == [127, 63, 95, 31, 111, 47, 79, 15]
    assert torch.equal(pi, 127 - bit_reversal(128))
    assert sorted(pi.tolist()) == list(range(128))


def test_vector3_lemma1_equal_channel_weight() -> None:
    c = _random_psd(128, 1)
    r, _ = compose_rotation(c, "r_h_pbr")
    diag = torch.diagonal(r.T @ c @ r)
    assert torch.allclose(diag, torch.full_like(diag, float(torch.trace(c)) / 128), rtol=1e-10)
    # plain H does not equalise (the worked example's 1.41-1.72 vs 1.00)
    h = hadamard_matrix(128)
    dh = torch.diagonal(h.T @ c @ h)
    assert float(dh.max() / dh.mean()) > 1.01


def test_vector4_dc_convention_is_smallest_eigenvector() -> None:
    c = _random_psd(64, 2)
    r, lam = compose_rotation(c, "r_h_pbr")
    _, u = eigh_ascending(c)
    dc = r @ torch.ones(64, dtype=torch.float64) / 8.0
    u_min = u[:, 0]
    assert torch.allclose(dc, u_min, atol=1e-10) or torch.allclose(dc, -u_min, atol=1e-10)
    assert torch.all(lam[1:] >= lam[:-1])


def test_vector5_permutation_is_a_noop_at_g_equals_d() -> None:
    ref = pytest.importorskip("oscar_kernels.reference")
    c = _random_psd(128, 3)
    r_hp, _ = compose_rotation(c, "r_h_pbr")
    r_h, lam = compose_rotation(c, "r_h")
    pi = bit_reversal_permutation(lam)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4))
    codes_p, _, _ = ref.quantize_int2((x.double() @ r_hp).float(), None, torch.float32)
    codes_h, _, _ = ref.quantize_int2((x.double() @ r_h).float(), None, torch.float32)
    assert torch.equal(codes_p, codes_h[:, pi])


def test_vector14_stored_eigenvalues_match_eigh() -> None:
    c = torch.stack([_random_psd(32, 5), _random_psd(32, 6)])
    r, lam = build_rotations(c, "oscar", "r_h_pbr")
    assert r.shape == (2, 32, 32) and r.dtype == torch.float32 and lam.shape == (2, 32)
    for i in range(2):
        ref_lam = torch.linalg.eigvalsh(c[i])
        assert torch.allclose(lam[i].double(), ref_lam, rtol=1e-5, atol=1e-6)
        assert torch.all(lam[i][1:] >= lam[i][:-1])


def test_baselines_in_the_same_form() -> None:
    c = _random_psd(16, 7)[None]
    r_id, _ = build_rotations(c, "identity", "r_h_pbr")
    r_h, _ = build_rotations(c, "hadamard", "r_h_pbr")
    assert torch.equal(r_id[0], torch.eye(16))
    assert torch.allclose(r_h[0].double(), baseline_rotation("hadamard", 16), atol=1e-7)


def test_non_power_of_two_head_dim_is_refused_with_the_reason() -> None:
    with pytest.raises(CalibrationError, match="not a power of two"):
        compose_rotation(_random_psd(48, 8), "r_h_pbr")
    r, _ = compose_rotation(_random_psd(48, 8), "plain")  # no Hadamard factor: allowed
    assert orthogonality_error(r) < 1e-10


def test_check_orthogonal_refuses_a_bad_matrix() -> None:
    bad = torch.eye(8)
    bad[0, 1] = 1e-3
    with pytest.raises(CalibrationError, match="not orthogonal"):
        check_orthogonal(bad)
    nan = torch.eye(8)
    nan[0, 0] = float("nan")
    with pytest.raises(CalibrationError, match="NaN"):
        check_orthogonal(nan)
