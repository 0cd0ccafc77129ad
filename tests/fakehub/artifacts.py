"""Tiny valid oscar artifacts for Hub tests (2 layers, D = 16), built per docs/DESIGN.md "Artifact format v1".

``make_artifact(root, variant)`` returns a fresh directory; the same ``variant`` gives byte-identical files
(so an identical re-push can be tested), a different ``variant`` gives different rotations.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

D, LAYERS, H_KV = 16, 2, 2


def _tensors(variant: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + variant)
    out = {}
    for i in range(LAYERS):
        for kv in ("k", "v"):
            q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
            out[f"layers.{i}.{kv}_rotation"] = q.float().unsqueeze(0).contiguous()  # [N=1, D, D]
            out[f"layers.{i}.{kv}_mean"] = torch.zeros(1, D)  # [N, D]
            out[f"layers.{i}.{kv}_eigenvalues"] = torch.sort(torch.rand(1, D, generator=g)).values  # ascending
            out[f"layers.{i}.{kv}_clip"] = torch.tensor([0.05])  # [1]
    return out


def manifest_for(variant: int, files: dict[str, str]) -> dict:
    return {
        "format_version": 1,
        "oscar_version": "0.1.0",
        "model": {"reference": "smollm2-135m", "resolved": "sha256:" + "ab" * 32},
        "architecture": {
            "model_type": "llama", "num_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": H_KV,
            "head_dim": D, "rope_type": "default", "rope_theta": 10000.0, "max_position_embeddings": 2048,
        },
        "method": "oscar",
        "recipe": {"name": "tiny", "variant": variant},
        "quant": {"group_size": D, "meta_dtype": "bfloat16", "sink": 64, "recent": 256},
        "data": {"source": "synthetic", "sha256": "cd" * 32, "tokens": 4096},
        "seed": variant,
        "files": files,
        "created": "2026-11-30T00:00:00Z",
        "evaluation": [{"task": "niah_single_1", "ctx": 4096, "metric": "accuracy", "value": 0.96}],
    }


def make_artifact(root: Path, variant: int = 0) -> Path:
    """Write a tiny artifact into ``root / f"art-{variant}"`` and return its path."""
    path = Path(root) / f"art-{variant}"
    path.mkdir(parents=True, exist_ok=True)
    save_file(_tensors(variant), str(path / "rotations.safetensors"))
    (path / "recipe.yaml").write_text(f"name: tiny\nvariant: {variant}\n")
    files = {n: hashlib.sha256((path / n).read_bytes()).hexdigest() for n in ("recipe.yaml", "rotations.safetensors")}
    (path / "manifest.json").write_text(json.dumps(manifest_for(variant, files), indent=2) + "\n")
    (path / "README.md").write_text("# tiny oscar artifact (card completed by oscar export)\n")
    return path
