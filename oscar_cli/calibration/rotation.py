"""Rotation construction: ``R = U·H·P`` from a second-moment target (docs/METHOD.md §3), plus the baselines.

Conventions (bit-compatible with the published RotationZoo artifacts, docs/METHOD.md §3):

- ``λ, U = eigh(C)`` in float64: eigenvalues **ascending**, columns of ``U`` in the same order.
- ``H``: normalised Sylvester Hadamard, natural order, symmetric (``oscar_kernels.reference.hadamard``).
- ``P = I[:, π]`` with ``π[β(i)] = σ(i)``, ``σ = argsort(λ, descending)`` and ``β`` the ``log2 D``-bit
  reversal; so ``(M·P)[:, j] = M[:, π(j)]``. For ascending distinct ``λ``: ``π(j) = D - 1 - β(j)``.
- Rotations are applied to row vectors: ``x̃ = x·R``. With ``R = U·H·P``, ``R·𝟙/√D`` is the smallest-eigenvalue
  eigenvector (the DC pattern a min-max quantizer absorbs in its zero point).
- ``dc`` (recipe ``rotation.dc``): ``min`` keeps that published choice; ``max`` swaps ``U``'s column 0 with the
  largest-eigenvalue column first, so ``R·𝟙/√D`` is the largest-eigenvalue eigenvector (docs/METHOD.md §12.1 item
  3). ``P`` is still built from ``λ`` as before: the only change is which eigenvector the zero point absorbs.
  Only the compositions with ``H`` after ``U`` (:data:`DC_COMPOSITIONS`) have such a direction.

Compositions (recipe ``rotation.composition``): ``r_h_pbr`` U·H·P (default), ``r_h`` U·H, ``plain`` U, ``pbr`` P,
``br`` U·P, ``h_pbr`` H·P. The ``hadamard`` method is ``H`` alone (QuaRot) and ``identity`` is ``I``: every
method is stored in the same artifact form, so the cache runs all of them through one code path.
"""

from __future__ import annotations

import torch

from oscar_cli.errors import CalibrationError

ORTHOGONALITY_TOLERANCE = 1e-6
DC_COMPOSITIONS = ("r_h_pbr", "r_h")  # H after U: R·𝟙/√D is a column of U, chosen by ``dc``
DC_CHOICES = ("min", "max")


def is_power_of_two(d: int) -> bool:
    """True for 1, 2, 4, 8, ..."""
    return d >= 1 and d & (d - 1) == 0


def _require_power_of_two(d: int) -> None:
    if not is_power_of_two(d):
        raise CalibrationError(
            f"head_dim {d} is not a power of two: the Hadamard mixer and the bit-reversal permutation need "
            "a power-of-two size",
            hint="use a recipe with method: identity or rotation.composition: plain (no H or P factor)",
        )


def hadamard_matrix(d: int) -> torch.Tensor:
    """Normalised natural-order Sylvester Hadamard ``[d, d]`` float64; ``d`` must be a power of two."""
    _require_power_of_two(d)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / torch.sqrt(torch.tensor(float(d), dtype=torch.float64))


def bit_reversal(d: int) -> torch.Tensor:
    """``β(i)``: the ``log2 d`` bits of ``i`` reversed, int64 ``[d]``. d = 128 → 0, 64, 32, 96, 16, ..."""
    _require_power_of_two(d)
    bits = d.bit_length() - 1
    out = [int(f"{i:0{bits}b}"[::-1], 2) if bits else 0 for i in range(d)]
    return torch.tensor(out, dtype=torch.int64)


def bit_reversal_permutation(eigenvalues: torch.Tensor) -> torch.Tensor:
    """``π`` with ``π[β(i)] = σ(i)``, ``σ = argsort(λ, descending)``; int64 ``[d]``."""
    d = eigenvalues.shape[-1]
    sigma = torch.argsort(eigenvalues.to(torch.float64), descending=True, stable=True)
    pi = torch.empty(d, dtype=torch.int64)
    pi[bit_reversal(d)] = sigma
    return pi


def permutation_matrix(pi: torch.Tensor) -> torch.Tensor:
    """``P = I[:, π]`` float64, so that ``(M·P)[:, j] = M[:, π(j)]``."""
    return torch.eye(pi.shape[0], dtype=torch.float64)[:, pi]


