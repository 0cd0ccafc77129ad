"""One decoder layer's KV transform: what calibration solves, the artifact stores and the cache applies.

Every field is optional so the same type describes the data-free methods too: no rotation = identity, no mean
= no centring, a clip ratio ``<= 0`` = no clipping. Calibration fills every field; an artifact stores every
field (:mod:`oscar_cli.artifact.io`); the cache (:mod:`oscar_cli.quant.cache`) reads rotations, means and clips.

Example::

    t = LayerTransform(k_rotation=r_k, v_rotation=r_v, k_mean=mu_k, v_mean=mu_v, k_clip=0.96, v_clip=0.92)
    t.rotation_per_head("k", num_kv_heads)   # [H_kv, D, D] (a per-layer [1, D, D] is expanded)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

# How an artifact serves each layer (manifest ``calibration.layers[i].scheme``) -> the cache storage it needs.
# ``oscar``: the calibrated transform; ``identity`` / ``hadamard``: per-token INT2 after no rotation / a
# Sylvester Hadamard (the layer's tensors hold that transform); ``kivi``: KIVI-style per-channel keys with its
# own BF16 residual; ``bf16``: the layer is not quantized. Artifacts without the field are ``oscar`` everywhere.
LayerStorage = Literal["dense", "int2", "kivi"]
LAYER_SCHEMES: dict[str, LayerStorage] = {"oscar": "int2", "identity": "int2", "hadamard": "int2", "kivi": "kivi", "bf16": "dense"}

TRANSFORM_FIELDS = ("k_rotation", "v_rotation", "k_mean", "v_mean", "k_eigenvalues", "v_eigenvalues", "k_clip", "v_clip")


@dataclass(frozen=True)
class LayerTransform:
    """One layer's rotations, rotated-space means and clip ratios (float32 tensors).

    Attributes:
        k_rotation, v_rotation: orthogonal ``[N, D, D]``, ``N = 1`` (per layer) or ``H_kv`` (per KV head),
            applied as ``x @ R``; None = identity.
        k_mean, v_mean: ``[H_kv, D]`` (or ``[1, D]`` shared by all heads) in the rotated space: subtracted after
            rotating; ``v_mean`` is added back to the attention output before rotating back with ``v_rotationᵀ``.
            None = no centring.
        k_eigenvalues, v_eigenvalues: ``[N, D]`` ascending eigenvalues of the calibration targets
            (informational; None for data-free transforms).
        k_clip, v_clip: clip ratios (``<= 0``: no clipping).
        k_subspace: ``[N, D, m]`` orthonormal directions of the rotated key space whose coordinates the cache
            keeps in BF16 (recipe ``quant.key_subspace``, :mod:`oscar_cli.quant.key_subspace`); None = off.
        k_mean_pre: ``[H_kv, D]`` pre-RoPE key mean, unrotated (recipe ``quant.key_mean: rope``,
            :mod:`oscar_cli.quant.key_mean`): INT2 keys at position ``p`` are centred by ``RoPE_p(k_mean_pre)·R_K``
            instead of ``k_mean``; None = off.
    """

    k_rotation: torch.Tensor | None = None
    v_rotation: torch.Tensor | None = None
    k_mean: torch.Tensor | None = None
    v_mean: torch.Tensor | None = None
    k_eigenvalues: torch.Tensor | None = None
    v_eigenvalues: torch.Tensor | None = None
    k_clip: float = 0.0
    v_clip: float = 0.0
    k_subspace: torch.Tensor | None = None
    k_mean_pre: torch.Tensor | None = None

    def rotation_per_head(self, which: str, num_kv_heads: int) -> torch.Tensor | None:
        """``[H_kv, D, D]`` rotations for ``which`` ∈ {"k", "v"} (a per-layer rotation is expanded; None: identity)."""
        r = self.k_rotation if which == "k" else self.v_rotation
        if r is None:
            return None
        return r.expand(num_kv_heads, -1, -1) if r.shape[0] == 1 else r

    def mean_per_head(self, which: str, num_kv_heads: int) -> torch.Tensor | None:
        """``[H_kv, D]`` rotated-space means for ``which`` ∈ {"k", "v"} (a shared ``[1, D]`` is expanded)."""
        m = self.k_mean if which == "k" else self.v_mean
        if m is None:
            return None
        return m.expand(num_kv_heads, -1) if m.shape[0] == 1 else m
