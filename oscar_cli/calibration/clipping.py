"""Clip ratios: the published global values, or a per-layer search on held-out tokens (docs/METHOD.md §5).

The search scores each candidate by the **attention-output error of the reference quantizer**
(``oscar_kernels.reference.fake_quantize_rows``) under the serving tiers: for a query at position ``i``, keys
``j < sink`` and ``j > i - recent`` stay exact (BF16 tiers), keys in between are INT2. Everything runs in the
rotated, centred space (an orthogonal rotation and the mean add-back do not change the error norm):

    objective(r_K, r_V) = Σ ‖Ô − O‖² / Σ ‖O + μ_V‖²      over the scored held-out queries and heads

with ``O`` exact attention and ``Ô`` attention over the tiered, fake-quantized keys/values. The search is
coordinate-wise: first ``r_K`` over ``clip.k_grid`` with exact values, then ``r_V`` over ``clip.v_grid`` with
keys quantized at the chosen ``r_K``. Ties keep the earlier grid entry.

``clip.objective: topk`` scores the candidates instead by the error on the keys each query attends to most:
with ``T_q`` the ``clip.topk_keys`` INT2 keys of largest exact attention weight ``p_qj`` for query ``q``, and
``v_j`` the un-centred values,

    objective_topk = Σ_q ‖Σ_{j∈T_q} (p̂_qj v̂_j − p_qj v_j)‖² / Σ_q ‖Σ_{j∈T_q} p_qj v_j‖²

so a query that concentrates on a few keys (a needle, a copied number) weighs by the mass on those keys, and
the many keys of small weight that dominate the mean error do not count. ``p̂`` is the full tiered softmax, so
a clip that lowers a top key's logit moves mass away from it and is penalised. Whatever the objective, the
recorded ``error`` of a choice is the mean objective above at the chosen ratios (what the per-layer scheme
comparison, :mod:`oscar_cli.calibration.schemes`, and the reports read).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from oscar_cli.quant.key_subspace import fake_subspace
from oscar_kernels.layout import UNIFORM_INNER

META_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "uint8": torch.uint8}
OBJECTIVES = ("mean", "topk")


@dataclass
class ClipChoice:
    """Chosen ratios of one layer and the objective of every candidate tried (``ratio -> error``)."""

    k_ratio: float
    v_ratio: float
    k_objective: dict[float, float] = field(default_factory=dict)
    v_objective: dict[float, float] = field(default_factory=dict)
    error: float | None = None  # None: not evaluated (no held-out tokens with an INT2 tier)

    def to_dict(self) -> dict[str, Any]:
        return {"k_ratio": self.k_ratio, "v_ratio": self.v_ratio, "error": self.error,
                "k_objective": {f"{r:g}": e for r, e in self.k_objective.items()},
                "v_objective": {f"{r:g}": e for r, e in self.v_objective.items()}}


def int2_pair_mask(t: int, tq: int, sink: int, recent: int, device: torch.device) -> torch.Tensor:
    """bool ``[tq, t]``: True where the query (one of the last ``tq`` positions) sees the key through INT2."""
    i = torch.arange(t - tq, t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    return (j >= sink) & (j <= i - recent) & (j <= i)


class LayerClipProblem:
    """Held-out tensors of one layer, rotated and centred once; evaluates candidate ratios.

    Queries are kept grouped by KV head (``[B, H_kv, g·Tq, D]``), so GQA needs no key/value repetition.

    Args:
        q: ``[B, H_q, Tq, D]`` queries at the last ``Tq`` positions; k, v: ``[B, H_kv, T, D]``.
        k_rotation, v_rotation: ``[N, D, D]`` (``N`` = 1 or ``H_kv``; None = identity); k_mean, v_mean:
            ``[H_kv, D]`` or ``[1, D]`` in the rotated space (None = no centring); ``k_mean`` may also be per
            position, ``[B or 1, H_kv, T, D]`` (recipe ``quant.key_mean: rope``).
        objective: ``mean`` (the relative output error) or ``topk`` (the error on each query's ``topk_keys``
            most attended INT2 keys; module docstring). :meth:`key_error` / :meth:`value_error` score with it,
            :meth:`mean_value_error` always with ``mean``.
        k_subspace: ``[N, D, m]`` (recipe ``quant.key_subspace``): the INT2 keys keep their coordinates along it
            in BF16 and quantize the rest (:func:`oscar_cli.quant.key_subspace.fake_subspace`); None = off.
    """

    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        k_rotation: torch.Tensor | None, v_rotation: torch.Tensor | None,
        k_mean: torch.Tensor | None, v_mean: torch.Tensor | None, scaling: float, sink: int, recent: int,
        group_size: int | None, meta_dtype: str, objective: str = "mean", topk_keys: int = 8,
        inner: float = UNIFORM_INNER, k_subspace: torch.Tensor | None = None,
    ) -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        b, hq, tq, d = q.shape
        h_kv, t = k.shape[1], k.shape[2]
        g = hq // h_kv
        dev = q.device
        rk, rv = head_rotations(k_rotation, h_kv, d, dev), head_rotations(v_rotation, h_kv, d, dev)
        mk = torch.zeros(1, d, device=dev) if k_mean is None else k_mean.to(dev, torch.float32)
        mv = torch.zeros(1, d, device=dev) if v_mean is None else v_mean.to(dev, torch.float32)
        qg = q.float().reshape(b, h_kv, g * tq, d)  # query head j -> KV head j // g; rows (j % g, position)
        self.q = torch.einsum("bhtd,hde->bhte", qg, rk)
        # a per-position mean does not cancel in the softmax as a constant one does: the logits add it back
        self.k_shift = mk if mk.dim() == 4 else None
        self.k = torch.einsum("bhtd,hde->bhte", k.float(), rk) - (mk if mk.dim() == 4 else mk[:, None])
        self.v = torch.einsum("bhtd,hde->bhte", v.float(), rv) - mv[:, None]
        self.mu_v = mv.expand(h_kv, d)[None, :, None]  # [1, H_kv, 1, D]
        self.scaling = scaling
        self.group_size, self.meta, self.inner = group_size, META_DTYPES[meta_dtype], inner
        self.k_subspace = k_subspace  # [N, D, m]: keys' coordinates along it stay BF16 (quant.key_subspace)
        self.int2 = int2_pair_mask(t, tq, sink, recent, dev).repeat(g, 1)  # [g·Tq, T]
        causal = torch.arange(t, device=dev)[None, :] <= torch.arange(t - tq, t, device=dev)[:, None]
        self.neg = torch.zeros(tq, t, device=dev).masked_fill(~causal, float("-inf")).repeat(g, 1)
        self.logits = self._logits(self.k)
        p = torch.softmax(self.logits, -1)
        self.out = p @ self.v  # exact output, centred rotated space [B, H_kv, g·Tq, D]
        self.norm = float((self.out + self.mu_v).square().sum())
        self.p_k = p  # attention with quantized keys (set by set_key_ratio); starts exact
        self.objective = objective
        if objective == "topk":
            self._init_topk(p, topk_keys)
        self._split()

    def _init_topk(self, p: torch.Tensor, topk_keys: int) -> None:
        """The mask of each query's ``topk_keys`` INT2 keys of largest exact weight and their exact output."""
        k = max(1, min(topk_keys, p.shape[-1]))
        masked = p.masked_fill(~self.int2, -1.0)  # BF16-tier and future keys never rank
        top = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, masked.topk(k, dim=-1).indices, True)
        self.top = top & self.int2
        self.v_full = self.v + self.mu_v  # un-centred values: a shift of mass changes the served output
        self.top_out = (p * self.top) @ self.v_full
        self.top_norm = float(self.top_out.square().sum())

    @property
    def has_int2(self) -> bool:
        return bool(self.int2.any())

    def _logits(self, k: torch.Tensor) -> torch.Tensor:
        """Logits of centred keys ``k``: a constant mean shifts each query's logits alike (softmax-invariant), a
        per-position mean is added back."""
        if self.k_shift is not None:
            k = k + self.k_shift
        return (self.q @ k.transpose(-1, -2)) * self.scaling + self.neg

    def _fake(self, x: torch.Tensor, ratio: float) -> torch.Tensor:
        return fake_quantize(x, ratio, self.group_size, self.meta, self.inner)

    def _error(self, out_hat: torch.Tensor) -> float:
        return float((out_hat - self.out).square().sum()) / max(self.norm, 1e-30)

    def _top_error(self, probs: torch.Tensor, values: torch.Tensor) -> float:
        out_hat = (probs * self.top) @ values
        return float((out_hat - self.top_out).square().sum()) / max(self.top_norm, 1e-30)

    def _fake_keys(self, ratio: float) -> torch.Tensor:
        """The INT2 keys as the cache serves them: with a key subspace its coordinates BF16, the residual INT2."""
        return fake_subspace(self.k, self.k_subspace, lambda x: self._fake(x, ratio), torch.bfloat16)

    def _probs_with_keys(self, ratio: float) -> torch.Tensor:
        lq = self._logits(self._fake_keys(ratio))
        return torch.softmax(torch.where(self.int2, lq, self.logits), -1)

    def key_error(self, ratio: float) -> float:
        """Output error (under the objective) with keys quantized at ``ratio`` (INT2 tier only), exact values."""
        if self.objective == "topk":
            return self._top_error(self._probs_with_keys(ratio), self.v_full)
        return self._error(self._probs_with_keys(ratio) @ self.v)

    def set_key_ratio(self, ratio: float) -> None:
        """Fix the key clip ratio for the value search."""
        self.p_k = self._probs_with_keys(ratio)
        self._split()

    def _split(self) -> None:
        self._p_int2 = self.p_k * self.int2  # attention mass on INT2 keys
        self._exact_part = (self.p_k - self._p_int2) @ self.v  # output from the BF16 tiers

    def value_error(self, ratio: float) -> float:
        """Output error (under the objective) with keys at the chosen ratio and values quantized at ``ratio``
        (INT2 tier only)."""
        if self.objective == "topk":
            return self._top_error(self.p_k, self._fake(self.v, ratio) + self.mu_v)
        return self.mean_value_error(ratio)

    def mean_value_error(self, ratio: float) -> float:
        """:meth:`value_error` under the ``mean`` objective, whatever the problem's objective."""
        return self._error(self.served_output(ratio))

    def served_output(self, ratio: float) -> torch.Tensor:
        """The tiered output with keys at the ratio of :meth:`set_key_ratio` and INT2-tier values at ``ratio``,
        centred and rotated like :attr:`out` (``[B, H_kv, g·Tq, D]``; add :attr:`mu_v` and apply ``R_Vᵀ`` for
        the model's output)."""
        return self._p_int2 @ self._fake(self.v, ratio) + self._exact_part


