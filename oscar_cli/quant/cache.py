"""oscar's transformers ``Cache``: one layer per decoder layer, of the kind the method stores there.

- :class:`~oscar_cli.quant.int2_layer.Int2Layer`: the tiered, paged INT2 layer (sink, INT2 history pages,
  recent; reference or Triton path), the module docstring there describes placement and what attention sees;
- :class:`~oscar_cli.quant.kivi.KiviLayer`: the ``kivi-2`` baseline;
- :class:`~oscar_cli.quant.dense.DenseLayer`: the ``bf16`` method.

:class:`Int2Cache` adds what spans layers: per-row left padding, prefill chunk marks, the position limit, and the
storage totals.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.cache_utils import Cache

from oscar_cli.errors import OscarError
from oscar_cli.quant.dense import DenseLayer
from oscar_cli.quant.int2_layer import Int2Layer
from oscar_cli.quant.key_mean import RopeTable
from oscar_cli.quant.methods import QuantMethod
from oscar_cli.quant.pages import DEFAULT_PAGE

__all__ = ["DenseLayer", "Int2Cache", "Int2Layer"]


class Int2Cache(Cache):
    """``Cache(layers=[...])`` with one :class:`Int2Layer` (or KIVI / dense layer) per decoder layer.

    Args:
        method: the :class:`QuantMethod` every layer follows.
        num_layers: decoder layers of the model.
        rotate_values: True when ``R_V`` is applied here at run time (not folded into ``v_proj``).
        backend: ``reference``, ``triton`` or ``auto`` (see :class:`Int2Layer`).
        page_size: tokens per INT2 history page.
        max_positions: the model's position limit (an update beyond it raises, naming the limit).
        rope_table: the model's RoPE, for INT2 layers that centre keys by position (``quant.key_mean: rope``).
    """

    def __init__(
        self,
        method: QuantMethod,
        num_layers: int,
        rotate_values: bool = False,
        backend: str = "reference",
        *,
        page_size: int = DEFAULT_PAGE,
        max_positions: int | None = None,
        rope_table: RopeTable | None = None,
    ) -> None:
        from oscar_cli.quant.kivi import KiviLayer

        layers: list[Any] = []
        for i in range(num_layers):  # a layer may be stored differently from the method (QuantMethod.for_layer)
            m = method.for_layer(i)
            if m.kind == "kivi":
                layers.append(KiviLayer(m))
            elif m.kind == "dense":
                layers.append(DenseLayer(m))
            else:
                layers.append(Int2Layer(m, method.layer(i), rotate_values, backend, layer_idx=i, page_size=page_size,
                                        rope_table=rope_table))
        super().__init__(layers=layers)
        self.method = method
        self.max_positions = max_positions
        self.padding_set = False
        self.oscar_layers: list[Any] = layers  # the same objects, typed for our own attributes

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == 0 and self.max_positions:
            total = self.get_seq_length() + int(key_states.shape[-2])
            if total > self.max_positions:
                raise OscarError(
                    f"context of {total} tokens is beyond the model's {self.max_positions} positions",
                    hint="shorten the prompt or generate fewer tokens",
                )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def path(self) -> str:
        """``triton`` or ``reference`` (the INT2 layers, after their first update; ``+`` joins several), or the
        method kind when no layer is INT2."""
        paths = sorted({layer.path for layer in self.oscar_layers if isinstance(layer, Int2Layer)})
        return "+".join(paths) if paths else self.method.kind

    def set_padding(self, left_pad: list[int] | torch.Tensor | None) -> None:
        """Declare per-row left padding before the first forward of a batch.

        The BF16 sink then spans slots ``[0, S0 + max_pad)``: every row keeps at least its first ``S0`` real
        tokens in BF16 (a row with less padding keeps up to ``max_pad`` more). With batch 1 the layout is
        exactly docs/METHOD.md §7's. Pad tokens are never stored in the INT2 pages. KIVI layers use the padding to keep
        pad slots out of the per-channel ranges.
        """
        pads = [] if left_pad is None else [int(p) for p in left_pad]
        for layer in self.oscar_layers:
            if hasattr(layer, "set_padding"):
                layer.set_padding(pads)
            elif isinstance(layer, Int2Layer):
                sink = layer.method.sink
                layer.sink_slots = sink + (max(pads) if pads and sink > 0 else 0)
                layer.pads = pads
        self.padding_set = True

    @contextmanager
    def chunk(self, final: bool) -> Iterator[None]:
        """Mark the forward inside as one prefill chunk (non-final chunks keep no BF16 recent part)."""
        for layer in self.oscar_layers:
            layer.final_chunk = final
        try:
            yield
        finally:
            for layer in self.oscar_layers:
                layer.final_chunk = True

    def storage_bytes(self) -> int:
        """Bytes stored over all layers (tiers in use)."""
        return sum(layer.storage_bytes() for layer in self.oscar_layers)

    def allocated_bytes(self) -> int:
        """Bytes of every tensor the cache holds (buffer and pool capacity included)."""
        return sum(layer.allocated_bytes() for layer in self.oscar_layers)

    def measured_bits_per_element(self) -> float:
        """Stored bits per K/V element: ``8 · bytes / (2 · layers · B · H_kv · T · D)``."""
        first = self.oscar_layers[0]
        if not first.is_initialized or self.get_seq_length() == 0:
            return float("nan")
        b, h, d = first.kv_dims()
        elements = 2 * len(self.oscar_layers) * b * h * self.get_seq_length() * d
        return 8.0 * self.storage_bytes() / elements
