"""W_O-aware value targets (``statistics.v_metric``): the metric from ``o_proj``, the two combined targets, the
recipe knob (absent from the written recipe while ``none``), and calibration end to end on the tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.calib import RESOLVED, tiny_recipe
from helpers.tiny import tiny_causal_lm

from oscar_cli.artifact import open_artifact
from oscar_cli.calibration.rotation import build_rotations, orthogonality_error
from oscar_cli.calibration.run import calibrate_model
from oscar_cli.calibration.wo_metric import model_output_metrics, output_metric, psd_sqrt, wo_target
from oscar_cli.errors import CalibrationError
from oscar_cli.recipe import Recipe, load_recipe, recipe_from_dict

pytestmark = pytest.mark.unit

F64 = torch.float64


def _spd(h: int, d: int, seed: int, spread: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(h, d, 4 * d, generator=g, dtype=F64) * torch.logspace(0, spread, d, dtype=F64)[:, None] ** 0.5
    return a @ a.transpose(1, 2) / (4 * d)


def _is_sym_psd(m: torch.Tensor, tol: float = 1e-9) -> bool:
    sym = torch.allclose(m, m.transpose(-1, -2), atol=1e-12 * float(m.abs().max()))
    return sym and bool((torch.linalg.eigvalsh(m) >= -tol * float(m.abs().max())).all())


def test_output_metric_sums_the_group_heads_of_o_proj_and_has_trace_d() -> None:
    hq, h_kv, d, hidden = 6, 2, 8, 20
    g = torch.Generator().manual_seed(1)
    w = torch.randn(hidden, hq * d, generator=g)
    m = output_metric(w, h_kv, d)
    assert m.shape == (h_kv, d, d) and m.dtype == F64
    for h in range(h_kv):
        ref = sum(w[:, j * d : (j + 1) * d].double().T @ w[:, j * d : (j + 1) * d].double()
                  for j in range(hq) if j // (hq // h_kv) == h)
        assert isinstance(ref, torch.Tensor)
        assert torch.allclose(m[h], ref * (d / torch.trace(ref)), atol=1e-12)
        assert torch.trace(m[h]).item() == pytest.approx(d)
    assert _is_sym_psd(m)
    with pytest.raises(CalibrationError, match="whole query heads"):
        output_metric(torch.randn(hidden, hq * d + 1), h_kv, d)
    with pytest.raises(CalibrationError, match="whole query heads"):
        output_metric(torch.randn(hidden, 3 * d), h_kv, d)  # 3 query heads cannot share 2 KV heads


@pytest.mark.parametrize("metric", ["wo_mcm", "wo_cmc"])
def test_targets_are_sym_psd_with_the_spectrum_of_c_m_and_give_orthogonal_rotations(metric: str) -> None:
    c, m = _spd(3, 16, 0), _spd(3, 16, 1, spread=2.0)
    t = wo_target(c, m, metric)
    assert t.shape == c.shape and _is_sym_psd(t)
    assert not torch.allclose(t, c) and not torch.allclose(t, m)
    lam_cm = torch.linalg.eigvals(c @ m).real.sort().values  # similar to C^½MC^½ and M^½CM^½
    assert torch.allclose(torch.linalg.eigvalsh(t), lam_cm, rtol=1e-8, atol=1e-10)
    for composition in ("r_h_pbr", "plain"):
        r, lam = build_rotations(t, "oscar", composition)
        assert r.shape == (3, 16, 16) and orthogonality_error(r) < 1e-6
        assert torch.allclose(lam.double(), torch.linalg.eigvalsh(t), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("metric", ["wo_mcm", "wo_cmc"])
def test_identity_metric_gives_the_plain_target_and_isotropic_values_give_the_metric(metric: str) -> None:
    c, m = _spd(2, 8, 3), _spd(2, 8, 4)
    eye = torch.eye(8, dtype=F64).expand(2, 8, 8)
    assert torch.allclose(wo_target(c, eye, metric), c, atol=1e-12)
    assert torch.allclose(wo_target(eye, m, metric), m, atol=1e-12)
    assert wo_target(c, m, "none") is c


def test_hand_built_case_commuting_and_non_commuting() -> None:
    c = torch.diag(torch.tensor([4.0, 1.0, 9.0], dtype=F64))[None]
    m = torch.diag(torch.tensor([1.0, 16.0, 0.25], dtype=F64))[None]
    for metric in ("wo_mcm", "wo_cmc"):  # commuting: both are the product C·M
        assert torch.allclose(wo_target(c, m, metric), torch.diag(torch.tensor([4.0, 16.0, 2.25], dtype=F64))[None])
    # 2 x 2, M = diag(4, 0): M^½CM^½ keeps only C's (0, 0) entry, C^½MC^½ = 4·c₀c₀ᵀ with c₀ C^½'s first row
    c2 = torch.tensor([[[2.0, 1.0], [1.0, 2.0]]], dtype=F64)
    m2 = torch.tensor([[[4.0, 0.0], [0.0, 0.0]]], dtype=F64)
    assert torch.allclose(wo_target(c2, m2, "wo_mcm"), torch.tensor([[[8.0, 0.0], [0.0, 0.0]]], dtype=F64))
    s = psd_sqrt(c2)[0]
    assert torch.allclose(s @ s, c2[0], atol=1e-12)
    assert torch.allclose(wo_target(c2, m2, "wo_cmc")[0], 4 * torch.outer(s[0], s[0]), atol=1e-12)
    with pytest.raises(CalibrationError, match="unknown value metric"):
        wo_target(c2, m2, "wo")
    with pytest.raises(CalibrationError, match="differ in shape"):
        wo_target(c2, torch.eye(3, dtype=F64)[None], "wo_mcm")


def test_recipe_knob_is_left_out_while_none_and_round_trips() -> None:
    plain = load_recipe()
    assert plain.statistics.v_metric == "none" and "v_metric" not in plain.to_dict()["statistics"]
    assert plain.full_dict()["statistics"]["v_metric"] == "none"
    assert plain.replace({"statistics": {"v_metric": "none"}}).to_yaml() == plain.to_yaml() == Recipe().to_yaml()
    wo = plain.replace({"statistics": {"v_metric": "wo_mcm"}})
    assert "v_metric: wo_mcm" in wo.to_yaml() and recipe_from_dict(wo.to_dict()) == wo
    from oscar_cli.errors import RecipeError

    with pytest.raises(RecipeError, match="statistics.v_metric"):
        plain.replace({"statistics": {"v_metric": "wo"}})


@pytest.mark.parametrize(("family", "metric", "grouping"), [
    ("llama", "wo_mcm", "layer"),
    ("qwen2", "wo_cmc", "layer"),
    ("qwen3", "wo_mcm", "head"),
    ("mistral", "wo_mcm", "layer"),
])
def test_calibrate_end_to_end_records_the_metric_and_changes_only_r_v(
    tmp_path: Path, family: str, metric: str, grouping: str
) -> None:
    model = tiny_causal_lm(family, heads=6)
    over = {"rotation": {"grouping": grouping}, "clip": {"mode": "global"}}
    plain = calibrate_model(model, None, tiny_recipe(**over), reference="t", resolved=RESOLVED, out=tmp_path / "p")
    res = calibrate_model(model, None, tiny_recipe(**over, statistics={"v_metric": metric}), reference="t",
                          resolved=RESOLVED, out=tmp_path / "w")
    a, b = (open_artifact(r.artifact_path, expect_architecture=r.manifest.architecture) for r in (plain, res))
    assert b.manifest.recipe["statistics"]["v_metric"] == metric
    assert "v_metric" not in a.manifest.recipe["statistics"]
    assert f"v_metric: {metric}" in (res.artifact_path / "recipe.yaml").read_text()
    n = 2 if grouping == "head" else 1
    assert [m.shape for m in model_output_metrics(model, 2, 16)] == [(2, 16, 16)] * 2
    for la, lb in zip(a.layers, b.layers, strict=True):  # (a layer may be served by a fallback scheme: compare
        assert lb.v_rotation.shape == (n, 16, 16) and orthogonality_error(lb.v_rotation) < 1e-6  # the targets)
        assert la.k_eigenvalues is not None and lb.k_eigenvalues is not None
        assert la.v_eigenvalues is not None and lb.v_eigenvalues is not None
        assert torch.equal(la.k_eigenvalues, lb.k_eigenvalues)  # the key side is untouched
        assert not torch.allclose(la.v_eigenvalues, lb.v_eigenvalues, rtol=1e-3)
    assert [s.v_spread for s in res.layers] != [s.v_spread for s in plain.layers]
    assert [s.k_spread for s in res.layers] == [s.k_spread for s in plain.layers]


def test_an_orthogonal_o_proj_reduces_to_the_plain_target(tmp_path: Path) -> None:
    """``o_proj`` = 3·(orthogonal): every head's block has orthonormal columns, ``M ∝ I``, so the combined target
    is the plain one (up to rounding) and so are R_V's eigenvalues."""
    model = tiny_causal_lm("llama")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            q, _ = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=F64))
            layer.self_attn.o_proj.weight.copy_(3.0 * q.float())
    over = {"clip": {"mode": "global"}}
    plain = calibrate_model(model, None, tiny_recipe(**over), reference="t", resolved=RESOLVED, out=tmp_path / "p")
    for metric in ("wo_mcm", "wo_cmc"):
        res = calibrate_model(model, None, tiny_recipe(**over, statistics={"v_metric": metric}), reference="t",
                              resolved=RESOLVED, out=tmp_path / metric)
        for sa, sb in zip(plain.layers, res.layers, strict=True):
            assert sb.v_spread == pytest.approx(sa.v_spread, rel=1e-4)