def eigh_ascending(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetrise ``C`` ``[d, d]`` and return ``(λ ascending [d], U [d, d])`` in float64."""
    c64 = c.to(torch.float64)
    c64 = (c64 + c64.T) / 2
    lam, u = torch.linalg.eigh(c64)
    return lam, u


def dc_first(u: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``U`` with columns 0 and ``argmax λ`` swapped (a copy; ``U`` itself when the largest is already first)."""
    j = int(torch.argmax(lam))
    if j == 0:
        return u
    idx = torch.arange(u.shape[1])
    idx[0], idx[j] = j, 0
    return u[:, idx]


def _check_dc(dc: str, composition: str) -> None:
    if dc not in DC_CHOICES:
        raise CalibrationError(f"unknown rotation dc {dc!r} (expected one of {', '.join(DC_CHOICES)})")
    if dc != "min" and composition not in DC_COMPOSITIONS:
        raise CalibrationError(
            f"rotation dc {dc!r} needs H after U (composition {' or '.join(DC_COMPOSITIONS)}), "
            f"got {composition!r}: it has no eigenvector on the zero-point direction"
        )


def compose_rotation(
    c: torch.Tensor, composition: str = "r_h_pbr", dc: str = "min"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Build one rotation from a target ``C`` ``[d, d]``.

    ``dc``: which eigenvector takes ``U``'s first column, the one ``H``'s all-ones row sends to the zero point:
    ``min`` (published; the smallest-eigenvalue one) or ``max`` (the largest); only with ``r_h_pbr`` / ``r_h``.

    Returns:
        ``(R [d, d] float64, λ [d] float64 ascending)``.
    """
    _check_dc(dc, composition)
    lam, u = eigh_ascending(c)
    d = lam.shape[0]
    if dc == "max":
        u = dc_first(u, lam)
    if composition == "plain":
        return u, lam
    if composition == "r_h":
        return u @ hadamard_matrix(d), lam
    p = permutation_matrix(bit_reversal_permutation(lam))
    if composition == "r_h_pbr":
        return u @ hadamard_matrix(d) @ p, lam
    if composition == "pbr":
        return p, lam
    if composition == "br":
        return u @ p, lam
    if composition == "h_pbr":
        return hadamard_matrix(d) @ p, lam
    raise CalibrationError(f"unknown rotation composition {composition!r}")


def baseline_rotation(method: str, d: int) -> torch.Tensor:
    """The data-free rotations: ``identity`` → ``I``, ``hadamard`` → ``H`` (QuaRot); float64 ``[d, d]``."""
    if method == "identity":
        return torch.eye(d, dtype=torch.float64)
    if method == "hadamard":
        return hadamard_matrix(d)
    raise CalibrationError(f"{method!r} is not a data-free rotation method")


def build_rotations(
    targets: torch.Tensor, method: str, composition: str, dc: str = "min"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotations for a stack of targets.

    Args:
        targets: float64 ``[N, D, D]`` (``N = 1`` per layer, or ``H_kv`` per KV head).
        method: ``oscar`` (eigen-based, uses ``composition`` and ``dc``), ``hadamard`` or ``identity``.
        dc: :func:`compose_rotation`; the data-free methods accept only ``min``.

    Returns:
        ``(R [N, D, D] float32, λ [N, D] float32 ascending)``; for the data-free methods ``λ`` still holds the
        target's ascending eigenvalues (informational). Raises CalibrationError if a rotation is not orthogonal.
    """
    if method != "oscar" and dc != "min":
        raise CalibrationError(f"rotation dc {dc!r} needs method oscar (the {method!r} rotation has no eigenvectors)")
    rs, lams = [], []
    for c in targets:
        if method == "oscar":
            r, lam = compose_rotation(c, composition, dc)
        else:
            lam, _ = eigh_ascending(c)
            r = baseline_rotation(method, c.shape[-1])
        rs.append(r)
        lams.append(lam)
    r32 = torch.stack(rs).to(torch.float32)
    check_orthogonal(r32)
    return r32, torch.stack(lams).to(torch.float32)


def orthogonality_error(r: torch.Tensor) -> float:
    """``max |RᵀR − I|`` over a stack ``[..., D, D]``, computed in float64 from the stored values."""
    r64 = r.to(torch.float64)
    eye = torch.eye(r.shape[-1], dtype=torch.float64)
    return float((r64.transpose(-1, -2) @ r64 - eye).abs().max())


def check_orthogonal(r: torch.Tensor, tolerance: float = ORTHOGONALITY_TOLERANCE) -> None:
    """Raise CalibrationError unless ``‖RᵀR − I‖∞ < tolerance`` (and R is finite)."""
    if not torch.isfinite(r).all():
        raise CalibrationError("a rotation contains NaN or inf: the calibration statistics are degenerate")
    err = orthogonality_error(r)
    if not err < tolerance:
        raise CalibrationError(f"rotation is not orthogonal: max|RᵀR − I| = {err:.2e} >= {tolerance:.0e}")
