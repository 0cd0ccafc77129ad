"""The ``bf16`` method's cache layer: every token kept in the activation dtype."""

from __future__ import annotations

from typing import Any

import torch

from oscar_cli.quant.append import AppendLayer


class DenseLayer(AppendLayer):
    """The ``bf16`` method: every token kept in the activation dtype (transformers' DynamicLayer, appended)."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], -2)
        self.values = torch.cat([self.values, value_states], -2)
        self.cumulative_length += int(key_states.shape[-2])
        return self.keys, self.values

    def tier_sizes(self) -> tuple[int, int, int]:
        return 0, 0, self.cumulative_length

    def storage_bytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes) if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys, self.values = self.keys[indices], self.values[indices]
            self.batch_size = int(self.keys.shape[0])

    def reset(self) -> None:
        self.__init__(self.method)  # type: ignore[misc]
