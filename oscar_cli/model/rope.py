"""RoPE scaling beyond a model's native positions: YaRN, chosen by the caller or sized for the longest context.

:func:`plan_yarn` decides the factor (or refuses in one line); :func:`apply_yarn` switches a loaded
transformers model to YaRN in place (``rope_parameters`` + a rebuilt rotary embedding). Evaluations and
calibration take the same ``--rope-scaling yarn --rope-factor F`` options, so an artifact can be calibrated
under the RoPE it is evaluated with.

The automatic factor is the smallest integer ``F >= 2`` with ``F × native >= longest`` (Qwen2.5 documents
``F = 4`` for 128K on its 32K models, which this rule gives). Factors above :data:`MAX_YARN_FACTOR` (32, the
largest the YaRN paper evaluated: LLaMA 2 from 4K to 128K) are refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from oscar_cli.errors import OscarError
from oscar_cli.model.geometry import ModelGeometry

MAX_YARN_FACTOR = 32.0
ROPE_SCALINGS = ("yarn",)


def native_positions(config: Any) -> int:
    """The positions a config was trained for (YaRN's ``original_max_position_embeddings`` once applied)."""
    params = getattr(config, "rope_parameters", None) or {}
    original = params.get("original_max_position_embeddings") if isinstance(params, dict) else None
    return int(original or getattr(config, "max_position_embeddings", 0) or 0)


def rope_type(config: Any) -> str:
    """``default`` for plain RoPE, else the config's ``rope_type`` (``yarn``, ``llama3``, ...)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    kind = params.get("rope_type", params.get("type")) if isinstance(params, dict) else None
    return str(kind or "default")


def rotary_frequencies(config: Any) -> tuple[torch.Tensor, float]:
    """``(inv_freq float32 [D/2], attention scaling)`` of the rotary embedding a transformers model builds from
    ``config``: plain RoPE from its ``rope_theta`` and head dim (scaling 1), the scaled kinds (YaRN, llama3, linear,
    ...) through transformers' own RoPE initialisation, the functions its rotary embeddings call."""
    kind = rope_type(config)
    if kind == "default":
        geo = ModelGeometry.of(config)
        theta = geo.rope_theta if geo.rope_theta is not None else 10000.0
        d = geo.head_dim
        return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS.get(kind)
    if init is None:
        raise OscarError(f"{kind} RoPE: transformers has no initialisation for it", hint="use plain RoPE or YaRN")
    inv, scaling = init(config, None)
    return inv.float().cpu(), float(scaling)


def attention_scaling(config: Any) -> float:
    """The factor the rotary embedding of ``config`` multiplies cos/sin by (YaRN's attention factor ``0.1·ln F + 1``
    unless the config sets another; 1 for plain RoPE): :func:`rotary_frequencies`' second half."""
    return 1.0 if rope_type(config) == "default" else rotary_frequencies(config)[1]


def plan_yarn(
    native: int, longest: int, rope_scaling: str | None, factor: float | None, *, auto: bool = True, what: str = "--ctx"
) -> float | None:
    """The YaRN factor to apply, or None for none.

    Args:
        native: the model's positions (0: unknown, nothing is checked).
        longest: the longest context (tokens) the run needs.
        rope_scaling: ``"yarn"`` or None (decide from the lengths).
        factor: ``--rope-factor`` (None: sized for ``longest``).
        auto: with ``rope_scaling`` None, apply YaRN when ``longest > native`` (False refuses instead).
        what: the option named in messages.

    Raises:
        OscarError: one line for an unknown scaling, a factor <= 1 or above :data:`MAX_YARN_FACTOR`, a
            context beyond ``native × factor``, or (``auto`` False) a context beyond ``native``.
    """
    if rope_scaling is not None and rope_scaling not in ROPE_SCALINGS:
        raise OscarError(f"unknown --rope-scaling {rope_scaling!r}; supported: {', '.join(ROPE_SCALINGS)}")
    if factor is not None and rope_scaling is None:
        rope_scaling = "yarn"
    if rope_scaling is None:
        if not native or longest <= native:
            return None
        if not auto:
            raise OscarError(
                f"{what} {longest} is beyond the model's context of {native} tokens (--no-rope-scaling)",
                hint=f"drop --no-rope-scaling to run under YaRN (factor {auto_factor(native, longest):g}), or use {what} {native}",
            )
        factor = auto_factor(native, longest)
    elif factor is None:
        factor = auto_factor(native, longest) if native else 2.0
    if factor <= 1:
        raise OscarError(f"--rope-factor {factor:g}: YaRN needs a factor above 1")
    if factor > MAX_YARN_FACTOR:
        raise OscarError(
            f"{what} {longest} needs YaRN factor {factor:g} over the model's {native} positions; "
            f"YaRN is supported up to factor {MAX_YARN_FACTOR:g} ({int(native * MAX_YARN_FACTOR)} tokens here)",
            hint=f"use {what} {int(native * MAX_YARN_FACTOR)} or less",
        )
    if native and longest > native * factor:
        raise OscarError(
            f"{what} {longest} is beyond {native} × {factor:g} = {int(native * factor)} positions of YaRN",
            hint=f"use --rope-factor {auto_factor(native, longest):g}",
        )
    return float(factor)


def auto_factor(native: int, longest: int) -> float:
    """The smallest integer factor >= 2 that covers ``longest``."""
    return float(max(2, math.ceil(longest / native)))


def apply_yarn(model: Any, factor: float) -> None:
    """Switch ``model`` (a transformers causal LM with plain RoPE) to YaRN with ``factor`` in place.

    Raises:
        OscarError: the model already uses another RoPE scaling (``llama3``, ``yarn``, ...).
    """
    cfg = model.config
    current = rope_type(cfg)
    if current != "default":
        raise OscarError(f"the model already uses {current} RoPE scaling; YaRN applies only over plain RoPE")
    native = native_positions(cfg)
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    cfg.rope_parameters = {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": native,
        "rope_theta": theta,
    }
    cfg.max_position_embeddings = int(native * factor)
    base = getattr(model, "model", model)
    rotary = base.rotary_emb
    base.rotary_emb = type(rotary)(config=cfg).to(next(model.parameters()).device)  # recompute inv_freq (YaRN)


def yarn_for_run(
    model: Any,
    longest: int,
    rope_scaling: str | None,
    factor: float | None,
    *,
    auto: bool = True,
    what: str = "--ctx",
    span: str | None = None,
) -> tuple[float | None, str | None]:
    """Plan YaRN for a run over ``longest`` tokens (:func:`plan_yarn`), apply it to ``model``, and word its note.

    Args:
        model: a loaded transformers causal LM (changed in place when YaRN applies).
        longest: the longest sequence (tokens) the run needs.
        rope_scaling, factor, auto, what: as :func:`plan_yarn`.
        span: how the note names ``longest`` (default ``"{what} {longest}"``).

    Returns:
        ``(factor, note)``: the factor applied and the one note to show, or ``(None, None)`` for plain RoPE.
    """
    native = native_positions(model.config)
    planned = plan_yarn(native, longest, rope_scaling, factor, auto=auto, what=what)
    if planned is None:
        return None, None
    apply_yarn(model, planned)
    span = span or f"{what} {longest}"
    why = f"{span} is beyond the model's {native} positions" if longest > native else "asked"
    return planned, (
        f"YaRN factor {planned:g} ({why}): every method and length runs with RoPE scaled to "
        f"{int(native * planned)} positions (--no-rope-scaling refuses instead)"
    )
