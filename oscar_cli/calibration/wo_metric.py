"""W_O-aware value targets (recipe ``statistics.v_metric``; docs/METHOD.md §2, "Value metric").

Why: the served output of one layer is ``y = Σ_j o_j·W_O,jᵀ`` (``W_O,j`` the ``[hidden, D]`` column block of
``o_proj`` for query head ``j``), so an error ``ε`` in the attention output of head ``j`` costs ``ε·M_j·εᵀ`` with
``M_j = W_O,jᵀ W_O,j``. The query heads of one KV group read the same values, so an error in the values of KV head
``h`` is measured by ``M_h = Σ_{j ∈ group h} M_j`` (heads grouped contiguously: query head ``j`` reads KV head
``j // g``). ``R_V`` is orthogonal: the plain ℓ2 output error depends on it only through what the INT2 quantizer
sees, and the target ``C_V`` (any ``statistics.v_target``) knows nothing about ``M``.

The two combinations (both symmetric PSD, both with the spectrum of ``C·M``, i.e. of the output-side covariance
``W_O·C·W_Oᵀ`` of the value signal, and both equal to ``C`` when ``M ∝ I`` and to ``M`` when ``C ∝ I``):

- ``wo_mcm``: ``T = M^½·C·M^½``. Measured in ``x' = x·M^½`` the output error is the plain ℓ2 error, and
  ``Cov(x') = T``; with the SVD ``W_O = A·S·Bᵀ`` (``M^½ = B·S·Bᵀ``) the eigenvectors of ``T`` are those of the
  output covariance ``W_O·C·W_Oᵀ`` brought back to value space by ``W_O``'s polar factor ``B·Aᵀ`` (the rotation
  nearest to ``W_O``): the eigenvalues rank directions by signal energy × output sensitivity, and the
  quantizer's energy equalisation (``U·H·P``) and its zero-point direction (``R·𝟙/√D`` = the smallest-eigenvalue
  eigenvector, docs/METHOD.md §3) then act on those directions instead of on the raw value energy. This is the
  form that puts the decorrelation in the space where the error is measured, the one argued to help.
- ``wo_cmc``: ``T = C^½·M·C^½``. Its eigenvectors ``w`` are modes of the whitened value ``z = x·C^{-½}``
  ordered by how much output energy they produce (``‖W_O·C^½·w‖²``); as directions of ``x`` they are the mapped
  ``C^½·w`` only after normalisation, so it ranks directions well when ``C`` is near isotropic and is here as
  the other order of the same product, to be measured rather than argued.

A first-order caveat (why the effect may be small): after ``U·H·P`` every rotated coordinate has the same energy
``tr(C)/D`` and a per-token min-max quantizer spreads its rounding error nearly evenly, so the output error
``≈ σ²·tr(M)`` depends on ``U`` only through the error's anisotropy (the extremes kept exactly, clipping, the
zero-point direction). Measured on SmolLM2-135M (docs/RESULTS.md, "W_O-aware value metric"): neither form moves
KL beyond its noise, and both raise the W_O-weighted held-out error by 2-6 %; off by default.
``M_h`` is normalised to mean eigenvalue 1 (``tr(M_h)/D``), so the target keeps ``C``'s scale and ``M ∝ I`` gives
exactly the plain target. Everything is float64.
"""

from __future__ import annotations

from typing import Any

import torch

from oscar_cli.errors import CalibrationError

F64 = torch.float64
V_METRICS = ("none", "wo_mcm", "wo_cmc")


def output_metric(o_proj_weight: torch.Tensor, h_kv: int, head_dim: int) -> torch.Tensor:
    """``M [H_kv, D, D]`` float64 (CPU) from ``o_proj.weight [hidden, H_q·D]``: ``Σ_{j ∈ group h} W_O,jᵀ W_O,j``,
    normalised to ``tr(M_h) = D``. Raises CalibrationError on a shape that does not match the heads."""
    w = o_proj_weight.detach().to(device="cpu", dtype=F64)
    cols = w.shape[1]
    if w.dim() != 2 or cols % head_dim or (cols // head_dim) % h_kv:
        raise CalibrationError(
            f"o_proj weight of shape {tuple(w.shape)} does not hold whole query heads of {head_dim} "
            f"for {h_kv} KV heads"
        )
    hq = cols // head_dim
    blocks = w.reshape(w.shape[0], hq, head_dim).permute(1, 0, 2)  # [H_q, hidden, D]
    m = (blocks.transpose(1, 2) @ blocks).reshape(h_kv, hq // h_kv, head_dim, head_dim).sum(1)
    m = (m + m.transpose(1, 2)) / 2
    tr = torch.diagonal(m, dim1=1, dim2=2).sum(-1).clamp_min(1e-300)
    return m * (head_dim / tr)[:, None, None]


def psd_sqrt(a: torch.Tensor) -> torch.Tensor:
    """Symmetric PSD square root of ``a [..., D, D]`` (negative rounding eigenvalues clamped to 0), float64."""
    a64 = a.to(F64)
    lam, u = torch.linalg.eigh((a64 + a64.transpose(-1, -2)) / 2)
    return (u * lam.clamp_min(0).sqrt().unsqueeze(-2)) @ u.transpose(-1, -2)


def wo_target(c: torch.Tensor, m: torch.Tensor, metric: str) -> torch.Tensor:
    """The W_O-aware target per KV head from ``C [H, D, D]`` and ``M [H, D, D]`` (module docstring), float64,
    symmetrised. ``metric``: ``none`` (``C`` unchanged), ``wo_mcm`` or ``wo_cmc``."""
    if metric == "none":
        return c
    if c.shape != m.shape:
        raise CalibrationError(f"value target {tuple(c.shape)} and W_O metric {tuple(m.shape)} differ in shape")
    c64, m64 = c.to(F64), m.to(F64)
    if metric == "wo_mcm":
        s = psd_sqrt(m64)
        t = s @ c64 @ s
    elif metric == "wo_cmc":
        s = psd_sqrt(c64)
        t = s @ m64 @ s
    else:
        raise CalibrationError(f"unknown value metric {metric!r}", hint=f"one of {', '.join(V_METRICS)}")
    return (t + t.transpose(-1, -2)) / 2


def model_output_metrics(model: Any, h_kv: int, head_dim: int) -> list[torch.Tensor]:
    """``M`` of every decoder layer (``model.model.layers[i].self_attn.o_proj``: Llama, Qwen2/3, Mistral)."""
    from oscar_cli.quant.runtime import decoder_attention_modules

    return [output_metric(attn.o_proj.weight, h_kv, head_dim) for attn in decoder_attention_modules(model)]