def head_rotations(r: torch.Tensor | None, h_kv: int, d: int, device: torch.device) -> torch.Tensor:
    """``[H_kv, D, D]`` float32 on ``device``: ``r`` (``[N, D, D]``, ``N`` 1 or ``H_kv``) per KV head, identity for
    None."""
    if r is None:
        return torch.eye(d, device=device).expand(h_kv, d, d)
    return r.to(device, torch.float32).expand(h_kv, d, d)


def fake_quantize(x: torch.Tensor, ratio: float, group_size: int | None, meta: torch.dtype,
                  inner: float = UNIFORM_INNER) -> torch.Tensor:
    """``oscar_kernels.reference.fake_quantize_rows`` on already rotated, centred rows, minus the pack/unpack
    round trip (lossless): clip → ``quantize_int2`` → ``zero + code·scale`` in float32 (``zero + L[code]·scale``
    with a non-uniform inner level, recipe ``quant.levels``). ``x [..., D]``."""
    from oscar_kernels.reference import clip_rows, dequantize_codes, quantize_int2

    codes, scale, zero = quantize_int2(clip_rows(x, ratio), group_size, meta, inner)
    return dequantize_codes(codes, scale, zero, torch.float32, inner)


def _argmin(errors: dict[float, float]) -> float:
    best = min(errors.values())
    return next(r for r, e in errors.items() if e == best)


