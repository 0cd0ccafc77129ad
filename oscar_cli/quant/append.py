"""The base of every oscar cache layer (INT2, dense, KIVI): an append-only, full-attention transformers layer.

Its own module so the layer kinds (:mod:`oscar_cli.quant.int2_layer`, :mod:`oscar_cli.quant.dense`,
:mod:`oscar_cli.quant.kivi`) share it without importing each other.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin


class AppendLayer(CacheLayerMixin):
    """What every oscar cache layer shares: an append-only, unbounded, full-attention layer whose length is
    ``cumulative_length`` (``_layer_type`` unset on purpose: setting it would silently replace transformers'
    DynamicLayer for every ``DynamicCache(config=...)`` in the process)."""

    is_sliding = False
    is_croppable = False
    keys: torch.Tensor  # dense layers (bf16, KIVI) keep their KV here; Int2Layer leaves them unset
    values: torch.Tensor
    cumulative_length: int
    batch_size: int
    device: torch.device

    def __init__(self, method: Any) -> None:
        super().__init__()
        self.method = method
        self.cumulative_length = 0
        self.final_chunk = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Empty dense ``keys``/``values`` on the inputs' device and dtype (layers that store dense tensors)."""
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
        self.batch_size = int(key_states.shape[0])
        self.is_initialized = True

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.batch_select_indices(beam_idx.to(self.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.batch_select_indices(torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("an oscar cache cannot be cropped (quantized history is not reversible)")

    def kv_dims(self) -> tuple[int, int, int]:
        """``(B, H_kv, D)`` of the stored KV."""
        b, h, _, d = self.keys.shape
        return int(b), int(h), int(d)

    def allocated_bytes(self) -> int:
        """Bytes of the KV tensors the layer holds (attributes that are tensors or lists of tensors)."""
        total = 0
        for value in vars(self).values():
            items = value if isinstance(value, list) else [value]
            total += sum(int(t.nbytes) for t in items if isinstance(t, torch.Tensor))
        return total
