"""KIVI-2 (Liu et al., 2024) as a cache layer: keys per channel, values per token, BF16 residual.

The quantizer is KIVI's asymmetric min-max 2-bit scheme written in oscar's INT2 conventions (round half up
from the stored 16-bit scale and zero, ``x_hat = zero + code·scale``, quarter packing):

- **keys**: per channel over blocks of ``G_T = 128`` consecutive tokens — block ``[B, H_kv, 128, D]`` is
  transposed to ``[B, H_kv, D, 128]`` and each channel row gets one (scale, zero); codes are packed along
  the token axis (``uint8 [B, H_kv, n_blocks, D, 32]``). The key residual holds the ``L mod 128`` newest
  tokens; when it reaches 128 they are quantized as one block (KIVI's key rule).
- **values**: per token, groups of ``G = min(D, 128)`` channels, through
  :func:`oscar_kernels.reference.quantize_rows` (no rotation, no clip); the value residual keeps exactly the
  128 newest tokens (KIVI's value rule: the oldest leaves the residual each step once it is full).
- no sink, no rotation. Left-padded rows: pad slots are excluded from a key block's per-channel ranges.

Attention sees, like :class:`oscar_cli.quant.int2_layer.Int2Layer`, the stored earlier tokens followed by the
new tokens unquantized.
"""

from __future__ import annotations

from typing import Any

import torch

from oscar_cli.quant.append import AppendLayer
from oscar_cli.quant.bits import KIVI_GROUP, KIVI_RESIDUAL
from oscar_cli.quant.methods import QuantMethod