def search_clip(problems: list[LayerClipProblem], k_grid: tuple[float, ...], v_grid: tuple[float, ...]) -> ClipChoice:
    """Coordinate search over the grids under the problems' objective; errors are averaged over the layer's
    held-out sequences. The choice's ``error`` is the mean objective at the chosen ratios."""
    k_err = {r: 0.0 for r in k_grid}
    for p in problems:
        for r in k_grid:
            k_err[r] += p.key_error(r) / len(problems)
    k_best = _argmin(k_err)
    v_err = {r: 0.0 for r in v_grid}
    for p in problems:
        p.set_key_ratio(k_best)
        for r in v_grid:
            v_err[r] += p.value_error(r) / len(problems)
    v_best = _argmin(v_err)
    if all(p.objective == "mean" for p in problems):
        error = v_err[v_best]
    else:  # the keys are still at k_best (set_key_ratio above)
        error = sum(p.mean_value_error(v_best) / len(problems) for p in problems)
    return ClipChoice(k_best, v_best, k_err, v_err, error)


def evaluate_clip(problems: list[LayerClipProblem], k_ratio: float, v_ratio: float) -> ClipChoice:
    """The objective of fixed (global) ratios, for the record."""
    choice = search_clip(problems, (k_ratio,), (v_ratio,))
    return choice
