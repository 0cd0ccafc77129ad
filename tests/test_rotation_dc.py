"""``rotation.dc`` (docs/METHOD.md §12.1 item 3): which eigenvector of the target ``H``'s all-ones row sends to the
zero point. ``min`` is the published R bit for bit; ``max`` puts the largest-eigenvalue eigenvector there; only
the compositions with ``H`` after ``U`` have such a direction, the others refuse ``max``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.calib import RESOLVED, tiny_recipe
from helpers.tiny import tiny_causal_lm

from oscar_cli.artifact import open_artifact
from oscar_cli.calibration.rotation import (
    bit_reversal_permutation,
    build_rotations,
    compose_rotation,
    eigh_ascending,
    hadamard_matrix,
    orthogonality_error,
    permutation_matrix,
)
from oscar_cli.calibration.run import calibrate_model
from oscar_cli.errors import CalibrationError, RecipeError
from oscar_cli.recipe import Recipe, load_recipe, recipe_from_dict

pytestmark = pytest.mark.unit

F64 = torch.float64


def _psd(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(4 * d, d, generator=g, dtype=F64) @ torch.randn(d, d, generator=g, dtype=F64)
    return a.T @ a / (4 * d)


def _dc_column(r: torch.Tensor) -> torch.Tensor:
    """``R·𝟙/√D``: the input direction every rotated coordinate sees with the same weight."""
    d = r.shape[-1]
    return r.to(F64) @ torch.full((d,), d**-0.5, dtype=F64)


def _aligned(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-10) -> bool:
    return torch.allclose(a, b, atol=atol) or torch.allclose(a, -b, atol=atol)


@pytest.mark.parametrize("composition", ["r_h_pbr", "r_h"])
@pytest.mark.parametrize("d", [8, 64])
def test_max_puts_the_top_eigenvector_on_the_dc_row_and_stays_orthogonal(composition: str, d: int) -> None:
    c = _psd(d, d)
    lam, u = torch.linalg.eigh(c)
    r_min, lam_min = compose_rotation(c, composition)
    r_max, lam_max = compose_rotation(c, composition, "max")
    assert torch.equal(lam_min, lam_max)  # the eigenvalues (and so P) are unchanged
    assert _aligned(_dc_column(r_max), u[:, -1])  # largest eigenvalue
    assert _aligned(_dc_column(r_min), u[:, 0])  # smallest: the published choice
    assert not _aligned(_dc_column(r_max), _dc_column(r_min), atol=1e-3)
    assert orthogonality_error(r_max) < 1e-12 and orthogonality_error(r_max.float()) < 1e-6
    # the DC direction's energy: x·R has the same value in every coordinate for x along R·𝟙/√D
    x = _dc_column(r_max)[None]
    rotated = x @ r_max
    assert torch.allclose(rotated, torch.full_like(rotated, d**-0.5), atol=1e-10)
    assert float(_dc_column(r_max) @ c @ _dc_column(r_max)) == pytest.approx(float(lam[-1]), rel=1e-9)


@pytest.mark.parametrize("composition", ["r_h_pbr", "r_h", "plain", "pbr", "br", "h_pbr"])
def test_min_is_the_published_rotation_bitwise(composition: str) -> None:
    """The default against the formulas of docs/METHOD.md §3 written out here (the code before the knob)."""
    c = _psd(32, 3)
    lam, u = eigh_ascending(c)
    h, p = hadamard_matrix(32), permutation_matrix(bit_reversal_permutation(lam))
    expected = {"r_h_pbr": u @ h @ p, "r_h": u @ h, "plain": u, "pbr": p, "br": u @ p, "h_pbr": h @ p}[composition]
    for r, _ in (compose_rotation(c, composition), compose_rotation(c, composition, "min")):
        assert torch.equal(r, expected)
    r32, _ = build_rotations(c[None], "oscar", composition)
    assert torch.equal(r32, expected[None].to(torch.float32))


def test_max_when_the_largest_eigenvector_is_already_first_and_on_a_stack() -> None:
    c = torch.diag(torch.tensor([9.0, 1.0, 2.0, 3.0], dtype=F64))  # eigh order: 1, 2, 3, 9
    r, _ = compose_rotation(c, "r_h_pbr", "max")
    assert _aligned(_dc_column(r), torch.tensor([1.0, 0, 0, 0], dtype=F64))
    stack = torch.stack([_psd(16, 1), _psd(16, 2)])
    rs, lams = build_rotations(stack, "oscar", "r_h_pbr", "max")
    for i in range(2):
        top = torch.linalg.eigh(stack[i])[1][:, -1]
        assert _aligned(_dc_column(rs[i]), top, atol=1e-6)
        assert torch.equal(lams[i], build_rotations(stack[i : i + 1], "oscar", "r_h_pbr")[1][0])


@pytest.mark.parametrize("composition", ["plain", "pbr", "br", "h_pbr"])
def test_max_is_refused_without_h_after_u(composition: str) -> None:
    with pytest.raises(CalibrationError, match="needs H after U"):
        compose_rotation(_psd(8, 0), composition, "max")
    with pytest.raises(RecipeError, match=r"rotation\.dc: max needs method oscar with composition r_h_pbr or r_h"):
        load_recipe().replace({"rotation": {"composition": composition, "dc": "max"}})
    with pytest.raises(CalibrationError, match="unknown rotation dc"):
        compose_rotation(_psd(8, 0), "r_h_pbr", "mid")


@pytest.mark.parametrize("method", ["hadamard", "identity"])
def test_max_is_refused_for_the_data_free_methods(method: str) -> None:
    with pytest.raises(CalibrationError, match="needs method oscar"):
        build_rotations(_psd(8, 0)[None], method, "r_h_pbr", "max")
    with pytest.raises(RecipeError, match="rotation.dc"):
        load_recipe().replace({"method": method, "rotation": {"dc": "max"}})
    assert load_recipe().replace({"method": method}).rotation.dc == "min"


def test_recipe_knob_is_left_out_while_min_and_round_trips() -> None:
    plain = load_recipe()
    assert plain.rotation.dc == "min" and "dc" not in plain.to_dict()["rotation"]
    assert plain.full_dict()["rotation"]["dc"] == "min"
    assert plain.replace({"rotation": {"dc": "min"}}).to_yaml() == plain.to_yaml() == Recipe().to_yaml()
    assert "dc:" not in plain.to_yaml()
    mx = plain.replace({"rotation": {"dc": "max"}})
    assert "dc: max" in mx.to_yaml() and recipe_from_dict(mx.to_dict()) == mx
    assert recipe_from_dict(mx.full_dict()) == mx
    with pytest.raises(RecipeError, match="rotation.dc"):
        plain.replace({"rotation": {"dc": "largest"}})


@pytest.mark.parametrize("grouping", ["layer", "head"])
def test_solve_puts_the_top_eigenvector_of_each_target_on_the_dc_row_for_keys_and_values(grouping: str) -> None:
    from oscar_cli.calibration.covariance import LayerStatistics
    from oscar_cli.calibration.run import _noop, _solve

    g = torch.Generator().manual_seed(11)
    st = LayerStatistics(2, 8, "qqt", "vtv")
    scale = torch.linspace(0.2, 3.0, 8)
    q, k = torch.randn(1, 4, 64, 8, generator=g) * scale, torch.randn(1, 2, 64, 8, generator=g) * scale.flip(0)
    v = torch.randn(1, 2, 64, 8, generator=g) * scale
    st.update(q, k, v, None, 8**-0.5)
    t = st.finalize()
    recipe = tiny_recipe(statistics={"v_target": "vtv"}, rotation={"grouping": grouping, "dc": "max"})
    (solved,) = _solve([st], recipe, _noop)
    (plain,) = _solve([st], recipe.replace({"rotation": {"dc": "min"}}), _noop)
    for target, r, r0 in ((t.k_target, solved.k_rotation, plain.k_rotation),
                          (t.v_target, solved.v_rotation, plain.v_rotation)):
        target = target if grouping == "head" else target.mean(0, keepdim=True)
        assert r.shape[0] == target.shape[0]
        for i in range(target.shape[0]):
            vecs = torch.linalg.eigh(target[i].double())[1]
            assert _aligned(_dc_column(r[i]), vecs[:, -1], atol=1e-5)
            assert _aligned(_dc_column(r0[i]), vecs[:, 0], atol=1e-5)
    assert solved.k_eigenvalues is not None and plain.k_eigenvalues is not None
    assert torch.equal(solved.k_eigenvalues, plain.k_eigenvalues)


def test_calibrate_end_to_end_records_the_knob_and_changes_only_the_rotations(tmp_path: Path) -> None:
    model = tiny_causal_lm("llama")
    over = {"clip": {"mode": "global"}}
    plain = calibrate_model(model, None, tiny_recipe(**over), reference="t", resolved=RESOLVED, out=tmp_path / "p")
    res = calibrate_model(model, None, tiny_recipe(**over, rotation={"dc": "max"}), reference="t",
                          resolved=RESOLVED, out=tmp_path / "m")
    a, b = (open_artifact(r.artifact_path, expect_architecture=r.manifest.architecture) for r in (plain, res))
    assert "dc" not in a.manifest.recipe["rotation"] and "dc:" not in (plain.artifact_path / "recipe.yaml").read_text()
    assert b.manifest.recipe["rotation"]["dc"] == "max"
    assert "dc: max" in (res.artifact_path / "recipe.yaml").read_text()
    for la, lb in zip(a.layers, b.layers, strict=True):
        for ra, rb in ((la.k_rotation, lb.k_rotation), (la.v_rotation, lb.v_rotation)):
            assert orthogonality_error(rb) < 1e-6
            assert not torch.allclose(ra, rb, atol=1e-3)
            assert not _aligned(_dc_column(ra[0]), _dc_column(rb[0]), atol=1e-3)
        assert torch.equal(la.k_eigenvalues, lb.k_eigenvalues)  # same statistics, same λ
        assert torch.equal(la.v_eigenvalues, lb.v_eigenvalues)
