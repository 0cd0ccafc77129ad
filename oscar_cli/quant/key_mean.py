"""The position-dependent key mean: INT2 keys centred by ``RoPE_p(m_pre)`` instead of one constant mean.

Why: a layer whose keys have a large mean before RoPE (Qwen2.5's ``k_proj`` bias) has, after RoPE, a mean that
turns with the position ``p``: ``E[k_p] = RoPE_p(m_pre)``. The constant centring mean (``layers.{i}.k_mean``)
is the average of ``RoPE_p(m_pre)`` over the calibration positions, so beyond them the centred keys keep a
growing component, each token's INT2 range grows with it, and so does its error (measured:
``scripts/key_mean_drift.py``, docs/RESULTS.md "Why 32K"). Centring each key by the mean at its own position
removes that component at every position, also beyond the calibration's sequence length.

Recipe ``quant.key_mean: rope`` (default ``constant``). Calibration estimates per KV head the pre-RoPE key mean
``m_pre = mean_p RoPE_p⁻¹(k_p)`` from the post-RoPE keys it captures (:func:`unrope`; this also undoes YaRN's
attention scaling), stored unrotated as ``layers.{i}.k_mean_pre`` ``[H_kv, D]``; the clip search and the cache
centre the rotated key at position ``p`` by ``RoPE_p(m_pre)·R_K`` (:func:`position_means`), computed with the
model's own rotary embedding at run time (:class:`RopeTable`: the same cos/sin, YaRN included). No storage per
token: the BPE is unchanged.

Positions: the cache places row ``b``'s slot ``t`` at RoPE position ``t - pad_b`` (left padding), the positions
``oscar_cli.quant.generation`` and ``model.generate`` give. RoPE is the ``rotate_half`` form of Llama, Qwen2,
Qwen3 and Mistral. Served by the reference path, the Triton path (the decode kernel adds the mean's logit term per
key itself, ``oscar_kernels.ops.RopeMean``) and the vLLM backend (``oscar_cli.vllm.core``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch

from oscar_cli.errors import OscarError

if TYPE_CHECKING:
    from oscar_cli.quant.methods import QuantMethod

KeyMean = Literal["constant", "rope"]
KEY_MEANS: tuple[str, ...] = ("constant", "rope")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(-x2, x1)`` for ``x = (x1, x2)`` split at ``D/2`` (the RoPE pairing of Llama / Qwen)."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x·cos + rotate_half(x)·sin`` (what the model applies to its keys), broadcasting over leading dims."""
    return x * cos + rotate_half(x) * sin


