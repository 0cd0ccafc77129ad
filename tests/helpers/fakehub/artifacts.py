"""Tiny valid oscar artifacts for Hub tests (2 layers, H_kv = 2, D = 16), written by the real ``write_artifact``.

``make_artifact(root, variant)`` returns ``root / f"art-{variant}"``; the same ``variant`` gives byte-identical
files (fixed ``created``, seeded tensors), so an identical re-push can be tested; another ``variant`` gives
other rotations (a new version).
"""

from __future__ import annotations

from pathlib import Path

import torch

from oscar_cli.artifact import Manifest, write_artifact
from oscar_cli.transform import LayerTransform

D, LAYERS, H_KV = 16, 2, 2


def _layers(variant: int) -> list[LayerTransform]:
    g = torch.Generator().manual_seed(1000 + variant)
    out = []
    for _ in range(LAYERS):
        rot = {}
        for kv in ("k", "v"):
            q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
            rot[kv] = q.float().unsqueeze(0).contiguous()  # [N=1, D, D], orthogonal
        out.append(LayerTransform(
            k_rotation=rot["k"], v_rotation=rot["v"],
            k_mean=torch.zeros(H_KV, D), v_mean=torch.zeros(H_KV, D),  # [H_kv, D]
            k_eigenvalues=torch.sort(torch.rand(1, D, generator=g)).values,  # [N, D] ascending
            v_eigenvalues=torch.sort(torch.rand(1, D, generator=g)).values,
            k_clip=0.05, v_clip=0.0,
        ))
    return out


def make_manifest(variant: int) -> Manifest:
    return Manifest(
        oscar_version="0.1.0",
        model={"reference": "smollm2-135m", "resolved": "sha256:" + "ab" * 32},
        architecture={
            "model_type": "llama", "num_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": H_KV,
            "head_dim": D, "rope_type": "default", "rope_theta": 10000.0, "max_position_embeddings": 2048,
        },
        method="oscar",
        recipe={"name": "tiny", "data": {"seed": variant}},
        quant={"group_size": D, "meta_dtype": "bfloat16", "sink": 64, "recent": 256},
        data={"source": "synthetic", "sha256": "cd" * 32, "tokens": 4096},
        seed=variant,
        created="2026-11-30T00:00:00Z",
        evaluation=[{"task": "niah_single_1", "ctx": 4096, "metric": "accuracy", "value": 0.96}],
    )


def make_artifact(root: Path, variant: int = 0) -> Path:
    """Write a tiny artifact into ``root / f"art-{variant}"`` (replacing it) and return its path."""
    return write_artifact(
        Path(root) / f"art-{variant}", make_manifest(variant), _layers(variant),
        recipe_yaml=f"name: tiny\ndata:\n  seed: {variant}\n", overwrite=True,
    )
