"""The BF16 key subspace: keys' coordinates along the queries' top-``m`` directions kept exactly, the rest INT2.

Why: a key's INT2 error ``e`` reaches attention as the logit error ``q·e``, whose variance over the queries is
``eᵀ C_Q e`` (``C_Q`` the query covariance calibration already estimates for the key rotation). After the
rotation the error is spread evenly over the ``D`` rotated directions, so it costs ``ε²·tr(C_Q)``; on the
models measured the top two eigen-directions of ``C_Q`` carry about half of ``tr(C_Q)`` (Qwen2.5-Coder-1.5B:
median 0.58 over its 28 layers; SmolLM2-135M: 0.43). Storing the key's ``m`` coefficients along those
directions in BF16 and quantizing only the rest removes their share of the logit noise, and the INT2 range of
the residual row is smaller too.

In the rotated space the cache stores (``y = (k - μ_K)·…`` centred rows, ``[..., D]``) with ``V`` the layer's
orthonormal basis ``[N, D, m]`` (``N`` 1 or ``H_kv``; artifact tensor ``layers.{i}.k_subspace``):

- write: ``c = y·V`` (kept in bfloat16), the INT2 row is ``y - c·Vᵀ`` (clipped and quantized as usual);
- read: ``ŷ = r̂ + (c - r̂·V)·Vᵀ`` for the dequantized residual ``r̂``: the coordinates along ``V`` are exactly
  ``c`` (the residual's own INT2 error along ``V`` is replaced too), the rest is ``r̂``'s.

Cost: ``m`` 16-bit coefficients per stored INT2 key row and head, ``16·m / (2·D)`` bits per K/V element over the
INT2 history (:func:`subspace_bits`). Reference path only: the Triton kernels and vLLM refuse such a method.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def subspace_basis(target: torch.Tensor, rotation: torch.Tensor, m: int) -> torch.Tensor:
    """``[N, D, m]`` float32: the top-``m`` eigenvectors of the key target ``C`` ``[N, D, D]`` (query covariance)
    in the rotated coordinates of ``rotation`` ``[N, D, D]`` (``x @ R``): ``Rᵀ·U_top``, orthonormal columns."""
    c = target.double()
    c = (c + c.transpose(-1, -2)) / 2
    _, u = torch.linalg.eigh(c)  # ascending
    top = u[..., -m:].flip(-1)  # largest first
    r = rotation.double().expand(c.shape[0], -1, -1)
    return (r.transpose(-1, -2) @ top).float()


def rebase(basis: torch.Tensor, old_rotation: torch.Tensor, new_rotation: torch.Tensor) -> torch.Tensor:
    """The same directions in another rotated space: ``R_newᵀ·R_old·V`` (``[N, D, m]``)."""
    n = max(basis.shape[0], old_rotation.shape[0], new_rotation.shape[0])
    d = basis.shape[-2]
    old = old_rotation.double().expand(n, d, d)
    new = new_rotation.double().expand(n, d, d)
    return (new.transpose(-1, -2) @ old @ basis.double().expand(n, d, -1)).float()


def _per_head(basis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``basis [N, D, m]`` as ``[H, D, m]`` for rows ``x [B, H, T, D]`` (float32, on ``x``'s device)."""
    b = basis.to(x.device, torch.float32)
    return b.expand(x.shape[1], -1, -1) if b.shape[0] == 1 else b


def coefficients(y: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``c = y·V`` ``float32 [B, H, T, m]`` of centred rotated rows ``y [B, H, T, D]``."""
    return torch.einsum("bhtd,hdm->bhtm", y.float(), _per_head(basis, y))


def residual(y: torch.Tensor, c: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``y - c·Vᵀ`` in float32: what the INT2 row stores (``y`` may be the uncentred rows: the quantizer subtracts
    the centring mean afterwards)."""
    return y.float() - torch.einsum("bhtm,hdm->bhtd", c.float(), _per_head(basis, y))


def restore(r_hat: torch.Tensor, c: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``r̂ + (c - r̂·V)·Vᵀ`` in float32: the dequantized residual with its coordinates along ``V`` set to ``c``."""
    v = _per_head(basis, r_hat)
    r = r_hat.float()
    return r + torch.einsum("bhtm,hdm->bhtd", c.float() - torch.einsum("bhtd,hdm->bhtm", r, v), v)


def fake_subspace(y: torch.Tensor, basis: torch.Tensor | None, fake: Callable[[torch.Tensor], torch.Tensor],
                  dtype: torch.dtype) -> torch.Tensor:
    """Fake-quantized centred rows ``y [B, H, T, D]`` under the subspace (``fake``: residual rows -> their INT2
    dequantization, float32); coefficients rounded to ``dtype`` as the cache stores them. ``basis`` None: ``fake(y)``."""
    if basis is None:
        return fake(y)
    c = coefficients(y, basis).to(dtype)
    return restore(fake(residual(y, c, basis)), c, basis)


def subspace_bits(context_len: int, head_dim: int, m: int, sink: int, recent: int) -> float:
    """Bits per K/V element the coefficients add at ``context_len`` (batch 1): ``16·m`` per INT2 key row over
    ``2·D`` elements per token, for the ``max(0, L - S - W)`` history tokens."""
    if m <= 0 or context_len <= 0:
        return 0.0
    hist = max(0, context_len - sink - recent)
    return 16.0 * m * hist / (2.0 * head_dim * context_len)


def check_basis(basis: torch.Tensor, m: int, head_dim: int, where: str, tolerance: float = 1e-3) -> str | None:
    """Why ``basis`` is not an orthonormal ``[N, D, m]`` basis (None: it is)."""
    if basis.dim() != 3 or basis.shape[-2:] != (head_dim, m):
        return f"{where}: expected [N, {head_dim}, {m}], got {list(basis.shape)}"
    b = basis.double()
    err = float((b.transpose(-1, -2) @ b - torch.eye(m, dtype=torch.float64)).abs().max())
    if err > tolerance:
        return f"{where}: columns are not orthonormal (error {err:.1e})"
    return None
