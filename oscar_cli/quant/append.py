"""The base of every oscar cache layer (INT2, dense, KIVI): an append-only, full-attention transformers layer.

Its own module so the layer kinds (:mod:`oscar_cli.quant.cache`, :mod:`oscar_cli.quant.kivi`) share it without
importing each other.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin


class AppendLayer(CacheLayerMixin):
    """What every oscar cache layer shares: an append-only, unbounded, full-attention layer whose length is
    ``cumulative_length`` (``_layer_type`` unset on purpose: setting it would silently replace transformers'
    DynamicLayer for every ``DynamicCache(config=...)`` in the process)."""

    is_sliding = False
    is_croppable = False
    keys: torch.Tensor  # the dense view attention reads (set in lazy_initialization)
    values: torch.Tensor
    cumulative_length: int

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1
