"""The registered attention implementation ``oscar_int2`` (transformers ``AttentionInterface``).

Registering the name in **both** ``AttentionInterface`` and ``AttentionMaskInterface`` matters: a name missing
from the mask interface makes transformers skip mask creation and silently drop causal masking.

Per call (one decoder layer), with ``key``/``value`` as returned by :class:`oscar_cli.quant.cache.Int2Cache`
(rotated, tiers already merged into one dense ``[B, H_kv, T, D]`` view):

1. **run time**: ``q <- q·R_K`` (post-RoPE; query head ``j`` uses the rotation of KV head ``j // g``), float32
   then cast back to the activation dtype;
2. softmax attention through transformers' own ``sdpa_attention_forward`` (same masks, GQA handling and
   numerics as the stock ``sdpa`` path — the BF16 method is token-for-token the plain model);
3. **run time only when not folded**: ``o <- o·R_Vᵀ`` per query head. By default
   :func:`oscar_cli.quant.runtime.use_method` folds ``R_V`` into ``v_proj`` and ``R_Vᵀ`` into ``o_proj``
   (exact per-head block fold in float32), and this step is skipped.

The per-layer rotations live on the attention module as ``module._oscar_runtime`` (:class:`LayerRuntime`);
a module without it (a model not inside ``use_method``) runs plain SDPA.
The Triton decode path (``oscar_kernels.ops``) plugs in behind this same function.
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
        q_rotation: ``[H_q, D, D]`` or ``[D, D]`` float32 (``R_K`` per query head), or None.
        out_rotation: ``[H_q, D, D]`` or ``[D, D]`` float32 (``R_Vᵀ`` per query head) when not folded, or None.
    """

    q_rotation: torch.Tensor | None = None
    out_rotation: torch.Tensor | None = None
    backend: str = "reference"
    session: Any = None  # the MethodSession (its ``active`` cache feeds the Triton decode path)


def rotate_heads(x: torch.Tensor, r: torch.Tensor, head_axis: int) -> torch.Tensor:
    """``x @ R`` per head in float32, cast back to ``x.dtype``.

    Args:
        x: ``[B, H, T, D]`` (``head_axis=1``) or ``[B, T, H, D]`` (``head_axis=2``).
        r: ``[D, D]`` or ``[H, D, D]``.
    """
    x32 = x.float()
    r = r.to(device=x.device, dtype=torch.float32)
    if r.dim() == 2:
        return (x32 @ r).to(x.dtype)
    eq = "bhtd,hde->bhte" if head_axis == 1 else "bthd,hde->bthe"
    return torch.einsum(eq, x32, r).to(x.dtype)


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

    rt: LayerRuntime | None = getattr(module, "_oscar_runtime", None)
    if rt is not None and rt.backend == "triton" and query.shape[2] == 1:
        fast = kernel_decode(module, query, rt, scaling)
        if fast is not None:
            return fast, None
    if rt is not None and rt.q_rotation is not None:
        query = rotate_heads(query, rt.q_rotation, head_axis=1)
    out, weights = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    if rt is not None and rt.out_rotation is not None:
        out = rotate_heads(out, rt.out_rotation, head_axis=2)
    return out, weights


def kernel_decode(
    module: torch.nn.Module, query: torch.Tensor, rt: LayerRuntime, scaling: float | None
) -> torch.Tensor | None:
    """One decode step through ``oscar_kernels.ops.decode_attention_contiguous``, or None when it does not apply.

    Applies to per-token INT2 layers with a recent window (the new token sits in it), ``G = D``, a full sink
    and a non-empty history, and a bf16/fp16 query on CUDA (or on CPU under ``TRITON_INTERPRET=1``). In a
    left-padded batch each row's real sink tokens are gathered to the front and ``sink_len`` excludes the pads.
    The kernel rotates ``q`` with ``R_K`` itself and reads the BF16 tiers **centred** like the INT2 tier, so
    the tiers are centred here; it returns ``o + mu_V`` in the rotated value space, then ``R_Vᵀ`` is applied
    by the folded ``o_proj`` (or below, at run time, when not folded). Same result as the reference path
    within the kernel error budget.
    """
    import os

    from oscar_cli.quant.cache import Int2Layer, rotation_matrix

    cache = getattr(rt.session, "active", None)
    if cache is None or query.dtype not in (torch.bfloat16, torch.float16):
        return None
    if not (query.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    layer = cache.oscar_layers[int(module.layer_idx)]  # type: ignore[arg-type]
    d = int(query.shape[-1])
    if not isinstance(layer, Int2Layer) or not layer.quantize or layer.n_hist == 0 or layer.method.recent == 0:
        return None
    if layer.method.group_size not in (None, d) or layer.n_sink < layer.sink_slots:
        return None
    from oscar_kernels.ops import decode_attention_contiguous
    from oscar_kernels.reference import QuantizedRows

    def centred(x: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor:
        if mean is None:
            return x.contiguous()
        m = mean.unsqueeze(-2) if mean.dim() == 2 else mean
        return (x.float() - m).to(x.dtype).contiguous()

    assert layer.sink_k is not None and layer.sink_v is not None
    assert layer.recent_k is not None and layer.recent_v is not None
    sink_k, sink_v = layer.sink_k, layer.sink_v
    sink_len: torch.Tensor | None = None
    if layer.sink_slots != layer.method.sink:  # left-padded batch: move each row's real sink tokens to the front
        s = layer.sink_slots
        pads = torch.tensor(layer.pads, device=query.device)
        idx = (pads[:, None] + torch.arange(s, device=query.device)[None, :]).clamp(max=s - 1)  # [B, S]
        gather = idx[:, None, :, None].expand(-1, sink_k.shape[1], -1, d)
        sink_k, sink_v = sink_k.gather(2, gather), sink_v.gather(2, gather)
        sink_len = (s - pads).to(torch.int32)
    rot_k = rotation_matrix(layer.transform.k_rotation)
    out = decode_attention_contiguous(
        query.contiguous(),
        QuantizedRows(*layer.hist_k),
        QuantizedRows(layer.value_quads(), layer.hist_v[1], layer.hist_v[2]),
        centred(sink_k, layer.k_mean),
        centred(sink_v, layer.v_mean),
        centred(layer.recent_k, layer.k_mean),
        centred(layer.recent_v, layer.v_mean),
        sink_len=sink_len,
        rotation_k=None if rot_k is None else rot_k.to(query.device).float().contiguous(),
        mean_v=None if layer.v_mean is None else layer.v_mean.float().reshape(-1, d).squeeze(0).contiguous(),
        sm_scale=scaling,
    )  # [B, H_q, 1, D], rotated value space
    out = out.transpose(1, 2)
    if rt.out_rotation is not None:
        out = rotate_heads(out, rt.out_rotation, head_axis=2)
    return out


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