def unrope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rope`: ``(k·cos - rotate_half(k)·sin) / (cos² + sin²)`` (float32).

    ``cos² + sin²`` is per channel the square of the rotary embedding's attention scaling (1 for plain RoPE,
    YaRN's ``mscale²``), so a mean estimated under YaRN is the same pre-RoPE mean as one estimated without."""
    k, cos, sin = k.float(), cos.float(), sin.float()
    return (k * cos - rotate_half(k) * sin) / (cos.square() + sin.square())


def pre_rope_mean(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Sum over batch and positions of the pre-RoPE keys, ``float64 [H_kv, D]``, for post-RoPE
    ``k [B, H_kv, T, D]`` at positions whose ``cos, sin`` are ``[B or 1, T, D]``."""
    return unrope(k, cos[:, None], sin[:, None]).double().sum(dim=(0, 2))


def position_means(
    m_pre: torch.Tensor, rotation: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """``RoPE_p(m_pre)·R_K`` per position: ``float32 [B, H_kv, n, D]``.

    Args:
        m_pre: ``[H_kv, D]`` pre-RoPE key means (unrotated).
        rotation: ``[N, D, D]`` key rotation (``N`` 1 or ``H_kv``; None = identity), applied as ``x @ R``.
        cos, sin: ``[B, n, D]`` of the positions (:class:`RopeTable`).
    """
    m = m_pre.to(cos.device, torch.float32)[None, :, None, :]
    mu = rope(m, cos.float()[:, None], sin.float()[:, None])  # [B, H, n, D]
    if rotation is None:
        return mu
    r = rotation.to(cos.device, torch.float32)
    r = r.expand(mu.shape[1], -1, -1) if r.shape[0] == 1 else r
    return torch.einsum("bhnd,hde->bhne", mu, r)


class RopeTable:
    """cos/sin of the model's own RoPE frequencies for given positions, from float64 angles, read from its rotary
    embedding at each call (so a RoPE switched later, e.g. YaRN by :func:`oscar_cli.model.rope.apply_yarn`, is
    the one used): ``inv_freq`` and ``attention_scaling`` (YaRN's mscale).

    ``table(positions)`` with ``positions`` int64 ``[B, n]`` → ``(cos, sin)`` float32 ``[B, n, D]``
    (``oscar_kernels.reference.rope_cos_sin``: the definition the cache's writes, its reads and the decode
    kernel's logit term share). They differ from the model's float32 angles by at most half an ulp of ``θ·p``;
    the first use of a rotary embedding checks they match it (a RoPE whose frequencies change with the length,
    e.g. dynamic NTK, is refused there). :meth:`kernel_table` gives the decode path's position table.
    """

    def __init__(self, model: Any) -> None:
        from oscar_cli.calibration.capture import decoder_body

        self.body = decoder_body(model)
        rotary = getattr(self.body, "rotary_emb", None)
        if rotary is None or not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
            raise OscarError(f"{type(model).__name__} has no rotary embedding with inv_freq at "
                             "model.model.rotary_emb: quant.key_mean rope needs the model's RoPE",
                             hint="use quant.key_mean: constant for this model")
        self._checked: tuple[int, int, float] | None = None
        self._tables: dict[str, Any] = {}

    def frequencies(self) -> tuple[torch.Tensor, float]:
        """``(inv_freq [D/2], attention scaling)`` of the rotary embedding now (checked once per embedding)."""
        rotary = self.body.rotary_emb
        inv = rotary.inv_freq
        scaling = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)
        key = (id(inv), int(inv._version), scaling)
        if key != self._checked:
            _check_fixed_frequencies(rotary, inv, scaling)
            self._checked, self._tables = key, {}
        return inv, scaling

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from oscar_kernels.reference import rope_cos_sin

        inv, scaling = self.frequencies()
        return rope_cos_sin(inv, scaling, positions.long())

    def kernel_table(self, positions: int, device: torch.device) -> torch.Tensor:
        """``oscar_kernels.ops.position_table`` covering positions ``[0, positions)`` on ``device`` (kept and grown
        by doubling: one build per few steps, not per step; every layer shares it)."""
        from oscar_kernels.rope_ops import position_table

        inv, _ = self.frequencies()
        have = self._tables.get(str(device))
        if have is None or int(have.shape[0]) < positions:
            size = max(int(positions), 2 * (int(have.shape[0]) if have is not None else 0), 4096)
            have = self._tables[str(device)] = position_table(inv, size, device)
        return have


def _check_fixed_frequencies(rotary: Any, inv: torch.Tensor, scaling: float) -> None:
    """The model's rotary embedding is ``scaling·cos/sin(inv_freq·p)`` at a few positions up to 4096 (its float32
    angles are off by at most ``4096·2^-24`` rad there)."""
    from oscar_kernels.reference import rope_cos_sin

    pos = torch.tensor([[0, 1, 2, 3, 7, 64, 100, 1000, 2047, 4095]], device=inv.device)
    like = torch.zeros((), dtype=torch.float32, device=inv.device)
    with torch.no_grad():
        cos, sin = rotary(like, pos)
    want_cos, want_sin = rope_cos_sin(inv, scaling, pos)
    err = max(float((cos.float() - want_cos).abs().max()), float((sin.float() - want_sin).abs().max()))
    if not err <= 1e-3 * max(scaling, 1.0):
        raise OscarError(f"the model's rotary embedding is not a fixed-frequency RoPE: its cos/sin differ from "
                         f"attention_scaling·cos/sin(inv_freq·p) by {err:.3g} (e.g. a RoPE whose frequencies change "
                         "with the length)", hint="use quant.key_mean: constant for this model")


def with_scaled_constant_mean(method: QuantMethod, factor: float) -> QuantMethod:
    """``method`` with every layer's constant key mean ``k_mean`` times ``factor``: what it becomes when the model's
    rotary embedding scales cos/sin by ``factor`` relative to the one it was calibrated under (YaRN's attention
    factor over plain RoPE). Post-RoPE keys are ``a·RoPE_p(k_pre)``, so their mean scales with ``a``; left as it
    was, the mean misses ``(a - 1)·E[k]`` in every key, which on a model with large key means (Qwen2.5's ``k_proj``
    bias) dominates the INT2 error (docs/RESULTS.md, "A constant key mean under YaRN"). A ``rope`` mean
    (``k_mean_pre``) needs no change: :class:`RopeTable` reads the scaling at run time."""
    from dataclasses import replace

    layers = tuple(t if t.k_mean is None else replace(t, k_mean=t.k_mean * factor) for t in method.layers)
    return replace(method, layers=layers)

