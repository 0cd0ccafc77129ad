"""One decoder layer of the INT2 cache: the KV history held only in the decode kernel's paged layout.

Per decoder layer (:class:`Int2Layer`), keys and values live in three tiers (DESIGN.md "INT2 format v1"):

- **sink**: slots ``[0, S)`` in the activation dtype, ``S = S0`` (+ the batch's largest left padding, see
  :meth:`~oscar_cli.quant.cache.Int2Cache.set_padding`), one ``[B, H_kv, S, D]`` buffer allocated once;
- **history**: packed INT2 pages from a :class:`~oscar_cli.quant.pages.PagePool` (keys quarter-packed rows,
  values token quads, 16-bit ``scale``/``zero``, a ragged block table; pad tokens are never stored), written by
  :func:`oscar_kernels.reference.quantize_rows` (reference path) or ``oscar_kernels.ops.quantize_write``
  (Triton path), bitwise the same rows;
- **recent**: the newest ``W .. W+7`` tokens in the activation dtype, one ``[B, H_kv, W + 8, D]`` buffer.
- **kept** (only with a keep budget, recipe ``quant.keep``): per sequence and KV head ``⌊f·n⌋`` of the ``n``
  history tokens, chosen by score when they are demoted, also held in the activation dtype; attention reads
  those rows instead of their INT2 copy (:mod:`oscar_cli.quant.keep`; reference path only, the Triton path
  refuses such a method).

With a non-uniform inner level (recipe ``quant.levels``, :attr:`QuantMethod.levels` other than 1/3) the history
rows are coded to the nearest of ``zero + scale·3·(0, a, 1 - a, 1)`` and dequantized with the same levels
(``oscar_kernels.reference`` formula 8), alike for prefill writes and decode demotion; reference path only, the
Triton path refuses such a method.

With a logit correction (recipe ``quant.logit_correction: scale``) the reference path also hands attention each
returned slot's squared key scales (zero for every BF16 slot: sink, recent, kept and new tokens), from which
:func:`oscar_cli.quant.attention.logit_bias` subtracts the INT2 keys' estimated logit-error variance over 2, alike in
prefill chunks (earlier chunks' INT2 history) and decode steps; reference path only, the Triton path refuses it.

With a key subspace (recipe ``quant.key_subspace: m``, :mod:`oscar_cli.quant.key_subspace`) each INT2 key row
stores only its residual off the layer's ``m`` subspace directions, and the ``m`` coefficients along them are kept
per history slot in bfloat16; what attention reads has exactly those coordinates (reference path only, the
Triton path refuses such a method).

With a position-dependent key mean (recipe ``quant.key_mean: rope``, :mod:`oscar_cli.quant.key_mean`) each INT2
key in slot ``t`` of row ``b`` is centred by ``RoPE_p(m_pre)·R_K`` at its position ``p = t - pad_b`` instead of the
constant ``k_mean``, computed with the model's rotary embedding (the cache's ``RopeTable``) when the row is
written and again when it is read; nothing is stored per token (the Triton path writes with one mean per row and its
decode kernel adds the mean's logit term itself, ``oscar_kernels.ops.RopeMean``).

With INT4 keys on this layer (recipe ``quant.int4_keys``, :attr:`QuantMethod.key_bits` 4) each history key is
coded at 4 bits without clip (``oscar_kernels.reference`` formula 9): the high INT2 plane and its scale/zero go to
the pages as any INT2 key row, the low plane (``uint8 [B, H_kv, cap, D/4]``, slot ``t`` of the history at index
``t``, pad slots zero) is kept beside them; attention reads ``zero + (4·hi + lo)·scale/4`` (the reference path; the
Triton path's decode kernel reads both: the high plane from the pages, the low plane beside them,
``oscar_kernels.ops.LowPlane``).

Nothing else persists: no dense copy of the history exists between calls.

All tiers hold **rotated** K (``k·R_K``, post-RoPE, computed here at run time in float32 and cast to the
activation dtype: a key rotation cannot be folded into ``k_proj`` because RoPE sits between) and rotated V
(``v·R_V``: folded into ``v_proj`` by :func:`oscar_cli.quant.runtime.attach`, or applied here at run time
when folding is off).

Placement (docs/METHOD.md §7):

- a prefill chunk (``q_len > 1``) first fills the sink; a **non-final** chunk sends everything else to INT2;
  a final chunk keeps its last ``W`` tokens in the recent tier and quantizes the rest;
- a decode step (``q_len == 1``) appends to recent; when recent reaches ``W + 8`` tokens the 8 oldest are
  demoted to INT2 in one block, so recent oscillates between ``W`` and ``W + 7``. Without a recent window
  (``W = 0``) every token is quantized on arrival.

What attention sees:

- **reference path** (and every prefill chunk): ``update`` returns the layer's earlier tokens as stored (sink and
  recent as is, history dequantized: ``zero + code·scale`` plus the centring mean, cast to the activation dtype)
  followed by the **new tokens unquantized**. That dense tensor is transient: built from the pages for this call
  and freed when the layer's attention returns (peak: one layer's ``[B, H_kv, T, D]`` K and V, DESIGN.md);
- **Triton path** decode step: ``update`` returns only the new tokens and the registered attention function runs
  ``oscar_kernels.ops.decode_attention`` on the pages and tiers (:meth:`Int2Layer.kernel_attention`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from oscar_cli.errors import OscarError
from oscar_cli.quant.append import AppendLayer
from oscar_cli.quant.keep import KeepTier, keep_count, token_scores
from oscar_cli.quant.kernel_path import BACKENDS, centred, flat_mean, front, kernel_unsupported, rotation_matrix
from oscar_cli.quant.key_mean import RopeTable
from oscar_cli.quant.key_subspace import coefficients, residual, restore
from oscar_cli.quant.methods import LayerTransform, QuantMethod
from oscar_cli.quant.pages import DEFAULT_PAGE, PagePool, unpack_rows
from oscar_kernels.layout import UNIFORM_INNER
from oscar_kernels.reference import meta_bits

log = logging.getLogger(__name__)
PIECE = 1024  # tokens quantized (prefill writes) or dequantized (what attention reads) at a time
_current = threading.local()  # the Int2Layer whose decode step the next attention call runs through the kernel
_bias = threading.local()  # the Int2Layer whose returned keys carry squared INT2 scales (logit correction)


def current_kernel_layer() -> Int2Layer | None:
    """The layer that just stored a decode step for the Triton path (read by the attention function), or None."""
    return getattr(_current, "layer", None)


def take_key_scale2(key: torch.Tensor) -> torch.Tensor | None:
    """The squared key scales ``float32 [B, H_kv, T, D/G]`` of ``key`` (the tensor an ``Int2Layer.update`` with a
    logit correction just returned; zero on BF16 slots), once; None for any other tensor."""
    layer = getattr(_bias, "layer", None)
    if layer is None or layer.bias_key is not key:
        return None
    _bias.layer = None
    s2, layer.bias_key, layer.key_scale2 = layer.key_scale2, None, None
    return s2


class Int2Layer(AppendLayer):
    """One decoder layer's tiered, paged INT2 cache. See the module docstring.

    Args:
        method: the per-token INT2 method (``kind == "int2"``).
        transform: the layer's rotations, means and clips.
        rotate_values: rotate values with ``R_V`` here (True when ``R_V`` is not folded into ``v_proj``).
        backend: ``reference`` (torch), ``triton`` (kernels; an error where they cannot run) or ``auto``
            (triton on CUDA where the kernels apply, else reference).
        layer_idx: the decoder layer index (the attention function checks it).
        page_size: tokens per history page.
        rope_table: the model's RoPE (:class:`~oscar_cli.quant.key_mean.RopeTable`), needed by a method with
            ``key_mean == "rope"``.
    """

    def __init__(
        self,
        method: QuantMethod,
        transform: LayerTransform,
        rotate_values: bool = True,
        backend: str = "reference",
        *,
        layer_idx: int = 0,
        page_size: int = DEFAULT_PAGE,
        rope_table: RopeTable | None = None,
    ) -> None:
        super().__init__(method)
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        self.transform, self.backend = transform, backend
        self.rotate_values, self.layer_idx, self.page_size = rotate_values, layer_idx, page_size
        self.k_rot = rotation_matrix(transform.k_rotation)
        self.v_rot = rotation_matrix(transform.v_rotation) if rotate_values else None
        self.sink_slots = method.sink
        self.pads: list[int] = []  # left padding per row (set by Int2Cache.set_padding)
        self.quantize = True
        self.path = "reference"  # resolved at the first update: "reference" or "triton"
        self.n_sink = 0  # sink slots filled (pad slots included)
        self.hist_slots = 0  # slots [S, S + hist_slots) are history (each row stores its real tokens)
        self.n_recent = 0  # slots [L - n_recent, L) are recent
        self.kernel_step = False  # the last update was a decode step for the Triton path
        self.kernel_key: torch.Tensor | None = None  # the key tensor that update returned for it
        self._pads_dev: torch.Tensor | None = None
        self._pos0_dev: torch.Tensor | None = None  # first INT2 history position per row (rope key mean), on device
        self._kernel_rot: torch.Tensor | None = None
        self.pool: PagePool | None = None
        self.sink_k = self.sink_v = self.recent_k = self.recent_v = None  # type: torch.Tensor | None
        self.k_mean: torch.Tensor | None = None
        self.v_mean: torch.Tensor | None = None
        self.keep = (KeepTier(method.keep_fraction, method.keep_score, method.keep_side)
                     if method.keep_fraction > 0 else None)
        self.bias_key: torch.Tensor | None = None  # the key tensor update returned with key_scale2 (logit correction)
        self.key_scale2: torch.Tensor | None = None
        # the BF16 key subspace (quant.key_subspace): basis [N, D, m] and per history slot the coefficients
        # [B, H_kv, cap, m] in bfloat16, slot t of the history at index t (pad slots hold zeros)
        self.subspace = transform.k_subspace if method.key_subspace and transform.k_subspace is not None else None
        self.k_sub: torch.Tensor | None = None
        # INT4 keys (quant.int4_keys): the low plane of every history key, quarter packed, slot t at index t
        self.key4 = method.key_bits == 4
        self.k_lo: torch.Tensor | None = None
        if self.key4 and (self.subspace is not None or self.keep is not None or method.levels != UNIFORM_INNER
                          or method.logit_correction != "none"):
            raise OscarError(f"layer {layer_idx}: INT4 keys (quant.int4_keys) do not combine with a key subspace, a "
                             "keep budget, non-uniform levels or a logit correction", hint="drop one of them")
        # the position-dependent key mean (quant.key_mean rope): pre-RoPE means [H_kv, D] and the model's RoPE
        self.rope_table = rope_table
        self.mean_pre = transform.k_mean_pre if method.key_mean == "rope" else None
        if method.key_mean == "rope" and self.mean_pre is None:
            raise OscarError(f"layer {layer_idx}: quant.key_mean rope needs the layer's k_mean_pre (pre-RoPE key mean)",
                             hint="recalibrate with quant.key_mean: rope")

    # ---------------------------------------------------------------- transformers API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device, self.dtype, self.batch_size = key_states.device, key_states.dtype, int(b)
        self.dims = (int(b), int(h), int(d))
        self.path = self._resolve_path(key_states)
        pads = self.pads or [0] * int(b)
        if len(pads) != b:
            raise ValueError(f"set_padding got {len(pads)} rows, the batch has {b}")
        self.pads = pads
        dev = key_states.device
        self.k_rot = None if self.k_rot is None else self.k_rot.to(dev)
        self.v_rot = None if self.v_rot is None else self.v_rot.to(dev)
        self.k_mean = None if self.transform.k_mean is None else self.transform.k_mean.to(dev)
        self.subspace = None if self.subspace is None else self.subspace.to(dev, torch.float32)
        if self.mean_pre is not None:
            if self.rope_table is None:
                raise OscarError("quant.key_mean rope: the cache has no RoPE table to centre keys by position",
                                 hint="make the cache with session.new_cache() of a method attached to the model")
            self.mean_pre = self.mean_pre.to(dev, torch.float32)
        self.v_mean = None if self.transform.v_mean is None else self.transform.v_mean.to(dev)
        s_cap = max(1, self.sink_slots)
        r_cap = self.method.recent + self.method.demotion_block
        self.sink_k = key_states.new_zeros(b, h, s_cap, d)
        self.sink_v = value_states.new_zeros(b, h, s_cap, d)
        self.recent_k = key_states.new_zeros(b, h, r_cap, d)
        self.recent_v = value_states.new_zeros(b, h, r_cap, d)
        self.pool = PagePool(
            int(b), int(h), int(d), page_size=self.page_size, group_size=self.method.group_size,
            meta_dtype=self.method.meta_dtype, device=dev,
        )
        self.is_initialized = True

    def _resolve_path(self, x: torch.Tensor) -> str:
        if self.backend == "reference":
            return "reference"
        reason = kernel_unsupported(self.method, x, interpreter_ok=self.backend == "triton")
        if self.keep is not None and (reason is None or self.backend == "triton"):
            raise OscarError(f"backend {self.backend}: the Triton decode kernel does not read the BF16 keep tier "
                             f"(quant.keep.fraction {self.method.keep_fraction:g})", hint="use --backend reference")
        if self.method.levels != UNIFORM_INNER and (reason is None or self.backend == "triton"):
            raise OscarError(f"backend {self.backend}: the Triton kernels code and decode uniform INT2 levels only "
                             f"(quant.levels {self.method.levels:g})", hint="use --backend reference")
        if self.subspace is not None and (reason is None or self.backend == "triton"):
            raise OscarError(f"backend {self.backend}: the Triton kernels do not read the BF16 key subspace "
                             f"(quant.key_subspace {self.method.key_subspace})", hint="use --backend reference")
        if self.method.logit_correction != "none" and (reason is None or self.backend == "triton"):
            raise OscarError(f"backend {self.backend}: the Triton decode kernel adds no per-key logit bias "
                             f"(quant.logit_correction {self.method.logit_correction})", hint="use --backend reference")
        if reason is not None and self.backend == "triton":
            raise OscarError(f"backend triton: {reason}", hint="use --backend reference (torch) or auto")
        path = "reference" if reason else "triton"
        if self.layer_idx == 0:
            log.info("%s cache: %s path%s", self.method.name, path, f" ({reason})" if reason else "")
        return path

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens (placement + demotion) and return what attention reads.

        Args:
            key_states: post-RoPE keys ``[B, H_kv, T_new, D]`` (unrotated).
            value_states: ``[B, H_kv, T_new, D]`` (already rotated when ``R_V`` is folded into ``v_proj``).

        Returns:
            ``[stored earlier tokens | new tokens]`` ``[B, H_kv, T_prev + T_new, D]`` (rotated, activation dtype),
            or, for a decode step on the Triton path, the new tokens alone (the kernel reads the pages).
        """
        k, v = self.append(key_states, value_states)
        prior = self.cumulative_length - int(k.shape[-2])
        self.kernel_step = self.path == "triton" and k.shape[-2] == 1
        _current.layer = self if self.kernel_step else None
        self.kernel_key = k if self.kernel_step else None  # attention runs the kernel only for this very tensor
        _bias.layer = None
        if self.kernel_step:
            return k, v
        out = self.stored(prior, k, v)
        if self.key_scale2 is not None:
            self.bias_key, _bias.layer = out[0], self
        return out

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate and store new tokens without building attention's view; returns the rotated new ``(k, v)``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k = self._rotate(key_states, self.k_rot)
        v = self._rotate(value_states, self.v_rot)
        self.cumulative_length += int(k.shape[-2])
        self._place(k, v, decode=k.shape[-2] == 1)
        return k, v

    # ---------------------------------------------------------------- placement
    def _rotate(self, x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
        if r is None:
            return x
        from oscar_kernels.reference import rotate

        return rotate(x, r).to(x.dtype)

    def _place(self, k: torch.Tensor, v: torch.Tensor, decode: bool) -> None:
        """Put new rotated tokens in their tiers (sink first, then recent), demoting to INT2 (docs/METHOD.md §7)."""
        assert self.sink_k is not None and self.sink_v is not None
        assert self.recent_k is not None and self.recent_v is not None
        n = int(k.shape[-2])
        take = max(0, min(self.sink_slots - self.n_sink, n))
        if take:
            self.sink_k[..., self.n_sink : self.n_sink + take, :] = k[..., :take, :]
            self.sink_v[..., self.n_sink : self.n_sink + take, :] = v[..., :take, :]
            self.n_sink += take
        rest_k, rest_v = k[..., take:, :], v[..., take:, :]
        total = self.n_recent + n - take
        w, block = self.method.recent, self.method.demotion_block
        if decode:
            demote = ((total - w) // block) * block if total >= w + block else 0
        else:
            demote = max(0, total - w) if self.final_chunk else total
        old = min(demote, self.n_recent)  # demoted from the stored recent tier, then from the new tokens
        new = demote - old
        if demote and not old:  # only new tokens: quantize them where they are
            self._demote(rest_k[..., :new, :], rest_v[..., :new, :])
        elif demote:
            rows_k = torch.cat([self.recent_k[..., :old, :], rest_k[..., :new, :]], -2)
            rows_v = torch.cat([self.recent_v[..., :old, :], rest_v[..., :new, :]], -2)
            self._demote(rows_k, rows_v)
        kept = self.n_recent - old
        if old and kept:  # shift the surviving recent tokens to the front (at most W + 7 rows)
            self.recent_k[..., :kept, :] = self.recent_k[..., old : self.n_recent, :].clone()
            self.recent_v[..., :kept, :] = self.recent_v[..., old : self.n_recent, :].clone()
        add = n - take - new
        if kept + add > self.recent_k.shape[-2]:
            raise AssertionError(f"recent tier overflow: {kept + add} > {self.recent_k.shape[-2]}")
        self.recent_k[..., kept : kept + add, :] = rest_k[..., new:, :]
        self.recent_v[..., kept : kept + add, :] = rest_v[..., new:, :]
        self.n_recent = kept + add

    def _demote(self, rows_k: torch.Tensor, rows_v: torch.Tensor) -> None:
        """Quantize ``m`` slots ``[S + hist_slots, + m)`` (``[B, H_kv, m, D]``) into each row's history pages."""
        assert self.pool is not None
        b, h, m, d = rows_k.shape
        first = self.sink_slots + self.hist_slots
        pads = torch.tensor(self.pads, dtype=torch.long)
        row_start = pads.clamp(min=self.sink_slots)  # each row's first real history slot
        start = first - row_start  # history position of slot `first` per row (negative: pad slots)
        added = (first + m - torch.maximum(row_start, torch.tensor(first))).clamp(min=0, max=m)
        self.pool.extend([int(a) for a in added])
        slots = self.pool.slots(start, m).view(b, m)
        hist0 = self.hist_slots
        self.hist_slots += m
        t, meth = self.transform, self.method
        from oscar_kernels.reference import dequantize_rows, quantize_rows, quantize_rows_int4

        scores = []

        def flat(x: torch.Tensor) -> torch.Tensor:  # [B, H, n, X] -> [B·n, H, X], row-major like the slots
            return x.permute(0, 2, 1, 3).reshape(-1, h, x.shape[-1])

        for a in range(0, m, PIECE):  # per-token quantization: pieces bound the scratch, the rows are the same
            e = min(m, a + PIECE)
            piece_k, piece_v, to = rows_k[..., a:e, :], rows_v[..., a:e, :], slots[:, a:e].reshape(-1)
            if self.path == "triton" and not self.key4:  # INT4 keys: both planes written by the reference below
                pos_means = self.key_means(first + a, e - a) if self.mean_pre is not None else None
                k_means = flat_mean(self.k_mean) if pos_means is None else flat(pos_means)
                means = (k_means, flat_mean(self.v_mean))
                self.pool.write_kernel(flat(piece_k), flat(piece_v), to, means, (t.k_clip, t.v_clip))
                continue
            coeffs, k_in, k_mean = None, piece_k, self.key_means(first + a, e - a)
            if self.subspace is not None:  # the coordinates along the subspace in BF16, the residual to INT2
                coeffs = self._store_coefficients(piece_k, hist0 + a, k_mean)
                k_in = residual(piece_k, coeffs, self.subspace)
            if self.key4:  # formula 9: the high plane to the pages, the low plane beside them
                qk, lo = quantize_rows_int4(k_in, None, k_mean, meth.group_size, meth.meta_dtype)
                self._store_low_plane(lo, hist0 + a)
            else:
                qk = quantize_rows(k_in, None, k_mean, t.k_clip, meth.group_size, meth.meta_dtype, meth.levels)
            qv = quantize_rows(piece_v, None, self.v_mean, t.v_clip, meth.group_size, meth.meta_dtype, meth.levels)
            self.pool.write(_rows(qk, flat), _rows(qv, flat), to)
            if self.keep is not None:
                k_hat = dequantize_rows(qk, inner=meth.levels)
                if coeffs is not None and self.subspace is not None:  # keys as served: subspace coordinates restored
                    k_hat = restore(k_hat, coeffs, self.subspace)
                hats = [with_mean(k_hat, k_mean), with_mean(dequantize_rows(qv, inner=meth.levels), self.v_mean)]
                score = token_scores(self.keep.kind, piece_k, piece_v, hats[0], hats[1], side=self.keep.side)
                pad = (slots[:, a:e] < 0).view(b, 1, e - a)
                scores.append(score.masked_fill(pad, float("-inf")))
        if self.keep is not None:  # the kept tier: a fixed fraction of the history slots (module keep.py)
            pos = torch.arange(first, first + m)
            self.keep.merge(rows_k, rows_v, pos, torch.cat(scores, -1), keep_count(self.keep.fraction, self.hist_slots))

    def key_means(self, first: int, n: int) -> torch.Tensor | None:
        """The mean INT2 keys of slots ``[first, first + n)`` are centred by: the constant ``k_mean`` (``[N, D]``),
        or with ``quant.key_mean: rope`` ``RoPE_p(m_pre)·R_K`` at each row's positions ``p = slot - pad``
        (``float32 [B, H_kv, n, D]``; pad slots take position 0, their rows are never read)."""
        if self.mean_pre is None:
            return self.k_mean
        from oscar_cli.quant.key_mean import position_means

        assert self.rope_table is not None
        pads = torch.tensor(self.pads, dtype=torch.long, device=self.device)
        pos = (torch.arange(first, first + n, device=self.device)[None, :] - pads[:, None]).clamp(min=0)
        cos, sin = self.rope_table(pos)
        return position_means(self.mean_pre, self.transform.k_rotation, cos, sin)

    def _store_low_plane(self, lo: torch.Tensor, at: int) -> None:
        """Keep the low plane ``uint8 [B, H, n, D/4]`` of history slots ``[at, at + n)``."""
        self.k_lo = store_slots(self.k_lo, lo, at)

    def _store_coefficients(self, rows_k: torch.Tensor, at: int, mean: torch.Tensor | None) -> torch.Tensor:
        """Coefficients of rotated keys ``[B, H, n, D]`` (centred here by ``mean``) along the subspace, stored at
        history index ``at``; returns them (bfloat16, as stored)."""
        assert self.subspace is not None
        y = rows_k.float() if mean is None else with_mean(rows_k.float(), -mean)
        c = coefficients(y, self.subspace).to(torch.bfloat16)
        self.k_sub = store_slots(self.k_sub, c, at)
        return c

    # ---------------------------------------------------------------- what attention reads
    def stored(
        self, upto: int | None = None, k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored slots ``[0, upto)`` as dense rotated K and V in the activation dtype (history dequantized
        plus the centring mean), followed by ``k_new``/``v_new``. Transient: built from the tiers on each call,
        the history's pages gathered, unpacked and dequantized :data:`PIECE` tokens at a time straight into the
        returned tensors."""
        from oscar_kernels.reference import dequantize_codes, dequantize_int4_planes

        assert self.sink_k is not None and self.sink_v is not None and self.pool is not None
        assert self.recent_k is not None and self.recent_v is not None
        length = self.cumulative_length
        upto = length if upto is None else upto
        s = min(self.n_sink, upto)
        width = max(0, min(self.hist_slots, upto - self.n_sink))
        r = max(0, upto - (length - self.n_recent))
        n = 0 if k_new is None else int(k_new.shape[-2])
        self.key_scale2 = None
        if k_new is not None and v_new is not None and s + width + r == 0:
            return k_new, v_new  # nothing stored before (a first chunk): the new tokens as they are, no copy
        b, h, d = self.dims
        correct = self.method.logit_correction != "none" and width > 0
        groups = d // (self.method.group_size or d)
        s2 = torch.zeros(b, h, s + width + r + n, groups, device=self.device) if correct else None
        outs = self.sink_k.new_empty(b, h, s + width + r + n, d), self.sink_v.new_empty(b, h, s + width + r + n, d)
        for out, sink, recent, new in zip(
            outs, (self.sink_k, self.sink_v), (self.recent_k, self.recent_v), (k_new, v_new), strict=True
        ):
            out[..., :s, :] = sink[..., :s, :]
            out[..., s + width : s + width + r, :] = recent[..., :r, :]
            if new is not None:
                out[..., s + width + r :, :] = new
        for a in range(0, width, PIECE):  # the history: pages gathered, unpacked and dequantized a piece at a time
            e = min(width, a + PIECE)
            codes = self.pool.codes(self.hist_slots, e - a, start=a)
            k_mean = self.key_means(self.sink_slots + a, e - a)
            for out, q, mean in zip(outs, codes, (k_mean, self.v_mean), strict=True):
                if out is outs[0] and self.k_lo is not None:  # INT4 keys: both planes
                    rows = dequantize_int4_planes(q[0], unpack_rows(self.k_lo[:, :, a:e]), q[1], q[2])
                else:
                    rows = dequantize_codes(*q, torch.float32, self.method.levels)
                if out is outs[0] and self.subspace is not None and self.k_sub is not None:
                    rows = restore(rows, self.k_sub[:, :, a:e], self.subspace)
                out[..., s + a : s + e, :] = with_mean(rows, mean)
            if s2 is not None:  # pad columns hold scale 0
                s2[..., s + a : s + e, :] = codes[0][1].float().square()
        if self.keep is not None:  # kept tokens: attention reads their BF16 rows (slot t is index t here)
            self.keep.substitute(*outs, limit=s + width)
            if s2 is not None and self.keep.keeps_keys:  # BF16 keys: no logit correction
                self.keep.substitute_rows(s2, torch.zeros(()), limit=s + width)
        self.key_scale2 = s2
        return outs

    def kernel_attention(
        self, query: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scaling: float | None
    ) -> torch.Tensor:
        """One decode step through ``oscar_kernels.ops.decode_attention`` on the pages: ``query [B, H_q, 1, D]``
        (post-RoPE, unrotated: the kernel applies ``R_K``) -> ``o + mu_V`` ``[B, H_q, 1, D]`` in the rotated value
        space (``R_Vᵀ`` follows in the folded ``o_proj``).

        The BF16 tiers are passed **centred** like the INT2 rows. In a left-padded batch each row's real sink
        (and, without a sink, recent) tokens are gathered to the front and the lengths exclude the pads. When the
        new token was demoted on arrival (``W = 0``) it is attended unquantized from the recent tier and left out
        of the history, as on the reference path.
        """
        from oscar_kernels.ops import LowPlane, decode_attention

        self.kernel_step, self.kernel_key = False, None
        assert self.sink_k is not None and self.sink_v is not None and self.pool is not None
        assert self.recent_k is not None and self.recent_v is not None
        assert self.pool.k is not None and self.pool.v is not None  # PagePool allocates one page per row up front
        length = self.cumulative_length
        if self._pads_dev is None:  # one host-to-device copy per batch, not per step
            self._pads_dev = torch.tensor(self.pads, dtype=torch.long, device=query.device)
        pads = self._pads_dev
        sink_pad = pads.clamp(max=self.n_sink)
        sink_k, sink_v = front(self.sink_k, sink_pad), front(self.sink_v, sink_pad)
        hist_len = self.pool.device_lengths()
        if self.n_recent == 0:  # the new token went to INT2 on arrival: attend to it unquantized
            recent_k, recent_v, recent_len = k_new, v_new, torch.ones_like(hist_len)
            hist_len = hist_len - 1
        else:
            rec_pad = (pads - (length - self.n_recent)).clamp(min=0, max=self.n_recent)
            recent_k, recent_v = front(self.recent_k, rec_pad), front(self.recent_v, rec_pad)
            recent_len = (self.n_recent - rec_pad).to(torch.int32)
        if self._kernel_rot is None and self.k_rot is not None:  # R_K as the kernel takes it (no copy if float32)
            self._kernel_rot = self.k_rot.to(query.device).float().contiguous()
        q = query[:, :, 0].contiguous()
        k_mean, rope = self.k_mean, None
        if self.mean_pre is not None:  # keys centred by position: the BF16 tiers as they are, the INT2 term added
            k_mean, rope = None, self._rope_mean(q.device)
        low = None
        if self.k_lo is not None:  # INT4 keys: history token n of row b is low-plane slot hist_slots - len_b + n
            first = (self.hist_slots - self.pool.device_lengths()).to(torch.int32)
            low = LowPlane(self.k_lo, first)
        out = decode_attention(
            q,
            self.pool.k,
            self.pool.v,
            self.pool.device_table(),
            hist_len,
            centred(sink_k, k_mean),
            centred(sink_v, self.v_mean),
            (self.n_sink - sink_pad).to(torch.int32),
            centred(recent_k, k_mean),
            centred(recent_v, self.v_mean),
            recent_len,
            rotation_k=self._kernel_rot,
            mean_v=None if self.v_mean is None else flat_mean(self.v_mean),
            sm_scale=scaling,
            rope_mean=rope,
            low_plane=low,
        )
        return out.unsqueeze(2)

    def _rope_mean(self, device: torch.device) -> Any:
        """What the decode kernel needs to add the logit term of keys centred by position (``quant.key_mean:
        rope``), ``sm_scale·a·q·RoPE_p(m_pre)``, to every INT2 history token itself (``oscar_kernels.ops.RopeMean``;
        ``R_K`` is orthogonal, so the term is the same in its space). Row ``b``'s history token ``n`` sits at RoPE
        position ``max(pad_b, S) - pad_b + n``; the shared position table covers every slot the block table
        addresses."""
        from oscar_kernels.ops import RopeMean

        assert self.pool is not None and self.mean_pre is not None and self.rope_table is not None
        cap = int(self.pool.device_table().shape[1]) * self.page_size
        pos0 = [max(p, self.sink_slots) - p for p in self.pads]
        if self._pos0_dev is None:  # one host-to-device copy per batch, not per step
            self._pos0_dev = torch.tensor(pos0, dtype=torch.int32, device=device)
        table = self.rope_table.kernel_table(max(pos0) + cap, device)
        _, attn_scaling = self.rope_table.frequencies()
        return RopeMean(self.mean_pre, table, self._pos0_dev, attn_scaling)

    # ---------------------------------------------------------------- inspection
    def history(self, which: str = "k") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The packed history ``(packed [B, H_kv, T_h, D/4], scale, zero)`` of keys (``"k"``) or values (``"v"``)
        in the row layout (rows right-aligned, zeros left of a padded row's first token), or None when empty; with
        INT4 keys (quant.int4_keys) the keys' high plane."""
        from oscar_kernels.reference import pack_int2

        if self.pool is None or self.hist_slots == 0:
            return None
        codes, scale, zero = self.pool.codes(self.hist_slots)[0 if which == "k" else 1]
        return pack_int2(codes), scale, zero

    def tier_sizes(self) -> tuple[int, int, int]:
        """``(sink, history, recent)`` slot counts."""
        return self.n_sink, self.hist_slots, self.n_recent

    def kv_dims(self) -> tuple[int, int, int]:
        return self.dims

    def storage_bytes(self) -> int:
        """Bytes the tiers hold in use: sink and recent slots, each row's packed history + scale/zero (K and V), the
        kept tier."""
        if not self.is_initialized or self.pool is None:
            return 0
        b, h, d = self.dims
        act = torch.finfo(self.dtype).bits // 8
        md = meta_bits(self.method.meta_dtype) // 8
        groups = d // (self.method.group_size or d)
        per_hist = d // 4 + 2 * groups * md
        dense = (self.n_sink + self.n_recent) * b * d * act
        kept = 0 if self.keep is None else self.keep.nbytes()
        sub = 0 if self.subspace is None else h * sum(self.pool.lengths) * int(self.subspace.shape[-1]) * 2
        low = h * sum(self.pool.lengths) * (d // 4) if self.key4 else 0
        return int(2 * h * (dense + sum(self.pool.lengths) * per_hist) + kept + sub + low)

    def allocated_bytes(self) -> int:
        """Bytes of every tensor the layer holds: sink and recent buffers (capacity), the page pool, block table."""
        if not self.is_initialized or self.pool is None:
            return 0
        bufs = (self.sink_k, self.sink_v, self.recent_k, self.recent_v, self.k_sub, self.k_lo)
        kept = 0 if self.keep is None else self.keep.nbytes()
        return int(sum(t.nbytes for t in bufs if t is not None) + self.pool.allocated_bytes() + kept)

    # ---------------------------------------------------------------- batch operations
    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized or self.pool is None:
            return
        idx = [int(i) for i in indices.tolist()]
        sel = torch.tensor(idx, device=self.device)
        for name in ("sink_k", "sink_v", "recent_k", "recent_v"):
            setattr(self, name, getattr(self, name)[sel].contiguous())
        if self.k_sub is not None:
            self.k_sub = self.k_sub[sel].contiguous()
        if self.k_lo is not None:
            self.k_lo = self.k_lo[sel].contiguous()
        self.pool = self.pool.select(idx)
        if self.keep is not None:
            self.keep.select(sel)
        self.pads = [self.pads[i] for i in idx]
        self._pads_dev = None
        self._pos0_dev = None
        self.batch_size = len(idx)
        self.dims = (len(idx), *self.dims[1:])

    def reset(self) -> None:
        self.__init__(  # type: ignore[misc]
            self.method, self.transform, self.rotate_values, self.backend, layer_idx=self.layer_idx,
            page_size=self.page_size, rope_table=self.rope_table,
        )


def store_slots(buf: torch.Tensor | None, rows: torch.Tensor, at: int) -> torch.Tensor:
    """``buf [B, H, cap, X]`` (None: none yet) with ``rows [B, H, n, X]`` written at slots ``[at, at + n)``, grown by
    doubling (amortized appends; new slots zero) when it is too short; returns the buffer."""
    b, h, n, x = rows.shape
    if buf is None or buf.shape[2] < at + n:
        cap = max(at + n, 2 * (0 if buf is None else buf.shape[2]), 64)
        grown = torch.zeros(b, h, cap, x, dtype=rows.dtype, device=rows.device)
        if buf is not None:
            grown[:, :, : buf.shape[2]] = buf
        buf = grown
    buf[:, :, at : at + n] = rows
    return buf


def with_mean(x: torch.Tensor, mean: torch.Tensor | None) -> torch.Tensor:
    """Centred float32 rows ``[B, H_kv, n, D]`` plus the centring mean (``[N, D]``, ``N`` 1 or ``H_kv``, or per
    position ``[B, H_kv, n, D]``)."""
    if mean is None:
        return x
    return x + (mean.float().unsqueeze(-2) if mean.dim() == 2 else mean.float())


def _rows(q: Any, fn: Any) -> Any:
    """``QuantizedRows`` with ``fn`` applied to its packed codes, scales and zeros."""
    from oscar_kernels.reference import QuantizedRows

    return QuantizedRows(fn(q.packed), fn(q.scale), fn(q.zero))
