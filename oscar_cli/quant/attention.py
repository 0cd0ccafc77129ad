"""The registered attention implementation ``oscar_int2`` (transformers ``AttentionInterface``).

Registering the name in **both** ``AttentionInterface`` and ``AttentionMaskInterface`` matters: a name missing
from the mask interface makes transformers skip mask creation and silently drop causal masking.

Per call (one decoder layer), with ``key``/``value`` as returned by :class:`oscar_cli.quant.cache.Int2Cache`
(rotated; on the reference path and for prefill chunks a transient dense ``[B, H_kv, T, D]`` of the tiers):

1. **run time**: ``q <- q·R_K`` (post-RoPE; query head ``j`` uses the rotation of KV head ``j // g``), float32
   then cast back to the activation dtype (the per-query-head matrices are expanded for the call from the
   ``[N, D, D]`` rotation the runtime keeps, so only ``N`` matrices per layer stay allocated);
2. softmax attention through transformers' own ``sdpa_attention_forward`` (same masks, GQA handling and
   numerics as the stock ``sdpa`` path — the BF16 method is token-for-token the plain model);
3. **run time only when not folded**: ``o <- o·R_Vᵀ`` per query head. By default
   :func:`oscar_cli.quant.runtime.use_method` folds ``R_V`` into ``v_proj`` and ``R_Vᵀ`` into ``o_proj``
   (exact per-head block fold in float32), and this step is skipped.

With a logit correction (recipe ``quant.logit_correction: scale``; reference path) step 2 adds
:func:`logit_bias` to the mask: each INT2 key's logit loses half its estimated error variance.

The per-layer rotations live on the attention module as ``module._oscar_runtime`` (:class:`LayerRuntime`);
a module without it (a model not inside ``use_method``) runs plain SDPA.
On the Triton path a decode step of an INT2 layer returns only the new token from ``cache.update``; this
function then runs :meth:`oscar_cli.quant.int2_layer.Int2Layer.kernel_attention` (``oscar_kernels.ops.decode_attention``
on the layer's pages; the kernel applies ``R_K`` to q itself) instead of steps 1-2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

ATTN_NAME = "oscar_int2"


@dataclass
class LayerRuntime:
    """Run-time transforms of one attention module.

    Attributes:
        q_rotation: ``R_K`` as calibrated, ``[N, D, D]`` float32 (``N = 1`` or ``H_kv``), or None.
        out_rotation: ``R_Vᵀ`` ``[N, D, D]`` float32 when not folded, or None.

    :func:`rotate_heads` maps them onto the query heads per call (:func:`per_head`).
    """

    q_rotation: torch.Tensor | None = None
    out_rotation: torch.Tensor | None = None
    session: Any = None  # the MethodSession that attached it


def per_head(r: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``[N, D, D]`` -> ``[n_heads, D, D]`` (``N = 1`` broadcast, or ``N`` KV heads repeated ``g`` times)."""
    if r.shape[0] == n_heads:
        return r
    if n_heads % r.shape[0]:
        raise ValueError(f"rotation has {r.shape[0]} heads, cannot map onto {n_heads}")
    return r.repeat_interleave(n_heads // r.shape[0], dim=0)


def rotate_heads(x: torch.Tensor, r: torch.Tensor, head_axis: int) -> torch.Tensor:
    """``x @ R`` per head in float32, cast back to ``x.dtype``.

    Args:
        x: ``[B, H, T, D]`` (``head_axis=1``) or ``[B, T, H, D]`` (``head_axis=2``).
        r: ``[D, D]``, or ``[N, D, D]`` with ``N`` dividing ``H`` (head ``j`` uses matrix ``j // (H / N)``).
    """
    x32 = x.float()
    r = r.to(device=x.device, dtype=torch.float32)
    if r.dim() == 3:
        r = per_head(r, int(x.shape[head_axis]))
    if r.dim() == 2:
        return (x32 @ r).to(x.dtype)
    eq = "bhtd,hde->bhte" if head_axis == 1 else "bthd,hde->bthe"
    return torch.einsum(eq, x32, r).to(x.dtype)


def logit_bias(query: torch.Tensor, scale2: torch.Tensor, scaling: float) -> torch.Tensor:
    """Per-key additive logit bias of the ``scale`` correction: ``-σ²_ij / 2`` with
    ``σ²_ij = scaling² · Σ_g ‖q_i,g‖² · s_j,g² / 12``.

    A key quantized to INT2 with step ``s`` per group carries a rounding error of variance ``s²/12`` per element
    (uniform, ignoring clipping), so its logit ``scaling·q·k̂`` has error variance ``σ²_ij`` for query ``i`` in the
    rotated space, and ``E[exp(logit)]`` is ``exp(σ²/2)`` too large: subtracting ``σ²/2`` removes that inflation
    (docs/RESULTS.md, "Logit-variance correction"). BF16 keys have ``s = 0`` and get no bias.

    Args:
        query: rotated queries ``[B, H_q, Tq, D]``.
        scale2: squared key scales ``[B, H_kv, T, D/G]`` (0 on BF16 slots); ``H_q`` a multiple of ``H_kv``.
        scaling: the softmax scale (``1/√D``).

    Returns:
        ``float32 [B, H_q, Tq, T]``.
    """
    b, hq, tq, d = query.shape
    groups = scale2.shape[-1]
    q2 = query.float().square().reshape(b, hq, tq, groups, d // groups).sum(-1)  # [B, H_q, Tq, groups]
    s2 = scale2.float().repeat_interleave(hq // scale2.shape[1], dim=1)  # [B, H_q, T, groups]
    return (-(scaling**2) / 24.0) * (q2 @ s2.transpose(-1, -2))


def _with_bias(mask: torch.Tensor | None, bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive float mask: ``bias`` where ``mask`` allows (bool), ``bias + mask`` (float), or causal with the
    queries at the end of the keys when ``mask`` is None (what SDPA's ``is_causal`` would do after a cache)."""
    bias = bias.to(dtype)
    low = torch.finfo(dtype).min
    if mask is None:
        tq, tk = bias.shape[-2:]
        if tq == 1:
            return bias
        allow = torch.arange(tk, device=bias.device)[None, :] <= torch.arange(tk - tq, tk, device=bias.device)[:, None]
        return torch.where(allow, bias, low)
    mask = mask[..., : bias.shape[-1]]
    if mask.dtype == torch.bool:
        return torch.where(mask, bias, low)
    return bias + mask.to(dtype)


def oscar_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """AttentionInterface function: ``query [B, H_q, Tq, D]``, ``key``/``value [B, H_kv, T, D]`` (rotated).

    Returns ``(attn_output [B, Tq, H_q, D], None)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from oscar_cli.quant.int2_layer import current_kernel_layer, take_key_scale2

    rt: LayerRuntime | None = getattr(module, "_oscar_runtime", None)
    layer = current_kernel_layer()
    if layer is not None and layer.kernel_step and key is layer.kernel_key:
        out = layer.kernel_attention(query, key, value, scaling).transpose(1, 2)  # [B, 1, H_q, D]
        if rt is not None and rt.out_rotation is not None:
            out = rotate_heads(out, rt.out_rotation, head_axis=2)
        return out, None
    if rt is not None and rt.q_rotation is not None:
        query = rotate_heads(query, rt.q_rotation, head_axis=1)
    scale2 = take_key_scale2(key)
    if scale2 is not None:
        s = scaling if scaling is not None else float(getattr(module, "scaling", query.shape[-1] ** -0.5))
        attention_mask = _with_bias(attention_mask, logit_bias(query, scale2, s), query.dtype)
    out, weights = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    if rt is not None and rt.out_rotation is not None:
        out = rotate_heads(out, rt.out_rotation, head_axis=2)
    return out, weights


_registered = False


def register_attention() -> str:
    """Register ``oscar_int2`` in AttentionInterface and AttentionMaskInterface (idempotent); return the name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(ATTN_NAME, oscar_attention)
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
        _registered = True
    return ATTN_NAME
