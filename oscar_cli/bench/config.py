"""What ``oscar bench`` measures: one :class:`BenchConfig` (shape, batches, contexts, cache layout, kernel knobs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from oscar_cli.bench.shapes import AttnShape
from oscar_kernels.layout import DEFAULT_RECENT, DEFAULT_SINK


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. Contexts count every token (sink + history + recent)."""

    shape: AttnShape
    batches: tuple[int, ...] = (1, 16)
    contexts: tuple[int, ...] = (4096, 32768, 131072)
    dtype: str = "bf16"
    page_size: int = 64
    sink: int = DEFAULT_SINK
    recent: int = DEFAULT_RECENT
    num_splits: int | None = None
    # DecodeConfig fields that replace ``oscar_kernels.ops.default_config(batch)``'s (``oscar bench --kernel``)
    kernel: tuple[tuple[str, Any], ...] = ()
    graphs: bool = True
    rep_ms: int = 100
    quant_tokens: int = 16384
    seed: int = 0
    paged: bool = True  # False: the non-paged layout [B, H_kv, T, D/4] (no block-table lookups)
    # "rope": the decode kernel adds the position-dependent key mean's per-key logit term itself (``quant.key_mean:
    # rope`` on the Triton path); "rope-gemm": each INT2 step first writes the term as a float32 [B, H_q, L] tensor
    # (one GEMM) that the kernel reads (the unfused form); "constant": the plain decode
    key_mean: str = "constant"
    # 4: every INT2 step reads keys at 4 bits (``quant.int4_keys`` layers): the pages' high plane plus the low plane
    # (``oscar_kernels.ops.LowPlane``) in the same tile; 2: the plain INT2 keys
    key_bits: int = 2
    # 8: every INT2 step reads formula 10's bytes (``quant.meta_dtype: uint8``), decoded in the tile; 16: bfloat16
    meta_bits: int = 16

    @property
    def activation_dtype(self) -> torch.dtype:
        """The torch dtype of q, the BF16 tiers and the output (``dtype``: ``bf16`` or ``fp16``)."""
        return torch.bfloat16 if self.dtype == "bf16" else torch.float16
