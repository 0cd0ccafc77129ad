"""A transformers ``Cache`` whose layers really store the KV history as packed INT2 (serving-faithful).

Per decoder layer (:class:`Int2Layer`), keys and values live in three tiers (DESIGN.md "INT2 format v1"):

- **sink**: slots ``[0, S)`` in the activation dtype, ``S = S0`` (+ the batch's largest left padding, see
  :meth:`Int2Cache.set_padding`);
- **history**: packed INT2 — ``packed uint8 [B, H_kv, T_h, D/4]``, ``scale``/``zero`` 16-bit
  ``[B, H_kv, T_h, D/G]`` — written by :func:`oscar_kernels.reference.quantize_rows` (rotate → centre → clip →
  quantize → pack);
- **recent**: the newest ``W .. W+7`` tokens in the activation dtype.

All tiers hold **rotated** K (``k·R_K``, post-RoPE, computed here at run time in float32 and cast to the
activation dtype: a key rotation cannot be folded into ``k_proj`` because RoPE sits between) and rotated V
(``v·R_V``: folded into ``v_proj`` by :func:`oscar_cli.quant.runtime.use_method`, or applied here at run time
when folding is off).

Placement (method.md §7, §9.5):

- a prefill chunk (``q_len > 1``) first fills the sink; a **non-final** chunk sends everything else to INT2;
  a final chunk keeps its last ``W`` tokens in the recent tier and quantizes the rest;
- a decode step (``q_len == 1``) appends to recent; when recent reaches ``W + 8`` tokens the 8 oldest are
  demoted to INT2 in one block, so recent oscillates between ``W`` and ``W + 7``. Without a recent window
  (``W = 0``) every token is quantized on arrival.

What attention sees (``update`` returns it): the layer's earlier tokens as stored (sink and recent as is,
history dequantized: ``zero + code·scale``, plus the centring mean, cast to the activation dtype) followed by
the **new tokens unquantized** — so a chunk attends to earlier chunks through the quantized cache and to itself
at full precision, and a decode step sees sink + INT2 history + recent.

Reference-path note: the layer keeps ``view_k``/``view_v``, a dense copy of exactly that (the dequantized
history is written once, when a token is demoted) so a step costs no re-dequantization; it is derived data,
always equal to dequantizing the packed store (tests check it bitwise). :meth:`Int2Layer.storage_bytes`
counts only what a server stores: sink + packed history + metadata + recent.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers.cache_utils import Cache

from oscar_cli.quant.append import AppendLayer
from oscar_cli.quant.methods import LayerTransform, QuantMethod


def rotation_matrix(r: torch.Tensor | None) -> torch.Tensor | None:
    """Normalise a ``[N, D, D]`` rotation for :func:`oscar_kernels.reference.rotate` (``N = 1`` -> ``[D, D]``)."""
    if r is None:
        return None
    if r.dim() == 3 and r.shape[0] == 1:
        return r[0]
    return r


class Int2Layer(AppendLayer):
    """One decoder layer's tiered cache (dense or per-token INT2). See the module docstring."""

    def __init__(
        self, method: QuantMethod, transform: LayerTransform, rotate_values: bool = True, backend: str = "reference"
    ) -> None:
        super().__init__()
        self.method = method
        self.backend = backend  # "triton": the write path uses oscar_kernels.ops.quantize_rows (bitwise twin)
        self.transform = transform
        self.k_rot = rotation_matrix(transform.k_rotation)
        self.v_rot = rotation_matrix(transform.v_rotation) if rotate_values else None
        self.cumulative_length = 0
        self.sink_slots = method.sink
        self.pads: list[int] = []  # left padding per row (set by Int2Cache.set_padding)
        self.final_chunk = True
        self.quantize = method.kind == "int2"
        self.n_sink = 0
        self.n_hist = 0
        self.sink_k: torch.Tensor | None = None
        self.sink_v: torch.Tensor | None = None
        self.recent_k: torch.Tensor | None = None
        self.recent_v: torch.Tensor | None = None
        self.k_mean: torch.Tensor | None = None  # on the cache's device, set in lazy_initialization
        self.v_mean: torch.Tensor | None = None
        self.hist_k: list[torch.Tensor] = []  # [packed, scale, zero] once non-empty
        self.hist_v: list[torch.Tensor] = []
        self._v_quads: torch.Tensor | None = None  # hist_v codes in token quads (the decode kernel's layout)
        self._v_quads_len = 0

    # ---------------------------------------------------------------- transformers API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        b, h, _, d = key_states.shape
        empty = key_states.new_zeros(b, h, 0, d)
        self.keys = empty
        self.values = value_states.new_zeros(b, h, 0, value_states.shape[-1])
        self.sink_k, self.sink_v = empty, self.values
        self.recent_k, self.recent_v = empty, self.values
        self.batch_size = b
        self.is_initialized = True
        dev = key_states.device  # move the transforms once, not on every call
        self.k_rot = None if self.k_rot is None else self.k_rot.to(dev)
        self.v_rot = None if self.v_rot is None else self.v_rot.to(dev)
        self.k_mean = None if self.transform.k_mean is None else self.transform.k_mean.to(dev)
        self.v_mean = None if self.transform.v_mean is None else self.transform.v_mean.to(dev)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens (placement + demotion) and return ``[stored earlier tokens | new tokens]``.

        Args:
            key_states: post-RoPE keys ``[B, H_kv, T_new, D]`` (unrotated).
            value_states: ``[B, H_kv, T_new, D]`` (already rotated when ``R_V`` is folded into ``v_proj``).

        Returns:
            keys, values ``[B, H_kv, T_prev + T_new, D]`` in the activation dtype, rotated.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k = self._rotate(key_states, self.k_rot)
        v = self._rotate(value_states, self.v_rot)
        prior = self.cumulative_length
        n = k.shape[-2]
        self.keys = torch.cat([self.keys, k], dim=-2)
        self.values = torch.cat([self.values, v], dim=-2)
        self.cumulative_length += n
        first_quantized = self._place(k, v, decode=n == 1)
        if first_quantized is not None and first_quantized < prior + n:
            return torch.cat([self.keys[..., :prior, :], k], -2), torch.cat([self.values[..., :prior, :], v], -2)
        return self.keys, self.values

    # ---------------------------------------------------------------- placement
    def _rotate(self, x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
        if r is None:
            return x
        from oscar_kernels.reference import rotate

        return rotate(x, r).to(x.dtype)

    def _place(self, k: torch.Tensor, v: torch.Tensor, decode: bool) -> int | None:
        """Put new rotated tokens in their tiers; return the first slot demoted to INT2 (None: none)."""
        assert self.sink_k is not None and self.sink_v is not None
        assert self.recent_k is not None and self.recent_v is not None
        if not self.quantize:
            return None
        take = max(0, min(self.sink_slots - self.n_sink, k.shape[-2]))
        if take:
            self.sink_k = torch.cat([self.sink_k, k[..., :take, :]], -2)
            self.sink_v = torch.cat([self.sink_v, v[..., :take, :]], -2)
            self.n_sink += take
        self.recent_k = torch.cat([self.recent_k, k[..., take:, :]], -2)
        self.recent_v = torch.cat([self.recent_v, v[..., take:, :]], -2)
        w, block = self.method.recent, self.method.demotion_block
        n_recent = self.recent_k.shape[-2]
        if decode:
            demote = ((n_recent - w) // block) * block if n_recent >= w + block else 0
        else:
            demote = max(0, n_recent - w) if self.final_chunk else n_recent
        if demote <= 0:
            return None
        first = self.n_sink + self.n_hist
        self._demote(demote)
        return first

    def _demote(self, m: int) -> None:
        """Quantize the ``m`` oldest recent tokens into the INT2 history (reference write path)."""
        from oscar_kernels.reference import QuantizedRows, dequantize_rows

        assert self.recent_k is not None and self.recent_v is not None
        t = self.transform
        start = self.n_sink + self.n_hist
        for name, rows, mean, clip in (
            ("k", self.recent_k[..., :m, :], self.k_mean, t.k_clip),
            ("v", self.recent_v[..., :m, :], self.v_mean, t.v_clip),
        ):
            mean_d = mean
            q = self._quantize(rows, mean_d, clip)
            store = self.hist_k if name == "k" else self.hist_v
            if store:
                store[:] = [torch.cat([a, b], -2) for a, b in zip(store, (q.packed, q.scale, q.zero), strict=True)]
            else:
                store[:] = [q.packed, q.scale, q.zero]
            deq = dequantize_rows(QuantizedRows(q.packed, q.scale, q.zero), torch.float32)
            if mean_d is not None:
                deq = deq + (mean_d.float().unsqueeze(-2) if mean_d.dim() == 2 else mean_d.float())
            view = self.keys if name == "k" else self.values
            view[..., start : start + m, :] = deq.to(view.dtype)
        self.recent_k = self.recent_k[..., m:, :]
        self.recent_v = self.recent_v[..., m:, :]
        self.n_hist += m

    def _quantize(self, rows: torch.Tensor, mean: torch.Tensor | None, clip: float) -> Any:
        """Reference write path, or its Triton twin (``backend="triton"``, CUDA or ``TRITON_INTERPRET=1``)."""
        from oscar_kernels.reference import quantize_rows

        meth = self.method
        kernel_ok = rows.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
        if self.backend == "triton" and kernel_ok and rows.shape[-1] % 16 == 0:
            from oscar_kernels import ops

            m = None if mean is None else (mean.reshape(-1) if mean.shape[0] == 1 else mean).float().contiguous()
            return ops.quantize_rows(rows.contiguous(), None, m, clip, meth.group_size, meth.meta_dtype)
        return quantize_rows(rows, None, mean, clip, meth.group_size, meth.meta_dtype)

    def value_quads(self) -> torch.Tensor:
        """The packed value history in token quads ``uint8 [B, H_kv, ⌈T/64⌉·D, 16]`` (rows of 64 tokens; what the
        decode kernel reads).

        The serving layout of values (``oscar_kernels.reference.pack_token_quads``), kept next to the row layout
        this cache stores and converted incrementally: only the 64-token rows touched since the last call are rebuilt.
        """
        from oscar_kernels.reference import TOKEN_QUAD_ROW, rows_to_token_quads

        packed = self.hist_v[0]
        n = packed.shape[-2]
        if self._v_quads is None or n < self._v_quads_len:
            self._v_quads, self._v_quads_len = rows_to_token_quads(packed), n
        elif n > self._v_quads_len:
            keep = self._v_quads_len // TOKEN_QUAD_ROW  # whole rows already final
            tail = rows_to_token_quads(packed[..., TOKEN_QUAD_ROW * keep :, :])
            d = 4 * int(packed.shape[-1])
            self._v_quads = torch.cat([self._v_quads[..., : keep * d, :], tail], -2)
            self._v_quads_len = n
        return self._v_quads

    # ---------------------------------------------------------------- inspection
    def history(self, which: str = "k") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The packed history ``(packed, scale, zero)`` of keys (``"k"``) or values (``"v"``), or None."""
        store = self.hist_k if which == "k" else self.hist_v
        return (store[0], store[1], store[2]) if store else None

    def tier_sizes(self) -> tuple[int, int, int]:
        """``(sink, history, recent)`` token counts (dense layers report everything as recent)."""
        if not self.quantize:
            return 0, 0, self.cumulative_length
        n_recent = 0 if self.recent_k is None else self.recent_k.shape[-2]
        return self.n_sink, self.n_hist, n_recent

    def storage_bytes(self) -> int:
        """Bytes a server stores for this layer: sink + packed history + scale/zero + recent (K and V)."""
        if not self.is_initialized:
            return 0
        if not self.quantize:
            assert self.keys is not None and self.values is not None
            return int(self.keys.nbytes + self.values.nbytes)
        tensors = [self.sink_k, self.sink_v, self.recent_k, self.recent_v, *self.hist_k, *self.hist_v]
        return int(sum(x.nbytes for x in tensors if x is not None))

    # ---------------------------------------------------------------- batch operations
    def _tensors(self) -> list[str]:
        return ["keys", "values", "sink_k", "sink_v", "recent_k", "recent_v"]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for name in self._tensors():
            x = getattr(self, name)
            if x is not None:
                setattr(self, name, x[indices, ...])
        self.hist_k = [x[indices, ...] for x in self.hist_k]
        self.hist_v = [x[indices, ...] for x in self.hist_v]
        self._v_quads, self._v_quads_len = None, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.batch_select_indices(beam_idx.to(self.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        for name in self._tensors():
            x = getattr(self, name)
            if x is not None:
                setattr(self, name, x.repeat_interleave(repeats, dim=0))
        self.hist_k = [x.repeat_interleave(repeats, dim=0) for x in self.hist_k]
        self.hist_v = [x.repeat_interleave(repeats, dim=0) for x in self.hist_v]
        self._v_quads, self._v_quads_len = None, 0

    def reset(self) -> None:
        self.__init__(self.method, self.transform, self.v_rot is not None, self.backend)  # type: ignore[misc]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("an INT2 cache cannot be cropped (quantized history is not reversible)")


class Int2Cache(Cache):
    """``Cache(layers=[...])`` with one :class:`Int2Layer` (or KIVI layer) per decoder layer.

    Args:
        method: the :class:`QuantMethod` every layer follows.
        num_layers: decoder layers of the model.
        rotate_values: True when ``R_V`` is applied here at run time (not folded into ``v_proj``).
    """

    def __init__(
        self, method: QuantMethod, num_layers: int, rotate_values: bool = False, backend: str = "reference"
    ) -> None:
        layers: list[Any]
        if method.kind == "kivi":
            from oscar_cli.quant.kivi import KiviLayer

            layers = [KiviLayer(method) for _ in range(num_layers)]
        else:
            layers = [Int2Layer(method, method.layer(i), rotate_values, backend) for i in range(num_layers)]
        super().__init__(layers=layers)
        self.method = method
        self.oscar_layers: list[Any] = layers  # the same objects, typed for our own attributes

    def set_padding(self, left_pad: list[int] | torch.Tensor | None) -> None:
        """Declare per-row left padding before the first forward of a batch.

        The BF16 sink then spans slots ``[0, S0 + max_pad)``: every row keeps at least its first ``S0`` real
        tokens in BF16 (a row with less padding keeps up to ``max_pad`` more). With batch 1 the layout is
        exactly method.md's. KIVI layers use the padding to keep pad slots out of the per-channel ranges.
        """
        pads = [] if left_pad is None else [int(p) for p in left_pad]
        for layer in self.oscar_layers:
            if hasattr(layer, "set_padding"):
                layer.set_padding(pads)
            elif isinstance(layer, Int2Layer):
                layer.sink_slots = self.method.sink + (max(pads) if pads and self.method.sink > 0 else 0)
                layer.pads = pads

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
        """Bytes stored over all layers (what a server would hold)."""
        return sum(layer.storage_bytes() for layer in self.oscar_layers)

    def measured_bits_per_element(self) -> float:
        """Stored bits per K/V element: ``8 · bytes / (2 · layers · B · H_kv · T · D)``."""
        first = self.oscar_layers[0]
        if not first.is_initialized or self.get_seq_length() == 0:
            return float("nan")
        b, h, _, d = first.keys.shape
        elements = 2 * len(self.oscar_layers) * b * h * self.get_seq_length() * d
        return 8.0 * self.storage_bytes() / elements
