"""The Triton path of :class:`~oscar_cli.quant.int2_layer.Int2Layer`: whether it can serve a layer, and the
tensors in the shapes ``oscar_kernels.ops`` takes (rotations, means, tiers with their pad slots dropped, centred).
"""

from __future__ import annotations

import os

import torch

from oscar_cli.quant.methods import QuantMethod

BACKENDS = ("auto", "reference", "triton")


def rotation_matrix(r: torch.Tensor | None) -> torch.Tensor | None:
    """Normalise a ``[N, D, D]`` rotation for :func:`oscar_kernels.reference.rotate` (``N = 1`` -> ``[D, D]``)."""
    if r is None:
        return None
    if r.dim() == 3 and r.shape[0] == 1:
        return r[0]
    return r


def kernel_unsupported(method: QuantMethod, x: torch.Tensor, interpreter_ok: bool = True) -> str | None:
    """Why the Triton path cannot serve this layer (None: it can)."""
    d = int(x.shape[-1])
    interp = interpreter_ok and os.environ.get("TRITON_INTERPRET") == "1"
    if not (x.is_cuda or interp):
        return f"the Triton kernels need a CUDA device, the model is on {x.device}"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"the decode kernel takes bfloat16/float16 activations, the model runs {x.dtype}"
    if d not in (64, 128):
        return f"the decode kernel takes head_dim 64 or 128, the model has {d}"
    if method.group_size not in (None, d):
        return f"the decode kernel needs group size G = head_dim, the method has G = {method.group_size}"
    return None


def flat_mean(m: torch.Tensor | None) -> torch.Tensor | None:
    """``[N, D]`` -> ``[D]`` (N = 1) or ``[H_kv, D]`` float32 contiguous, as the kernels take it."""
    if m is None:
        return None
    return (m.reshape(-1) if m.shape[0] == 1 else m).float().contiguous()


def front(tier: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """Per row ``b`` drop the first ``skip[b]`` slots of ``tier [B, H, T, D]`` (shift the rest to the front)."""
    if not bool((skip > 0).any()):
        return tier
    t = tier.shape[2]
    idx = (skip[:, None] + torch.arange(t, device=tier.device)[None, :]).clamp(max=t - 1)
    return tier.gather(2, idx[:, None, :, None].expand(-1, tier.shape[1], -1, tier.shape[3]))


def centred(x: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor:
    """``x - mean`` (``mean [D]`` or ``[H_kv, D]``) in float32, cast back to ``x``'s dtype, contiguous: the BF16
    tiers centred like the INT2 rows."""
    if mean is None:
        return x.contiguous()
    m = mean.unsqueeze(-2) if mean.dim() == 2 else mean
    return (x.float() - m).to(x.dtype).contiguous()