def quantize_channels(
    x: torch.Tensor, valid: torch.Tensor | None, meta_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel INT2 of one token block.

    Args:
        x: ``[B, H_kv, T, D]`` with ``T`` a multiple of 4 (128 in KIVI).
        valid: bool ``[B, T]`` (False = pad slot, left out of min/max) or None.
        meta_dtype: scale/zero dtype.

    Returns:
        ``packed uint8 [B, H_kv, D, T/4]``, ``scale``/``zero`` ``meta_dtype [B, H_kv, D, 1]``.
    """
    from oscar_kernels.reference import pack_int2

    y = x.float().transpose(-1, -2)  # [B, H, D, T]
    if valid is None:
        mn, mx = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
    else:
        m = valid[:, None, None, :]
        mn = torch.where(m, y, torch.full_like(y, float("inf"))).amin(-1, keepdim=True)
        mx = torch.where(m, y, torch.full_like(y, float("-inf"))).amax(-1, keepdim=True)
        empty = ~torch.isfinite(mn)
        mn = torch.where(empty, torch.zeros_like(mn), mn)
        mx = torch.where(empty, torch.zeros_like(mx), mx)
    s = torch.clamp(mx - mn, min=1e-8) / 3.0
    if meta_dtype == torch.uint8:
        raise ValueError("KIVI keeps 16-bit (or float32) scale/zero; 8-bit metadata is for per-token INT2 rows")
    scale, zero = s.to(meta_dtype), mn.to(meta_dtype)
    codes = torch.floor((y - zero.float()) / scale.float() + 0.5).clamp_(0, 3).to(torch.uint8)
    return pack_int2(codes), scale, zero


def dequantize_channels(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_channels`: float32 ``[B, H_kv, T, D]``."""
    from oscar_kernels.reference import unpack_int2

    y = zero.float() + unpack_int2(packed).float() * scale.float()
    return y.transpose(-1, -2)


class KiviLayer(AppendLayer):
    """One decoder layer of a KIVI-2 cache."""

    def __init__(self, method: QuantMethod) -> None:
        super().__init__(method)
        self.pads: list[int] = []
        self.nk_q = 0  # quantized key tokens (multiple of 128)
        self.nv_q = 0  # quantized value tokens
        self.k_blocks: list[torch.Tensor] = []  # [packed, scale, zero], block axis 2
        self.v_hist: list[torch.Tensor] = []  # [packed, scale, zero]

    def set_padding(self, pads: list[int]) -> None:
        self.pads = list(pads)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new tokens (KIVI rules) and return ``[stored earlier tokens | new tokens unquantized]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        prior = self.cumulative_length
        self.keys = torch.cat([self.keys, key_states], -2)
        self.values = torch.cat([self.values, value_states], -2)
        self.cumulative_length += key_states.shape[-2]
        touched = False
        while self.cumulative_length - self.nk_q >= KIVI_GROUP:
            self._quantize_key_block()
            touched = touched or self.nk_q > prior
        n_v = self.cumulative_length - KIVI_RESIDUAL - self.nv_q
        if n_v > 0:
            self._quantize_values(n_v)
            touched = touched or self.nv_q > prior
        if touched:
            return (
                torch.cat([self.keys[..., :prior, :], key_states], -2),
                torch.cat([self.values[..., :prior, :], value_states], -2),
            )
        return self.keys, self.values

    def _valid(self, start: int, n: int) -> torch.Tensor | None:
        if not self.pads or max(self.pads) <= start:
            return None
        pos = torch.arange(start, start + n, device=self.device)
        pads = torch.tensor(self.pads, device=self.device)
        return pos[None, :] >= pads[:, None]

    def _quantize_key_block(self) -> None:
        s = self.nk_q
        block = self.keys[..., s : s + KIVI_GROUP, :]
        packed, scale, zero = quantize_channels(block, self._valid(s, KIVI_GROUP), self.method.meta_dtype)
        parts = (packed.unsqueeze(2), scale.unsqueeze(2), zero.unsqueeze(2))
        if self.k_blocks:
            self.k_blocks = [torch.cat([a, b], 2) for a, b in zip(self.k_blocks, parts, strict=True)]
        else:
            self.k_blocks = list(parts)
        self.keys[..., s : s + KIVI_GROUP, :] = dequantize_channels(packed, scale, zero).to(self.keys.dtype)
        self.nk_q += KIVI_GROUP

    def _quantize_values(self, n: int) -> None:
        from oscar_kernels.reference import dequantize_rows, quantize_rows

        s = self.nv_q
        d = self.values.shape[-1]
        g = self.method.group_size or min(d, KIVI_GROUP)
        q = quantize_rows(self.values[..., s : s + n, :], None, None, 0.0, g, self.method.meta_dtype)
        parts = (q.packed, q.scale, q.zero)
        if self.v_hist:
            self.v_hist = [torch.cat([a, b], -2) for a, b in zip(self.v_hist, parts, strict=True)]
        else:
            self.v_hist = list(parts)
        self.values[..., s : s + n, :] = dequantize_rows(q, self.values.dtype)
        self.nv_q += n

    def tier_sizes(self) -> tuple[int, int, int]:
        """``(sink, quantized keys, key residual)`` token counts."""
        return 0, self.nk_q, self.cumulative_length - self.nk_q

    def storage_bytes(self) -> int:
        """Packed keys/values + metadata + the BF16 key and value residuals."""
        if not self.is_initialized:
            return 0
        per_tok_k = self.keys[:, :, :1, :].nbytes
        per_tok_v = self.values[:, :, :1, :].nbytes
        dense = (self.cumulative_length - self.nk_q) * per_tok_k + (self.cumulative_length - self.nv_q) * per_tok_v
        return int(dense + sum(x.nbytes for x in self.k_blocks) + sum(x.nbytes for x in self.v_hist))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.keys, self.values = self.keys[indices], self.values[indices]
        self.k_blocks = [x[indices] for x in self.k_blocks]
        self.v_hist = [x[indices] for x in self.v_hist]
        if self.pads:
            self.pads = [self.pads[int(i)] for i in indices.tolist()]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self.batch_select_indices(beam_idx.to(self.device))

    def reset(self) -> None:
        self.__init__(self.method)  # type: ignore[misc]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a KIVI cache cannot be cropped (quantized history is not reversible)")
