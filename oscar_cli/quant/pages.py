"""The page pool of one cache layer: INT2 history in the decode kernel's paged layout, grown by pages.

Storage (``oscar_kernels.ops.new_paged_cache``): keys ``packed uint8 [pages, H_kv, P, D/4]`` (quarter-packed
rows), values ``packed uint8 [pages, H_kv, P/R·D, R/4]`` (token quads, ``R = min(P, 64)``), ``scale``/``zero``
``md [pages, H_kv, P, D/G]`` for both. Row ``b`` of the batch owns the pages ``table[b, :⌈len_b/P⌉]``; its
history token ``j`` lives at slot ``table[b, j // P]·P + j % P``. Rows may hold different numbers of tokens
(left padding is never stored), so the block table is ragged, exactly what ``ops.decode_attention`` reads.

Growth: pages are handed out in order; when the pool is full its tensors are reallocated with
``max(B, capacity/32)`` more pages (or exactly what one write needs, if more) and the old pages copied over
once. So the allocated bytes stay within ``1/32`` of the pages in use (plus ``B`` pages), and a decode step
copies nothing in between growths: the amortized cost of growth is about 32 page copies per page written.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from oscar_kernels.reference import QuantizedRows

_Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (codes uint8 [..., D], scale, zero)

GROWTH = 32  # the pool grows by capacity / GROWTH pages (at least one page per row)
DEFAULT_PAGE = 64  # tokens per page: one token-quad row block (the decode kernel's 64-token tile)


def check_page_size(page_size: int) -> None:
    """Pages must hold whole token-quad rows: ``P % 16 == 0``, and ``P % 64 == 0`` above 64."""
    if page_size < 16 or page_size % 16 or (page_size > 64 and page_size % 64):
        raise ValueError(f"page_size: expected a multiple of 16 (of 64 above 64), got {page_size}")


class PagePool:
    """Paged INT2 keys and values of one layer for a batch of ``B`` rows.

    Args:
        batch, h_kv, d: shape of the layer's KV (``B``, ``H_kv``, ``D``).
        page_size: tokens per page ``P``.
        group_size: ``G`` (None = ``D``); meta_dtype: scale/zero dtype; device: where the pages live.
    """

    def __init__(
        self,
        batch: int,
        h_kv: int,
        d: int,
        *,
        page_size: int = DEFAULT_PAGE,
        group_size: int | None = None,
        meta_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> None:
        check_page_size(page_size)
        self.batch, self.h_kv, self.d, self.page = batch, h_kv, d, page_size
        self.group_size, self.meta_dtype, self.device = group_size, meta_dtype, torch.device(device)
        self.lengths = [0] * batch  # history tokens per row
        self.n_pages = [0] * batch  # pages owned per row
        self.table = torch.zeros(batch, 1, dtype=torch.long)  # host copy of the block table
        self.capacity = 0
        self.used = 0
        self.grows = 0  # reallocations so far
        self.copied = 0  # pages copied by reallocations (amortized: about GROWTH per page handed out)
        self.k: QuantizedRows | None = None
        self.v: QuantizedRows | None = None
        self._device_table: torch.Tensor | None = None
        self._device_lengths: torch.Tensor | None = None
        self._grow(batch)  # one page per row up front: the decode kernel always gets a valid pool

    # ---------------------------------------------------------------- allocation
    def _grow(self, need: int) -> None:
        from oscar_kernels.ops import new_paged_cache

        cap = max(need, self.capacity + max(self.batch, -(-self.capacity // GROWTH)))
        args = (cap, self.h_kv, self.page, self.d, self.group_size, self.meta_dtype, self.device)
        k, v = new_paged_cache(*args, layout="rows"), new_paged_cache(*args, layout="token_quads")
        if self.k is not None and self.v is not None:
            for new, old in ((k, self.k), (v, self.v)):
                for part in ("packed", "scale", "zero"):
                    getattr(new, part)[: self.capacity].copy_(getattr(old, part))
            self.grows += 1
            self.copied += self.capacity
        self.k, self.v, self.capacity = k, v, cap

    def extend(self, added: list[int]) -> None:
        """Make room for ``added[b]`` more history tokens in row ``b`` (pages assigned in row order)."""
        want = [math.ceil((n + a) / self.page) for n, a in zip(self.lengths, added, strict=True)]
        extra = sum(w - p for w, p in zip(want, self.n_pages, strict=True))
        if self.used + extra > self.capacity:
            self._grow(self.used + extra)
        if max(want) > self.table.shape[1]:
            cols = max(max(want), 2 * self.table.shape[1])
            self.table = torch.cat([self.table, self.table.new_zeros(self.batch, cols - self.table.shape[1])], 1)
        for b, w in enumerate(want):
            for i in range(self.n_pages[b], w):
                self.table[b, i] = self.used
                self.used += 1
            self.n_pages[b] = w
        self.lengths = [n + a for n, a in zip(self.lengths, added, strict=True)]
        self._device_table = self._device_lengths = None

    def slots(self, start: torch.Tensor, count: int) -> torch.Tensor:
        """Destination slots ``int64 [B·count]`` (row-major) of history positions ``start[b] + j``, ``j < count``;
        a negative position (a pad token) gives slot ``-1`` (skipped)."""
        pos = start[:, None] + torch.arange(count)[None, :]  # [B, count] history positions
        ok = pos >= 0
        p = pos.clamp(min=0)
        pages = self.table.gather(1, (p // self.page).clamp(max=self.table.shape[1] - 1))
        slot = torch.where(ok, pages * self.page + p % self.page, torch.full_like(p, -1))
        return slot.reshape(-1).to(self.device)

    # ---------------------------------------------------------------- writes
    def write(self, k_q: QuantizedRows, v_q: QuantizedRows, slots: torch.Tensor) -> None:
        """Scatter quantized rows ``[N, H_kv, ...]`` (row layout, from ``reference.quantize_rows``) to ``slots``."""
        from oscar_kernels.reference import unpack_int2

        assert self.k is not None and self.v is not None
        keep = slots >= 0
        if not bool(keep.all()):
            slots = slots[keep]
            k_q = _select(k_q, keep)
            v_q = _select(v_q, keep)
        pg, off = slots // self.page, slots % self.page
        for pool, q in ((self.k, k_q), (self.v, v_q)):
            pool.scale[pg, :, off] = q.scale
            pool.zero[pg, :, off] = q.zero
        self.k.packed[pg, :, off] = k_q.packed
        self._write_token_quads(pg, off, unpack_int2(v_q.packed))

    def _write_token_quads(self, pg: torch.Tensor, off: torch.Tensor, codes: torch.Tensor) -> None:
        """Set the 2-bit fields of tokens ``(pg, off)`` (codes ``[N, H_kv, D]``) in the token-quad value pages."""
        assert self.v is not None
        row_tokens = min(self.page, 64)
        quads = row_tokens // 4
        d = self.d
        block, within = off // row_tokens, off % row_tokens
        key = (pg * (self.page // row_tokens) + block) * quads + within // 4  # one key per (page, block, byte)
        uniq, inv = torch.unique(key, return_inverse=True)
        shift = (2 * (within % 4)).to(torch.int32)
        bits = torch.zeros(len(uniq), self.h_kv, d, dtype=torch.int32, device=codes.device)
        bits.index_add_(0, inv, codes.to(torch.int32) << shift[:, None, None])
        clear = torch.zeros(len(uniq), dtype=torch.int32, device=codes.device)
        clear.index_add_(0, inv, torch.full_like(shift, 3) << shift)
        u_page = uniq // (quads * (self.page // row_tokens))
        u_block = (uniq // quads) % (self.page // row_tokens)
        u_byte = uniq % quads
        rows = u_block[:, None] * d + torch.arange(d, device=codes.device)[None, :]  # [U, D]
        cur = self.v.packed[u_page[:, None], :, rows, u_byte[:, None]].to(torch.int32)  # [U, D, H_kv]
        new = (cur & ~clear[:, None, None]) | bits.transpose(1, 2)
        self.v.packed[u_page[:, None], :, rows, u_byte[:, None]] = new.to(torch.uint8)

    def write_kernel(
        self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, means: tuple, clips: tuple[float, float]
    ) -> None:
        """The Triton write path: ``ops.quantize_write`` of rows ``[N, H_kv, D]`` (rotated) into both pools."""
        from oscar_kernels import ops

        assert self.k is not None and self.v is not None
        for x, pool, mean, clip, layout in (
            (k, self.k, means[0], clips[0], "rows"),
            (v, self.v, means[1], clips[1], "token_quads"),
        ):
            ops.quantize_write(x.contiguous(), pool, slots, mean=mean, clip_ratio=clip, layout=layout)

    # ---------------------------------------------------------------- reads
    def codes(self, width: int, columns: int | None = None, start: int = 0) -> tuple[_Rows, _Rows]:
        """The history of keys and values as unpacked codes ``uint8 [B, H_kv, columns, D]`` with ``scale``/``zero``
        ``[B, H_kv, columns, D/G]``, each row **right-aligned** in ``width`` columns (row ``b``'s token
        ``len_b - width + t`` at column ``t``; columns left of its first token hold zeros), columns
        ``[start, start + columns)`` of them (``columns`` defaults to ``width - start``). A transient gather of
        the pages those columns touch: nothing is kept."""
        assert self.k is not None and self.v is not None
        cols = width - start if columns is None else columns
        n = max(1, max(self.n_pages))
        p = self.page
        if all(n_b == n for n_b in self.n_pages) and min(self.lengths) == max(self.lengths) == width:
            lo, hi = start // p, -(-(start + cols) // p)  # every row holds exactly `width` tokens, pages in order
            table = self.table[:, lo:hi].to(self.device)
            first = start - lo * p

            def pick(pages: torch.Tensor) -> torch.Tensor:  # per-row pages [B, m, H, P, X] -> [B, H, cols, X]
                b, m, h, _, x = pages.shape
                return pages.permute(0, 2, 1, 3, 4).reshape(b, h, m * p, x)[:, :, first : first + cols]
        else:
            lengths = torch.tensor(self.lengths)
            j = lengths[:, None] - width + start + torch.arange(cols)[None, :]  # [B, cols] history positions
            ok = (j >= 0).to(self.device)
            j = j.clamp(min=0)
            lo = int(j[:, 0].min()) // p
            table = self.table[:, lo : min(n, int(j[:, -1].max()) // p + 1)].to(self.device)  # the pages touched
            jd = (j - lo * p).to(self.device)
            rows_b = torch.arange(self.batch, device=self.device)[:, None]

            def pick(pages: torch.Tensor) -> torch.Tensor:
                y = pages[rows_b, jd // p, :, jd % p]  # [B, cols, H, X]
                return torch.where(ok[:, :, None, None], y, torch.zeros_like(y)).permute(0, 2, 1, 3)

        k_codes = unpack_rows(self.k.packed[table])  # [B, m, H, P, D]
        v_codes = unpack_quads(self.v.packed[table], self.d)
        k = (pick(k_codes), pick(self.k.scale[table]), pick(self.k.zero[table]))
        v = (pick(v_codes), pick(self.v.scale[table]), pick(self.v.zero[table]))
        return k, v

    def device_table(self) -> torch.Tensor:
        """The block table ``int32 [B, max_pages]`` on the pool's device (rebuilt only when pages were added)."""
        if self._device_table is None:
            n = max(1, max(self.n_pages))
            self._device_table = self.table[:, :n].to(device=self.device, dtype=torch.int32).contiguous()
        return self._device_table

    def device_lengths(self) -> torch.Tensor:
        """History tokens per row, ``int32 [B]`` on the pool's device."""
        if self._device_lengths is None:
            self._device_lengths = torch.tensor(self.lengths, dtype=torch.int32, device=self.device)
        return self._device_lengths

    # ---------------------------------------------------------------- accounting, batch operations
    def allocated_bytes(self) -> int:
        """Bytes of every tensor the pool holds (capacity, not use) plus its block table."""
        parts = [*_parts(self.k), *_parts(self.v), self.table]
        if self._device_table is not None and self._device_table.device != self.table.device:
            parts.append(self._device_table)
        return int(sum(t.nbytes for t in parts))

    def select(self, indices: list[int]) -> PagePool:
        """A new pool holding rows ``indices`` of this one (pages copied; a row may be picked twice)."""
        out = PagePool(
            len(indices), self.h_kv, self.d, page_size=self.page, group_size=self.group_size,
            meta_dtype=self.meta_dtype, device=self.device,
        )
        out.extend([self.lengths[i] for i in indices])
        assert out.k is not None and out.v is not None and self.k is not None and self.v is not None
        for b, i in enumerate(indices):
            src = self.table[i, : self.n_pages[i]].to(self.device)
            dst = out.table[b, : out.n_pages[b]].to(self.device)
            for new, old in ((out.k, self.k), (out.v, self.v)):
                for part in ("packed", "scale", "zero"):
                    getattr(new, part)[dst] = getattr(old, part)[src]
        return out


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """Quarter-packed rows ``uint8 [..., D/4]`` -> codes ``uint8 [..., D]`` (``reference.unpack_int2`` in uint8)."""
    return torch.cat([(packed >> s) & 3 for s in (0, 2, 4, 6)], -1)


def unpack_quads(packed: torch.Tensor, d: int) -> torch.Tensor:
    """Token-quad pages ``uint8 [..., n·D, R/4]`` -> codes ``uint8 [..., n·R, D]`` (``reference.unpack_token_quads``
    in uint8)."""
    r4 = int(packed.shape[-1])
    n = int(packed.shape[-2]) // d
    p = packed.reshape(*packed.shape[:-2], n, d, r4)
    c = torch.stack([(p >> s) & 3 for s in (0, 2, 4, 6)], -1)  # [..., n, D, R/4, 4]: token 4i + t at [.., i, t]
    c = c.reshape(*c.shape[:-2], 4 * r4).transpose(-1, -2)  # [..., n, R, D]
    return c.reshape(*c.shape[:-3], n * 4 * r4, d)


def _parts(q: QuantizedRows | None) -> list[torch.Tensor]:
    return [] if q is None else [q.packed, q.scale, q.zero]


def _select(q: QuantizedRows, keep: torch.Tensor) -> QuantizedRows:
    from oscar_kernels.reference import QuantizedRows

    return QuantizedRows(q.packed[keep], q.scale[keep], q.zero[keep])
