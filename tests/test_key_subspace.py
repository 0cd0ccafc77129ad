"""The BF16 key subspace (recipe ``quant.key_subspace``): exact coordinates along the query directions, the
residual in INT2, through calibration, the artifact and the cache (oscar_cli.quant.key_subspace)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers.calib import RESOLVED, check_tampered_tensor, random_orthogonal, random_transform, tiny_recipe
from helpers.layers import feed
from helpers.tiny import tiny_causal_lm

from oscar_cli.artifact import open_artifact
from oscar_cli.calibration.run import calibrate_model
from oscar_cli.errors import OscarError, RecipeError
from oscar_cli.quant import oscar_method
from oscar_cli.quant.cache import Int2Cache
from oscar_cli.quant.int2_layer import Int2Layer
from oscar_cli.quant.key_subspace import (
    check_basis,
    coefficients,
    fake_subspace,
    rebase,
    residual,
    restore,
    subspace_basis,
    subspace_bits,
)
from oscar_cli.quant.methods import oscar_from_artifact
from oscar_cli.recipe import MAX_KEY_SUBSPACE, Recipe, check_layout, recipe_from_dict
from oscar_cli.vllm.layout import Int2Settings, check_geometry
from oscar_kernels.reference import dequantize_rows, quantize_rows

pytestmark = pytest.mark.unit
F64 = torch.float64


def _spd(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, d, 4 * d, generator=g, dtype=F64) * torch.logspace(0, 3, d, dtype=F64)[:, None] ** 0.5
    return a @ a.transpose(1, 2) / (4 * d)


def _fake(x: torch.Tensor) -> torch.Tensor:
    return dequantize_rows(quantize_rows(x, None, None, 0.9, None, torch.bfloat16))


@pytest.mark.parametrize(("n", "d", "m"), [(1, 16, 1), (1, 64, 2), (3, 32, 4), (2, 128, 3)])
def test_basis_is_the_targets_top_directions_in_rotated_coordinates(n: int, d: int, m: int) -> None:
    c, r = _spd(n, d, 1), random_orthogonal(n, d, 2).double()
    v = subspace_basis(c, r, m)
    assert v.shape == (n, d, m) and check_basis(v, m, d, "v") is None
    lam, u = torch.linalg.eigh(c)
    top = r @ v.double()  # back in the original coordinates: the top-m eigenvectors (up to sign)
    for i in range(m):
        assert torch.allclose((top[..., i] * u[..., -1 - i]).sum(-1).abs(), torch.ones(n, dtype=F64), atol=1e-5)
    # the share of the target's trace the directions carry is the top eigenvalues' share
    share = torch.einsum("ndm,nde,nem->n", v.double(), r.transpose(-1, -2) @ c @ r, v.double()) / lam.sum(-1)
    assert torch.allclose(share, lam[..., -m:].sum(-1) / lam.sum(-1), atol=1e-5)


@pytest.mark.parametrize(("h", "t", "d", "m"), [(1, 1, 16, 1), (2, 7, 64, 2), (4, 33, 128, 3)])
def test_served_rows_keep_the_coefficients_and_the_residuals_other_coordinates(h: int, t: int, d: int, m: int) -> None:
    g = torch.Generator().manual_seed(3)
    y = torch.randn(2, h, t, d, generator=g) * 3
    basis = torch.linalg.qr(torch.randn(1, d, m, generator=g, dtype=F64))[0].float()
    c = coefficients(y, basis).to(torch.bfloat16)
    res = residual(y, c, basis)
    assert coefficients(res, basis).abs().max() < 1e-4 * y.abs().max() + 0.02 * c.float().abs().max()
    served = fake_subspace(y, basis, _fake, torch.bfloat16)
    assert torch.allclose(coefficients(served, basis), c.float(), atol=1e-4)  # exactly the stored coefficients
    r_hat = _fake(res)
    p_perp = torch.eye(d) - basis[0] @ basis[0].T
    assert torch.allclose(served @ p_perp, r_hat @ p_perp, atol=1e-4)  # off the subspace: the INT2 residual
    assert torch.allclose(restore(res, c, basis), y, atol=0.02 * y.abs().max().item())  # no quantization: y back
    assert fake_subspace(y, None, _fake, torch.bfloat16).equal(_fake(y))


def test_subspace_removes_the_logit_error_along_query_directions() -> None:
    """Queries concentrated on 2 directions: their logit error under INT2 keys drops with m = 2."""
    g = torch.Generator().manual_seed(5)
    d = 64
    basis = torch.linalg.qr(torch.randn(1, d, 2, generator=g, dtype=F64))[0].float()
    q = torch.randn(256, 2, generator=g) @ basis[0].T * 10 + torch.randn(256, d, generator=g) * 0.3
    y = torch.randn(1, 1, 512, d, generator=g) + (torch.randn(1, 1, 512, 2, generator=g) * 4) @ basis[0].T
    err_plain = ((_fake(y) - y)[0, 0] @ q.T).square().mean()
    err_sub = ((fake_subspace(y, basis, _fake, torch.bfloat16) - y)[0, 0] @ q.T).square().mean()
    assert err_sub < 0.2 * err_plain


def test_rebase_keeps_the_directions() -> None:
    d = 32
    r_old, r_new = random_orthogonal(1, d, 7), random_orthogonal(1, d, 8)
    v = subspace_basis(_spd(1, d, 9), r_old, 3)
    w = rebase(v, r_old, r_new)
    assert check_basis(w, 3, d, "w") is None
    assert torch.allclose(r_new.double() @ w.double(), r_old.double() @ v.double(), atol=1e-5)


def test_bits_formula() -> None:
    assert subspace_bits(32768, 128, 2, 64, 256) == pytest.approx(16 * 2 * (32768 - 320) / (256 * 32768))
    assert subspace_bits(100, 64, 0, 0, 0) == 0.0 and subspace_bits(300, 64, 4, 64, 256) == 0.0


def _layer(m: int, d: int = 16, h: int = 2, sink: int = 8, recent: int = 16) -> tuple[Int2Layer, torch.Tensor]:
    t = random_transform(11, d=d)
    basis = subspace_basis(_spd(1, d, 12), t.k_rotation, m) if m else None
    meth = oscar_method([replace(t, k_subspace=basis)], sink=sink, recent=recent)
    meth = replace(meth, key_subspace=m)
    return Int2Layer(meth, meth.layer(0)), basis if basis is not None else torch.empty(0)


@pytest.mark.parametrize("chunks", [[100], [40, 60], [33, 7, 60]], ids=["one-chunk", "two-chunks", "ragged"])
def test_cache_serves_exact_coordinates_along_the_subspace(chunks: list[int]) -> None:
    """Chunked prefill + decode through the cache: every INT2 key slot's coordinates along the basis are its
    bfloat16 coefficients; off the basis it is the INT2 residual; BF16 tiers unchanged."""
    layer, basis = _layer(2)
    g = torch.Generator().manual_seed(13)
    k = torch.randn(1, 2, 120, 16, generator=g) * 2
    v = torch.randn(1, 2, 120, 16, generator=g)
    outs = feed(layer, k, v, chunks, 20)
    t = layer.transform
    kr = k @ t.k_rotation[0]  # rotated keys (float32 model: no dtype cast)
    y = kr - t.k_mean.unsqueeze(-2)
    served_k = outs[-1][0]  # the last decode step: slots [0, 120) stored, the new token last
    s, hist, _ = layer.tier_sizes()
    c = coefficients(y, basis).to(torch.bfloat16).float()
    got = coefficients(served_k[..., s : s + hist, :] - t.k_mean.unsqueeze(-2), basis)
    assert torch.allclose(got, c[..., s : s + hist, :], atol=1e-4)
    res = residual(y, c, basis)
    deq = dequantize_rows(quantize_rows(res + t.k_mean.unsqueeze(-2), None, t.k_mean, t.k_clip, None, torch.bfloat16))
    p_perp = torch.eye(16) - basis[0] @ basis[0].T
    want = (deq @ p_perp)[..., s : s + hist, :]
    assert torch.allclose((served_k[..., s : s + hist, :] - t.k_mean.unsqueeze(-2)) @ p_perp, want, atol=1e-4)
    assert torch.equal(served_k[..., :s, :], kr[..., :s, :])  # the sink as is
    plain, _ = _layer(0)
    plain_k = feed(plain, k, v, chunks, 20)[-1][0]
    assert torch.equal(plain_k[..., :s, :], served_k[..., :s, :])
    assert torch.equal(outs[-1][1], feed(_layer(0)[0], k, v, chunks, 20)[-1][1])  # values untouched


@pytest.mark.parametrize("length", [100, 320, 1000])
def test_measured_bytes_equal_bpe_formula_with_a_subspace(length: int) -> None:
    d, h = 128, 2
    t = replace(random_transform(3, d=d), k_subspace=torch.linalg.qr(torch.randn(1, d, 2, dtype=F64))[0].float())
    meth = replace(oscar_method([t], sink=64, recent=256), key_subspace=2)
    cache = Int2Cache(meth, 1)
    x = torch.randn(1, h, length, d).bfloat16()
    cache.update(x, x, 0)
    formula = meth.bits_per_element(length, d)
    assert math.isclose(cache.measured_bits_per_element(), formula, rel_tol=1e-12)
    base = replace(meth, key_subspace=0).bits_per_element(length, d)
    assert formula - base == pytest.approx(subspace_bits(length, d, 2, 64, 256))


def test_triton_backend_and_vllm_refuse_a_subspace() -> None:
    t = replace(random_transform(3, d=64), k_subspace=torch.linalg.qr(torch.randn(1, 64, 2, dtype=F64))[0].float())
    meth = replace(oscar_method([t], sink=8, recent=16), key_subspace=2)
    layer = Int2Layer(meth, meth.layer(0), backend="triton")
    x = torch.randn(1, 1, 20, 64, dtype=torch.float16)
    with pytest.raises(OscarError, match="do not read the BF16 key subspace"):
        layer.update(x, x)
    with pytest.raises(OscarError, match=r"key_subspace 2: the kernels do not read it"):
        check_geometry(head_dim=128, block_size=16, settings=Int2Settings(sink=64, recent=256, meta_dtype=torch.bfloat16),
                       group_size=None, key_subspace=2)


def test_recipe_knob_bounds_and_left_out_while_off() -> None:
    assert "key_subspace" not in Recipe().to_dict()["quant"]
    r = recipe_from_dict({**Recipe().to_dict(), "quant": {**Recipe().to_dict()["quant"], "key_subspace": 2}})
    assert r.to_dict()["quant"]["key_subspace"] == 2
    with pytest.raises(RecipeError, match="key_subspace"):
        recipe_from_dict({"quant": {"key_subspace": MAX_KEY_SUBSPACE + 1}})
    with pytest.raises(RecipeError, match="must be below the model's head_dim 16"):
        check_layout(recipe_from_dict({"quant": {"key_subspace": 16}}).quant, 16)


def _calibrated(tmp_path: Path, m: int, name: str):  # type: ignore[no-untyped-def]
    model = tiny_causal_lm()
    recipe = tiny_recipe(clip={"mode": "global"}, quant={"key_subspace": m})
    res = calibrate_model(model, None, recipe, reference="t", resolved=RESOLVED, out=tmp_path / name)
    return model, res


def test_calibrate_writes_a_basis_per_layer_and_the_artifact_serves_it(tmp_path: Path) -> None:
    model, res = _calibrated(tmp_path, 2, "sub")
    art = open_artifact(res.artifact_path, expect_architecture=res.manifest.architecture)
    assert art.manifest.quant["key_subspace"] == 2
    d = art.head_dim
    for layer in art.layers:
        assert layer.k_subspace is not None and check_basis(layer.k_subspace, 2, d, "l") is None
    meth = oscar_from_artifact(str(res.artifact_path), model.config)
    assert meth.key_subspace == 2
    assert meth.bits_per_element(4096, d) > replace(meth, key_subspace=0).bits_per_element(4096, d)
    _, plain = _calibrated(tmp_path, 0, "plain")
    assert "key_subspace" not in plain.manifest.quant
    assert all(layer.k_subspace is None for layer in open_artifact(plain.artifact_path).layers)


def test_artifact_with_a_broken_or_missing_basis_is_refused(tmp_path: Path) -> None:
    _, res = _calibrated(tmp_path, 2, "sub")
    check_tampered_tensor(res.artifact_path, "k_subspace", lambda x: x * 2,
                          r"layers.0.k_subspace: columns are not orthonormal")
