"""Decode-side launchers: :class:`DecodeConfig`, split counts, workspaces, :class:`DecodePlan` and the
:func:`decode_attention` entry points (``int2_decode``), re-exported by :mod:`oscar_kernels.ops`.
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch

from oscar_kernels.launch_checks import (
    ACT,
    META_WRITE,
    bad_tensor,
    check_tensor,
    mean_arg,
    rotation_arg,
    triton_dtype,
    triton_modules,
)
from oscar_kernels.reference import TOKEN_QUAD_ROW, QuantizedRows, token_quad_row
from oscar_kernels.tier_ops import query_rows

_LOG2E = 1.4426950408889634
LAST_LAUNCH: dict[str, Any] = {}  # kernel name -> compiled handle of the latest launch (registers, spills, asm)


class ConfigError(ValueError):
    """A :class:`DecodeConfig` the kernels cannot run (raised before anything launches)."""


@dataclass(frozen=True)
class DecodeConfig:
    """Tile and launch configuration of the decode kernels (see docs/KERNELS.md for the measured sweeps). The unpack
    is fixed (fp16 subnormal fields, the whole byte as the top field: ``int2_decode``'s module docstring); inline PTX
    on CUDA, the same fields element by element in the CPU interpreter."""

    block_n: int = 64  # INT2 tokens per tile: a multiple of 4; on GPUs >= 64 (the V dot reduces over block_n/4)
    block_nb: int = 16  # BF16 tokens per tile (small: the BF16 branch shares the INT2 splits' register budget)
    num_warps: int = 1  # INT2 splits: one warp needs no cross-warp softmax reductions (docs/KERNELS.md)
    num_stages: int = 2
    # pipelining depth of the INT2 loop alone (``tl.range(num_stages=)``): Triton divides the depth between the
    # block-table load and the copies it addresses, so 2-4 leave one buffer per tile (the next tile's copies are
    # issued after this tile's math and waited for right away); 5 double-buffers them (docs/KERNELS.md)
    hist_stages: int = 5
    # convert the q operands to the MMA layout once, before the INT2 loop, instead of in every iteration (local sm_90
    # SASS: 804 -> 755 instructions per tile at 168 registers; H200: faster at batch 16, slower at batch 1 where ptxas
    # then keeps 168 instead of 195 registers; docs/KERNELS.md)
    hoist_q: bool = False
    min_gp: int = 8  # query heads per KV head are padded to max(min_gp, next power of two) (the MMA's N)
    maxnreg: int | None = None  # register cap per thread for stage 1 (None: the compiler's choice)
    merge_cols: int = 0  # output dims per merge program (32 or D; 0: D from 128 query heads in the batch, else 32)
    pdl: bool = True  # CUDA: stage 1 and the merge as programmatic dependent launches (griddepcontrol)
    merge_block_p: int = 64  # partials per merge iteration (a power of two)
    # query heads per merge program (a power of two dividing the GQA group): each R_V chunk is loaded once for them
    # instead of once per head. 1: on an H100 2 and 4 were slower at 1 x 4K, 1 x 128K and 16 x 32K and level at
    # 80 x 32K (docs/VLLM.md, "The K/V rotation by row count")
    merge_heads: int = 1
    # CUDA: before stage 1 waits for the q rotation, each program prefetches its first tile (INT2 codes, metadata) or
    # its BF16 tier rows into L2 (the DRAM latency overlaps the rotation kernel; at short contexts that is all of it)
    prefetch: bool = True
    # with prefetch: the BF16 tier programs' rows too (False: only the INT2 splits' first tiles). None (the default):
    # the gathered copies' rows, not the rows of tiers read in place (TierIndex): on an H100 the prefetch of rows
    # read in place cost 0.5-3 us per layer at 6-32 requests (docs/VLLM.md, "the crossing by batch")
    tier_prefetch: bool | None = None
    # the position-dependent key mean's in-tile term: its products' operands. "fp16": the coefficients rotated once
    # per tile and scaled by a power of two per program, the table's first block_n rows as fp16, one fp16 MMA per
    # residue and half (11-bit operands, float32 sums; sm_90 SASS, BLOCK_N 64: 1,090 instructions per tile against
    # 903 without the term, 249 registers, no spills uncapped); "tf32x3": float32 accuracy from three TF32 MMAs per
    # product, the coefficients rotated per residue (3,887 instructions, spills); "tf32": one TF32 MMA; "ieee":
    # CUDA-core FMAs (scripts/sass_stats.py --rope PREC)
    rope_prec: str = "fp16"
    # 8-bit metadata (formula 10): read a token quad's four bytes as one 32-bit word instead of a ``[NQ, 4]`` byte tile
    # (2 bytes a thread, which the loop pipeliner leaves as synchronous loads: sm_90 SASS of the batch-16 rope
    # configuration, 10 async copies and 9 ``LDG`` per iteration against 16-bit metadata's 14 and 5; words: 15 and 5,
    # 1,118 instructions against 1,201 and 1,029). The same output (bitwise in the interpreter; on CUDA within one
    # ulp: the compiled loops may sum in another order). Measured (H100, docs/KERNELS.md): words
    # decode at 16-bit metadata's speed (16 x 128K 638 vs 630 µs), byte tiles at 1.4x (893 µs). None: words
    # whenever the metadata sits on 4-byte boundaries (data pointer, page and head strides, page size; oscar's
    # caches always do), byte tiles otherwise; True: words, refusing metadata off a word boundary; False: byte tiles
    meta_words: bool | None = None


def query_scale(sm_scale: float | None, d: int) -> float:
    """The factor folded into the rotated queries: the softmax scale (default ``D^-1/2``) times ``log2(e)`` (the
    kernels' exponentials are base 2)."""
    return (sm_scale if sm_scale is not None else d ** -0.5) * _LOG2E


def default_config(batch: int, rope_mean: bool = False) -> DecodeConfig:
    """The measured H200 choice (docs/KERNELS.md): one warp per split, 64-token tiles, a double-buffered INT2 loop,
    programmatic dependent launches, L2 prefetch of each program's first tile; from batch 16 the q operands are
    converted to the MMA layout before the loop (``hoist_q``) and the registers are capped at 168 (3 instead of 2
    one-warp programs per scheduler, no spills: 16 x 128K 401 µs vs 424 µs uncapped and 418 µs at a 128 cap with
    spills; at batch 1 the grid is one wave either way and registers buy instruction-level parallelism).

    ``rope_mean``: the plan adds the position-dependent key mean's term in the tile (:class:`RopeMean`); its
    operands do not fit under the cap (208 bytes of spills per thread), so there is none: 16 x 128K 623 µs uncapped
    vs 900 µs capped, 16 x 32K 203 vs 279 (docs/BENCHMARKS.md)."""
    if batch >= 16:
        return DecodeConfig(hoist_q=True) if rope_mean else DecodeConfig(maxnreg=168, hoist_q=True)
    return DecodeConfig()


def default_num_splits(batch: int, h_kv: int, hist_capacity: int, block_n: int = 128,
                       device: torch.device | None = None, tokens_per_split: int = 2730,
                       min_programs: int = 1024, min_tiles: int = 2) -> int:
    """A fixed split count from static shapes only (CUDA-graph safe).

    At most ``tokens_per_split`` history tokens per program, at least ``min_programs`` programs (fills the
    H200's 132 SMs several times over; measured in docs/KERNELS.md), at least ``min_tiles`` tiles per split (the
    pipelined loop overlaps the second tile's copies with the first tile's math, and fewer partials make the
    merge one pass: 1 x 4K 12.6 µs at 30 splits of two tiles vs 13.4 at 59 of one; docs/KERNELS.md). The
    bounds meet at large batch: 2730 tokens gives 12 splits at 16 x 32K and 48 at 16 x 128K (whole-wave counts
    37-99 were no faster there); batch 1 from 32K stays at 1024 programs.
    """
    del device  # the measured choice does not depend on the SM count within H100/H200; kept for callers
    want = max(math.ceil(hist_capacity / tokens_per_split), math.ceil(min_programs / max(batch * h_kv, 1)))
    most = max(1, math.ceil(hist_capacity / (min_tiles * block_n)))
    return max(1, min(want, most, 256))


# Stage-1 programs per (batch, KV head) that share the BF16 sink + recent rows (320 at the defaults): one program
# looping over all of them was the critical path at short contexts (docs/KERNELS.md); 8 ranges are at most 3
# one-warp tiles of 16 rows each.
TIER_PARTS = 8


def make_workspace(batch: int, h_q: int, d: int, num_splits: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for the partials: ``o float32 [B, H_q, S+TIER_PARTS, D]``, ``lse float32 [B, H_q, S+TIER_PARTS]``."""
    n = num_splits + TIER_PARTS
    return (torch.empty(batch, h_q, n, d, dtype=torch.float32, device=device),
            torch.empty(batch, h_q, n, dtype=torch.float32, device=device))


def _lengths(name: str, v: torch.Tensor | int, b: int, cap: int, dev: torch.device) -> torch.Tensor:
    if isinstance(v, int):
        if not 0 <= v <= cap:
            raise ValueError(f"{name}: {v} outside [0, {cap}]")
        return torch.full((b,), v, dtype=torch.int32, device=dev)
    check_tensor(name, v, f"int32 [{b}]", (b,), (torch.int32,), dev)
    if os.environ.get("OSCAR_KERNEL_DEBUG") == "1" and b and (int(v.min()) < 0 or int(v.max()) > cap):
        raise ValueError(f"{name}: values outside [0, {cap}]")
    return v


def _tier(name: str, t: torch.Tensor, b: int | None, h_kv: int, d: int, act: torch.dtype, dev: torch.device) -> None:
    lead = "rows" if b is None else b  # (a tier read in place through a TierIndex: any number of rows)
    check_tensor(name, t, f"{act} [{lead}, {h_kv}, T, {d}] (last dim contiguous)", (b, h_kv, None, d), (act,), dev)
    if t.stride(-1) != 1:
        raise bad_tensor(name, t, "a last dim with stride 1")


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The kernel reads K and V of a tier with K's strides: shapes must match and strides agree on every dim that
    is indexed beyond 0 (a size-1 dim's stride is never used, and ``.contiguous()`` keeps whatever it was)."""
    return a.shape == b.shape and all(sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride(), strict=True)
                                      if n > 1)


@dataclass(frozen=True)
class RopeMean:
    """What stage 1 needs to add the position-dependent key mean's term itself (``quant.key_mean: rope``,
    ``int2_decode``'s module docstring) instead of reading a ``[B, H_q, L]`` ``logit_bias``: the term of INT2
    history slot ``n`` of row ``b`` is ``sm_scale·scaling·q·RoPE_p(m_pre)`` at ``p = position0[b] + n``
    (``reference.rope_mean_logits`` is its float64 spec).

    Attributes:
        mean_pre: float32 ``[H_kv, D]`` pre-RoPE key mean per KV head.
        table: float32 ``[P, D]`` contiguous rows ``[cos θp | sin θp]`` (``rope_ops.position_table``) covering
            ``max(position0) + L`` (``L`` the block table's capacity) and at least ``block_n`` rows. Stage 1 reads
            row ``position0[b] + n`` for every history token it scores: a table too short is read out of bounds
            (``OSCAR_KERNEL_DEBUG=1`` checks it, at the cost of a device sync).
        position0: int32 ``[B]`` RoPE position of each row's history slot 0 (device tensor: CUDA-graph safe).
        scaling: the rotary embedding's attention scaling (YaRN's mscale; 1 for plain RoPE).
    """

    mean_pre: torch.Tensor
    table: torch.Tensor
    position0: torch.Tensor
    scaling: float = 1.0

    def checked(self, b: int, h_kv: int, d: int, cap: int, block_n: int, dev: torch.device) -> RopeMean:
        """This, validated for a launch (raises ``ValueError`` naming the tensor)."""
        check_tensor("rope_mean.mean_pre", self.mean_pre, f"float32 [{h_kv}, {d}]", (h_kv, d), (torch.float32,), dev)
        check_tensor("rope_mean.table", self.table, f"float32 [P, {d}] (position_table)", (None, d),
                     (torch.float32,), dev)
        check_tensor("rope_mean.position0", self.position0, f"int32 [{b}]", (b,), (torch.int32,), dev)
        if not self.mean_pre.is_contiguous() or not self.table.is_contiguous():
            raise ValueError("rope_mean: mean_pre and table must be contiguous")
        rows = int(self.table.shape[0])
        if rows < block_n:
            raise bad_tensor("rope_mean.table", self.table, f"float32 [>= {block_n}, {d}] (at least one tile of rows)")
        if os.environ.get("OSCAR_KERNEL_DEBUG") == "1" and b:
            lo, hi = int(self.position0.min()), int(self.position0.max())
            if lo < 0 or hi + cap > rows:
                raise ValueError(f"rope_mean.position0: positions {lo}..{hi} + {cap} slots outside the table's {rows} rows")
        return self


@dataclass(frozen=True)
class LowPlane:
    """INT4 keys (``reference`` formula 9) for stage 1: the key pages hold the high plane as INT2 rows with their
    scale and zero; this is the low plane, read in the same tile and added at a quarter of the scale.

    Two forms:

    - slot-indexed (``first`` given): ``codes`` uint8 ``[B, H_kv, C, D/4]`` quarter packed like the key rows, rows
      contiguous, history token ``n`` of row ``b`` at slot ``first[b] + n`` (the transformers cache);
    - paged (``first`` None): ``codes`` has the key pages' shape and strides ``[pages, H_kv, P, D/4]`` and token
      ``n`` sits where its key row does, through the same block table (the vLLM backend's pages).

    Attributes:
        codes: the plane, as above.
        first: int32 ``[B]``: the slot of each row's history token 0 (device tensor: CUDA-graph safe), or None for
            a paged plane. Stage 1 reads slots ``first[b] .. first[b] + hist_len[b] - 1``: ``OSCAR_KERNEL_DEBUG=1``
            checks they exist, at the cost of a device sync.
    """

    codes: torch.Tensor
    first: torch.Tensor | None = None

    @property
    def paged(self) -> bool:
        return self.first is None

    def checked(self, b: int, h_kv: int, d: int, hist_len: torch.Tensor, dev: torch.device,
                k_codes: torch.Tensor | None = None) -> LowPlane:
        """This, validated for a launch (raises ``ValueError`` naming the tensor); ``k_codes``: the key pages a
        paged plane must match in shape and strides."""
        if self.first is None:
            kc = k_codes
            if kc is None or self.codes.dtype != torch.uint8 or self.codes.device != kc.device or \
                    self.codes.shape != kc.shape or self.codes.stride() != kc.stride():
                want = "the k_cache.packed shape and strides" if kc is None else \
                    f"uint8 {list(kc.shape)} with strides {kc.stride()} (the key pages')"
                raise bad_tensor("low_plane.codes", self.codes, f"{want} (a paged low plane, first=None)")
            return self
        check_tensor("low_plane.codes", self.codes, f"uint8 [{b}, {h_kv}, C, {d // 4}]", (b, h_kv, None, d // 4),
                     (torch.uint8,), dev)
        if self.codes.stride(-1) != 1 or self.codes.stride(-2) != d // 4:
            raise bad_tensor("low_plane.codes", self.codes, "contiguous rows")
        check_tensor("low_plane.first", self.first, f"int32 [{b}]", (b,), (torch.int32,), dev)
        if os.environ.get("OSCAR_KERNEL_DEBUG") == "1" and b:
            ends = self.first.long() + hist_len.long()
            if int(self.first.min()) < 0 or int(ends.max()) > self.codes.shape[2]:
                raise ValueError(f"low_plane.first: slots up to {int(ends.max())} outside the plane's "
                                 f"{self.codes.shape[2]}")
        return self


@dataclass(frozen=True)
class TierIndex:
    """Stage 1 reads the BF16 tiers where the vLLM backend keeps them, instead of gathered copies
    (``ops.tier_gather``): with this, ``sink_k``/``sink_v`` are the sink storage ``[rows, H_kv, S, D]`` and
    ``recent_k``/``recent_v`` the ring storage ``[rows, H_kv, R, D]`` (uncentred), and the values stage 1 reads are
    bit for bit those the gather would have written (the same centring, the same order): one launch fewer.

    Attributes:
        rows: int64 ``[B]``: each sequence's row of the storage.
        ring_index: int64 ``[B, R']``: ring slot of each sequence's ``j``-th recent token, oldest first (entries in
            ``[0, R)``: ``OSCAR_KERNEL_DEBUG=1`` checks them, and ``rows``, at the cost of a device sync);
            ``recent_len`` is at most ``R'``.
        k_mean, v_mean: float32 ``[D]`` or ``[H_kv, D]``: subtracted from every row read (``float32(x) - mean``,
            rounded to the activation dtype).
    """

    rows: torch.Tensor
    ring_index: torch.Tensor
    k_mean: torch.Tensor
    v_mean: torch.Tensor

    def args(self, b: int, h_kv: int, d: int, storage: tuple[torch.Tensor, torch.Tensor],
             dev: torch.device) -> tuple[Any, ...]:
        """Stage 1's ``DIRECT_TIERS`` arguments, validated (raises ``ValueError`` naming the tensor)."""
        check_tensor("tier_index.rows", self.rows, f"int64 [{b}]", (b,), (torch.int64,), dev)
        check_tensor("tier_index.ring_index", self.ring_index, f"int64 [{b}, R']", (b, None), (torch.int64,), dev)
        if self.ring_index.stride(-1) != 1:
            raise bad_tensor("tier_index.ring_index", self.ring_index, "a contiguous last dim")
        km, km_stride = mean_arg("tier_index.k_mean", self.k_mean, h_kv, d, dev)
        vm, vm_stride = mean_arg("tier_index.v_mean", self.v_mean, h_kv, d, dev)
        if km is None or vm is None:
            raise ValueError("tier_index.k_mean, tier_index.v_mean: expected float32 [D] or [H_kv, D], got None")
        if os.environ.get("OSCAR_KERNEL_DEBUG") == "1" and b:
            n_rows = min(int(storage[0].shape[0]), int(storage[1].shape[0]))
            if int(self.rows.min()) < 0 or int(self.rows.max()) >= n_rows:
                raise ValueError(f"tier_index.rows: entries outside [0, {n_rows})")
            if self.ring_index.numel() and (int(self.ring_index.min()) < 0 or
                                            int(self.ring_index.max()) >= storage[1].shape[2]):
                raise ValueError(f"tier_index.ring_index: entries outside [0, {int(storage[1].shape[2])})")
        return (self.rows, self.ring_index, self.ring_index.stride(0), km, vm, km_stride, vm_stride)


# fp16 copies of position tables' first rows, per live table (by id, dropped when the table is freed; a table is
# never written after position_table builds it), so a plan built every decode step does not cast them again
_TABLE_HEADS: dict[int, tuple[weakref.ref[torch.Tensor], dict[int, torch.Tensor]]] = {}


def _fp16_head(table: torch.Tensor, rows: int) -> torch.Tensor:
    """``table[:rows]`` as fp16 (made once per table and row count: at fixed addresses for CUDA graphs)."""
    key = id(table)
    entry = _TABLE_HEADS.get(key)
    if entry is None or entry[0]() is not table:
        entry = _TABLE_HEADS[key] = (weakref.ref(table, lambda _: _TABLE_HEADS.pop(key, None)), {})
    heads = entry[1]
    if rows not in heads:
        heads[rows] = table[:rows].to(torch.float16)
    return heads[rows]


def rope_args(q: torch.Tensor, rope: RopeMean, qk_scale: float, block_n: int) -> tuple[Any, ...]:
    """Stage 1's ``HAS_ROPE`` arguments: raw q and its strides, ``m_pre`` and its head stride, the table, its first
    ``block_n`` rows as fp16 (the tiles' fixed operand), the first positions and ``scaling·sm_scale·log2(e)``
    (``qk_scale`` is ``sm_scale·log2(e)``)."""
    return (q, q.stride(0), q.stride(1), rope.mean_pre, rope.mean_pre.stride(0), rope.table,
            _fp16_head(rope.table, block_n), rope.position0, float(rope.scaling) * qk_scale)


class DecodePlan:
    """A validated decode launch: check once, :meth:`run` many times (CUDA-graph capturable).

    The plan keeps references to its tensors; refill them in place (new q, new cache rows, new lengths) and call
    :meth:`run` again, or capture :meth:`run` in a CUDA graph and replay it. Arguments as in
    :func:`decode_attention`; ``q_rot``: ``q @ R_K · query_scale(sm_scale, D)`` computed elsewhere (the query jobs
    of ``tier_gather(query=...)`` or ``rotate_kv(query=...)``, the same tile function): stage 1 reads it and the
    plan launches two kernels; ``tier_index``: the tiers are read in place (:class:`TierIndex`).
    """

    def __init__(
        self, q: torch.Tensor, k_cache: QuantizedRows, v_cache: QuantizedRows, block_table: torch.Tensor,
        hist_len: torch.Tensor | int, sink_k: torch.Tensor, sink_v: torch.Tensor, sink_len: torch.Tensor | int,
        recent_k: torch.Tensor, recent_v: torch.Tensor, recent_len: torch.Tensor | int, *,
        rotation_k: torch.Tensor | None = None, rotation_v: torch.Tensor | None = None,
        mean_v: torch.Tensor | None = None, sm_scale: float | None = None, num_splits: int | None = None,
        config: DecodeConfig | None = None, out: torch.Tensor | None = None,
        workspace: tuple[torch.Tensor, torch.Tensor] | None = None, paged: bool = True,
        logit_bias: torch.Tensor | None = None, rope_mean: RopeMean | None = None,
        low_plane: LowPlane | None = None, q_rot: torch.Tensor | None = None, tier_index: TierIndex | None = None,
    ) -> None:
        cfg = config or default_config(int(q.shape[0]) if q.dim() == 3 else 1, rope_mean is not None)
        dev = q.device
        if cfg.pdl and dev.type != "cuda":  # griddepcontrol is a CUDA launch attribute; the interpreter runs serially
            cfg = replace(cfg, pdl=False)
        if cfg.prefetch and dev.type != "cuda":  # an inline-PTX cache hint: nothing to run in the interpreter
            cfg = replace(cfg, prefetch=False)
        if not 1 <= cfg.hist_stages <= 8:
            raise ConfigError(f"config: hist_stages must be in 1..8, got {cfg.hist_stages}")
        if cfg.block_n % 4 or cfg.block_n < 16 or cfg.block_n & (cfg.block_n - 1) or \
                (dev.type == "cuda" and cfg.block_n < 64):
            raise ConfigError(f"config: block_n must be a power of two >= 64 (>= 16 in the interpreter), got {cfg}")
        if q.dim() != 3 or q.dtype not in ACT or q.stride(-1) != 1 or q.shape[-1] not in (64, 128):
            raise bad_tensor("q", q, "bf16/fp16 [B, H_q, D] with D in {64, 128} and a contiguous last dim")
        b, h_q, d = q.shape
        e_prog = cfg.merge_cols or (d if b * h_q >= 128 else 32)
        if e_prog not in (32, d) or cfg.merge_block_p < 2 or cfg.merge_block_p & (cfg.merge_block_p - 1):
            raise ConfigError(f"config: merge_cols must be 0, 32 or {d} and merge_block_p a power of two >= 2, got "
                              f"{cfg.merge_cols}, {cfg.merge_block_p}")
        kc = k_cache.packed
        if kc.dim() != 4 or kc.shape[-1] != d // 4 or h_q % max(int(kc.shape[1]), 1):
            raise bad_tensor("k_cache.packed", kc, f"uint8 [pages, H_kv, P, {d // 4}] with H_kv dividing {h_q}")
        h_kv, page = int(kc.shape[1]), int(kc.shape[2])
        mh = cfg.merge_heads
        if mh < 1 or mh & (mh - 1) or (h_q // h_kv) % mh:
            raise ConfigError(f"config: merge_heads must be a power of two dividing the {h_q // h_kv} query heads per KV"
                              f" head, got {mh}")
        vrow, words = _check_cache(k_cache, v_cache, kc, h_kv, page, dev, paged, cfg.meta_words)
        vrow //= 4
        check_tensor("block_table", block_table, f"int32 [{b}, max_pages]", (b, None), (torch.int32,), dev)
        if not paged and (block_table.shape[1] != 1 or kc.shape[0] != b):
            raise ValueError("paged=False needs k_cache [B, H_kv, T, D/4] and a [B, 1] block table (page b = row b)")
        if paged and page % 4:
            raise ValueError(f"k_cache.packed: the page size must be a multiple of 4 (token quads), got {page}")
        if os.environ.get("OSCAR_KERNEL_DEBUG") == "1" and block_table.numel():
            if int(block_table.min()) < 0 or int(block_table.max()) >= kc.shape[0]:
                raise ValueError(f"block_table: entries outside [0, {kc.shape[0]})")
        cap = int(block_table.shape[1]) * page
        hl = _lengths("hist_len", hist_len, b, cap, dev)
        for nm, t in (("sink_k", sink_k), ("sink_v", sink_v), ("recent_k", recent_k), ("recent_v", recent_v)):
            _tier(nm, t, b if tier_index is None else None, h_kv, d, q.dtype, dev)
        for a, b_, pair in ((sink_k, sink_v, "sink_k/sink_v"), (recent_k, recent_v, "recent_k/recent_v")):
            if not _same_layout(a, b_):
                raise ValueError(f"{pair} must share shape and strides (over dims of size > 1), got "
                                 f"{tuple(a.shape)}/{tuple(b_.shape)} with strides {a.stride()}/{b_.stride()}")
        sl = _lengths("sink_len", sink_len, b, int(sink_k.shape[2]), dev)
        rl = _lengths("recent_len", recent_len, b, int(recent_k.shape[2] if tier_index is None else
                                                        tier_index.ring_index.shape[1]), dev)
        direct = tier_index.args(b, h_kv, d, (sink_k, recent_k), dev) if tier_index is not None else None
        rk, rk_stride = rotation_arg("rotation_k", rotation_k, h_kv, d, dev)
        rv, rv_stride = rotation_arg("rotation_v", rotation_v, h_kv, d, dev)
        mu, mu_stride = mean_arg("mean_v", mean_v, h_kv, d, dev)
        if rk is None:
            rk, rk_stride = torch.eye(d, dtype=torch.float32, device=dev), 0
        s = num_splits or default_num_splits(b, h_kv, cap, cfg.block_n, dev)
        o_part, lse_part = workspace if workspace is not None else make_workspace(b, h_q, d, s, dev)
        n_parts = s + TIER_PARTS
        check_tensor("workspace[0]", o_part, f"float32 [{b}, {h_q}, {n_parts}, {d}]", (b, h_q, n_parts, d), (torch.float32,), dev)
        check_tensor("workspace[1]", lse_part, f"float32 [{b}, {h_q}, {n_parts}]", (b, h_q, n_parts), (torch.float32,), dev)
        if out is None:
            out = torch.empty(b, h_q, d, dtype=q.dtype, device=dev)
        check_tensor("out", out, f"{q.dtype} [{b}, {h_q}, {d}]", (b, h_q, d), (q.dtype,), dev)
        if out.stride(-1) != 1:
            raise bad_tensor("out", out, "a contiguous last dim")
        if logit_bias is not None:
            check_tensor("logit_bias", logit_bias, f"float32 [{b}, {h_q}, >= {cap}] (one value per history slot)",
                         (b, h_q, None), (torch.float32,), dev)
            if logit_bias.shape[2] < cap or logit_bias.stride(-1) != 1:
                raise bad_tensor("logit_bias", logit_bias, f"float32 [{b}, {h_q}, L] with L >= {cap} (the block "
                                 "table's capacity) and a contiguous last dim")
        bias = logit_bias if logit_bias is not None else o_part
        if cfg.rope_prec not in ("tf32x3", "ieee", "tf32", "fp16"):
            raise ConfigError(f"config: rope_prec must be tf32x3, ieee, tf32 or fp16, got {cfg.rope_prec!r}")
        rope = rope_mean.checked(b, h_kv, d, cap, cfg.block_n, dev) if rope_mean is not None else None
        lo = low_plane.checked(b, h_kv, d, hl, dev, kc if paged else None) if low_plane is not None else None
        vc = v_cache.packed
        g = h_q // h_kv
        gp = max(cfg.min_gp, 1 << (g - 1).bit_length())
        scale = query_scale(sm_scale, d)
        self.rotates_q = q_rot is None  # else q_rot is q @ R_K · scale already (tier_gather's query jobs)
        if q_rot is None:
            q_rot = torch.empty_like(q)
        elif q_rot.shape != q.shape or q_rot.dtype != q.dtype or q_rot.device != dev or q_rot.stride(-1) != 1:
            raise bad_tensor("q_rot", q_rot, f"{q.dtype} {list(q.shape)} on {dev} with a contiguous last dim")
        self.out, self.num_splits, self.config = out, s, cfg
        self.meta_words = words  # 8-bit metadata read as 32-bit words (resolved from cfg.meta_words)
        self._kernels = triton_modules()[1]
        rot_gp, rot_qb = query_rows(g, max(16, gp))
        self._rot: tuple[Any, ...] = ((math.ceil(b / rot_qb) * h_kv, d // 32), (
            q, q.stride(0), q.stride(1), rk, rk_stride, q_rot, q_rot.stride(0), q_rot.stride(1), scale, b),
            dict(H_KV=h_kv, GROUP=g, GP=rot_gp, D=d, BLOCK_E=32, PREC="tf32x3", PDL=cfg.pdl, QB=rot_qb,
                 num_warps=4))
        ks, kz, vs, vz = k_cache.scale, k_cache.zero, v_cache.scale, v_cache.zero
        self._stage1: tuple[Any, ...] = ((b * h_kv, n_parts), (
            q_rot, q_rot.stride(0), q_rot.stride(1), kc, kc.stride(0), kc.stride(1),
            vc, vc.stride(0), vc.stride(1),
            ks, kz, vs, vz, ks.stride(0), ks.stride(1), block_table, block_table.stride(0), hl,
            bias, bias.stride(0) if logit_bias is not None else 0, bias.stride(1) if logit_bias is not None else 0,
            *(rope_args(q, rope, scale, cfg.block_n) if rope is not None else
              (o_part, 0, 0, o_part, 0, o_part, o_part, hl, 0.0)),
            *((lo.codes, lo.codes.stride(0), lo.codes.stride(1), hl if lo.first is None else lo.first)
              if lo is not None else (kc, 0, 0, hl)),
            sink_k, sink_v, sink_k.stride(0), sink_k.stride(1), sink_k.stride(2), sl,
            recent_k, recent_v, recent_k.stride(0), recent_k.stride(1), recent_k.stride(2), rl,
            *(direct if direct is not None else (hl, hl, 0, o_part, o_part, 0, 0)),
            o_part, lse_part, o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1), s),
            dict(H_KV=h_kv, GROUP=g, GP=gp, D=d, BLOCK_N=cfg.block_n, BLOCK_NB=cfg.block_nb, PTX=dev.type == "cuda",
                 ACT=triton_dtype(q.dtype), PAGED=paged, PAGE=page if paged else 1, TIER_PARTS=TIER_PARTS, PDL=cfg.pdl,
                 VROW=vrow, HAS_BIAS=logit_bias is not None, HAS_ROPE=rope is not None, ROPE_PREC=cfg.rope_prec,
                 HAS_LO=0 if lo is None else 2 if lo.paged else 1, META8=(2 if words else 1) if ks.dtype == torch.uint8 else 0,
                 DIRECT_TIERS=direct is not None,
                 TIER_PREFETCH=direct is None if cfg.tier_prefetch is None else cfg.tier_prefetch,
                 HIST_STAGES=cfg.hist_stages, HOIST_Q=cfg.hoist_q, PREFETCH=cfg.prefetch, num_warps=cfg.num_warps, **({"launch_pdl": True} if cfg.pdl else {}),
                 num_stages=cfg.num_stages, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {})))
        self._merge: tuple[Any, ...] = ((b * h_q // mh, d // e_prog), (
            o_part, lse_part, o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1),
            mu if mu is not None else o_part, mu_stride, rv if rv is not None else o_part, rv_stride,
            out, out.stride(0), out.stride(1), n_parts),
            dict(H_Q=h_q, GROUP=g, D=d, SP=max(2, 1 << (n_parts - 1).bit_length()), BLOCK_E=32, BLOCK_P=cfg.merge_block_p,
                 HAS_MU=mu is not None, HAS_R=rv is not None, E_PROG=e_prog, PDL=cfg.pdl, HEADS=mh, num_warps=4,
                 **({"launch_pdl": True} if cfg.pdl else {})))

    def run(self) -> torch.Tensor:
        """Launch the three kernels (rotate q, stage 1, merge + rotate back; two with ``q_rot`` given); returns
        ``out [B, H_q, D]``."""
        k = self._kernels
        if self.rotates_q:
            k._rotate_q_kernel[self._rot[0]](*self._rot[1], **self._rot[2])
        LAST_LAUNCH["stage1"] = k._decode_stage1_kernel[self._stage1[0]](*self._stage1[1], **self._stage1[2])
        k._merge_rotate_kernel[self._merge[0]](*self._merge[1], **self._merge[2])
        return self.out


def _check_cache(k_cache: QuantizedRows, v_cache: QuantizedRows, kc: torch.Tensor, h_kv: int, page: int,
                 dev: torch.device, paged: bool = True, words: bool | None = None) -> tuple[int, bool]:
    """Keys: quarter-packed rows ``[pages, H_kv, P, D/4]``; values: token quads ``[pages, H_kv, P/R·D, R/4]`` with
    ``R = min(P, 64)`` tokens per row (paged; pages above 64 tokens are multiples of 64), ``[B, H_kv, ⌈T/64⌉·D, 16]``
    (non-paged). Returns ``R`` and whether 8-bit metadata is read as 32-bit words (``words``: None picks them when
    every metadata tensor sits on 4-byte boundaries, True requires it)."""
    d = 4 * int(kc.shape[-1])
    if paged and page > TOKEN_QUAD_ROW and page % TOKEN_QUAD_ROW:
        raise ValueError(f"k_cache.packed: pages above {TOKEN_QUAD_ROW} tokens must be multiples of "
                         f"{TOKEN_QUAD_ROW} (token-quad rows), got {page}")
    row = token_quad_row(page) if paged else TOKEN_QUAD_ROW
    vshape = (kc.shape[0], h_kv, d * max(1, -(-page // row)), (row + 3) // 4)
    check_tensor("v_cache.packed", v_cache.packed, f"uint8 {list(vshape)} (token quads)", vshape, (torch.uint8,), dev)
    vc = v_cache.packed
    if vc.stride(-1) != 1:
        raise bad_tensor("v_cache.packed", vc, "a contiguous last dim (token quads)")
    if kc.stride(-1) != 1 or kc.stride(-2) != kc.shape[-1]:
        raise bad_tensor("k_cache.packed", kc, "contiguous rows")
    off_word: tuple[str, torch.Tensor] | None = None  # metadata whose bytes cannot be read a 32-bit word at a time
    for nm, rows in (("k_cache", k_cache), ("v_cache", v_cache)):
        for part in ("scale", "zero"):
            t = getattr(rows, part)
            check_tensor(f"{nm}.{part}", t, f"[pages, {h_kv}, {page}, 1] (G = D)", (kc.shape[0], h_kv, page, 1),
                         META_WRITE, dev)
            if t.stride() != k_cache.scale.stride() or t.dtype != k_cache.scale.dtype or t.stride(2) != 1:
                raise bad_tensor(f"{nm}.{part}", t, "the dtype and strides of k_cache.scale, contiguous along P")
            if off_word is None and (t.data_ptr() % 4 or t.stride(0) % 4 or t.stride(1) % 4 or page % 4):
                off_word = (f"{nm}.{part}", t)
    meta8 = k_cache.scale.dtype == torch.uint8
    if words and meta8 and off_word is not None:  # formula 10's bytes read a token quad (one 32-bit word) at a time
        raise bad_tensor(*off_word, "8-bit metadata starting on a 4-byte boundary, with strides and page size "
                         "multiples of 4 (a token quad's bytes are one 32-bit word)")
    return row, meta8 and (off_word is None if words is None else bool(words))


def decode_attention(
    q: torch.Tensor, k_cache: QuantizedRows, v_cache: QuantizedRows, block_table: torch.Tensor,
    hist_len: torch.Tensor | int, sink_k: torch.Tensor, sink_v: torch.Tensor, sink_len: torch.Tensor | int,
    recent_k: torch.Tensor, recent_v: torch.Tensor, recent_len: torch.Tensor | int, **kwargs: Any,
) -> torch.Tensor:
    """One decode step: ``softmax(q·Kᵀ)·V`` over sink + INT2 history + recent, back in the model's space.

    Args:
        q: ``[B, H_q, D]`` bf16/fp16 post-RoPE queries, **not** rotated (``q @ R_K`` happens on the GPU).
        k_cache: paged INT2 keys (``packed uint8 [pages, H_kv, P, D/4]``, quarter-packed contiguous rows),
            v_cache: paged INT2 values in token quads (``packed uint8 [pages, H_kv, P/R·D, R/4]``, R = min(P, 64), from
            :func:`new_paged_cache` with ``layout="token_quads"``); both with ``scale``/``zero``
            ``md [pages, H_kv, P, 1]`` (the kernel supports ``G = D``) of identical strides; ``P % 4 == 0``.
        block_table: int32 ``[B, max_pages]``; hist_len: int32 ``[B]`` (or an int for all rows).
        sink_k, sink_v, recent_k, recent_v: ``[B, H_kv, T_tier, D]`` in q's dtype, rotated (and centred)
            like the INT2 tier; sink_len, recent_len: int32 ``[B]`` valid rows per sequence (or ints).
        kwargs: ``rotation_k`` (``R_K`` ``[D, D]``/``[H_kv, D, D]`` float32), ``rotation_v`` and ``mean_v``
            (output ``(o + mu_V) @ R_Vᵀ``; None = identity / zero), ``sm_scale`` (default ``D**-0.5``),
            ``logit_bias`` (float32 ``[B, H_q, L]``, ``L`` at least the block table's capacity: added to the scaled
            logit ``q·k·sm_scale`` of INT2 history token ``n`` of each query head; the BF16 tiers take none),
            ``rope_mean`` (:class:`RopeMean`: the position-dependent key mean's term, computed in stage 1),
            ``low_plane`` (:class:`LowPlane`: INT4 keys' low plane, read in stage 1 beside the pages' high plane),
            ``num_splits`` (default from static shapes), ``config`` (:class:`DecodeConfig`), ``out``
            (``[B, H_q, D]`` result buffer), ``workspace`` (from :func:`make_workspace`).

    Returns:
        ``out [B, H_q, D]`` in q's dtype.
    """
    return DecodePlan(q, k_cache, v_cache, block_table, hist_len, sink_k, sink_v, sink_len,
                      recent_k, recent_v, recent_len, **kwargs).run()


def decode_attention_contiguous(
    q: torch.Tensor, hist_k: QuantizedRows, hist_v: QuantizedRows,
    sink_k: torch.Tensor, sink_v: torch.Tensor, recent_k: torch.Tensor, recent_v: torch.Tensor, *,
    hist_len: torch.Tensor | int | None = None, sink_len: torch.Tensor | int | None = None,
    recent_len: torch.Tensor | int | None = None, **kwargs: Any,
) -> torch.Tensor:
    """:func:`decode_attention` over a non-paged cache (the transformers cache's layout).

    Args:
        q: ``[B, H_q, D]`` or ``[B, H_q, 1, D]`` (the result has the same shape).
        hist_k: ``packed uint8 [B, H_kv, T, D/4]``; hist_v: token quads ``packed uint8 [B, H_kv, D, ⌈T/4⌉]``
            (``reference.rows_to_token_quads``); both with ``scale``/``zero`` ``[B, H_kv, T, 1]``.
        sink_k, sink_v, recent_k, recent_v: ``[B, H_kv, T_tier, D]`` rotated tiers.
        hist_len, sink_len, recent_len: valid rows per sequence (default: all ``T`` rows).
        kwargs: passed on (rotation_k, rotation_v, mean_v, sm_scale, logit_bias, rope_mean, low_plane, num_splits, config,
            out, workspace).
    """
    squeeze = q.dim() == 4
    if squeeze:
        if q.shape[2] != 1:
            raise bad_tensor("q", q, "[B, H_q, 1, D] (one decode query per sequence)")
        q = q[:, :, 0]
    b = int(q.shape[0])
    pk = hist_k.packed
    if pk.dim() != 4 or pk.shape[0] != b:
        raise bad_tensor("hist_k.packed", pk, f"uint8 [{b}, H_kv, T, D/4]")
    t = int(pk.shape[2])
    table = torch.arange(b, dtype=torch.int32, device=q.device).unsqueeze(1)  # one page of T rows per sequence
    out = decode_attention(
        q, hist_k, hist_v, table, t if hist_len is None else hist_len,
        sink_k, sink_v, int(sink_k.shape[2]) if sink_len is None else sink_len,
        recent_k, recent_v, int(recent_k.shape[2]) if recent_len is None else recent_len, paged=False, **kwargs)
    return out.unsqueeze(2) if squeeze else out