@pytest.mark.parametrize("grouping", ["layer", "head"])
def test_solve_builds_r_v_from_the_combined_per_head_targets(grouping: str) -> None:
    """``_solve`` combines each KV head's value target with its own ``M`` before averaging the heads."""
    from oscar_cli.calibration.covariance import LayerStatistics
    from oscar_cli.calibration.run import _noop, _solve

    g = torch.Generator().manual_seed(7)
    st = LayerStatistics(2, 8, "qqt", "vtv")
    q, k = torch.randn(1, 4, 64, 8, generator=g), torch.randn(1, 2, 64, 8, generator=g)
    v = torch.randn(1, 2, 64, 8, generator=g) * torch.linspace(0.2, 3.0, 8)
    st.update(q, k, v, None, 8**-0.5)
    m = _spd(2, 8, 9)
    recipe = tiny_recipe(statistics={"v_target": "vtv", "v_metric": "wo_mcm"}, rotation={"grouping": grouping})
    (solved,) = _solve([st], recipe, _noop, [m])
    t = wo_target(st.finalize().v_target, m, "wo_mcm")
    t = t if grouping == "head" else t.mean(0, keepdim=True)
    assert solved.v_eigenvalues is not None
    assert torch.allclose(solved.v_eigenvalues.double(), torch.linalg.eigvalsh(t), rtol=1e-6, atol=1e-9)
    (plain,) = _solve([st], recipe, _noop, None)
    assert plain.v_eigenvalues is not None and not torch.allclose(plain.v_eigenvalues, solved.v_eigenvalues)
