"""Launchers for oscar's INT2 Triton kernels: input checks, allocation, grids, configs.

Public API (all tensors on one CUDA device; on CPU only under ``TRITON_INTERPRET=1``, for tests):

- :func:`quantize_write` — rotate, centre, clip, quantize, pack rows ``[N, H_kv, D]`` into a paged cache.
- :func:`quantize_rows` — the same, returning :class:`~oscar_kernels.reference.QuantizedRows` for
  ``x [B, H_kv, T, D]`` (the Triton twin of ``reference.quantize_rows``).
- :func:`decode_attention` — one decode step over paged INT2 history + BF16 sink and recent tiers;
  :class:`DecodePlan` — the same, validated once and launched many times (CUDA graphs, benchmarks).
- :func:`decode_attention_contiguous` — the same over a non-paged cache (``codes [B, H_kv, T, D/4]``).
- :func:`new_paged_cache`, :func:`make_workspace`, :class:`DecodeConfig`, :func:`default_config`,
  :func:`default_num_splits`.

Paged layout: keys ``codes uint8 [num_pages, H_kv, P, D/4]`` (quarter-packed rows), values
``codes uint8 [num_pages, H_kv, P/R·D, R/4]`` (token quads in rows of ``R = min(P, 64)`` tokens),
``scale``/``zero`` ``md [num_pages, H_kv, P, D/G]``,
``block_table int32 [B, max_pages]``; token ``t`` of sequence ``b`` lives in page ``block_table[b, t // P]``
at offset ``t % P``. Every launch is CUDA-graph safe: lengths are device tensors, the split count is fixed
by static shapes, nothing syncs with the host (except the opt-in ``OSCAR_KERNEL_DEBUG=1`` range check).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from oscar_kernels.reference import TOKEN_QUAD_ROW, QuantizedRows, token_quad_row

__all__ = [
    "ConfigError",
    "DecodeConfig",
    "DecodePlan",
    "decode_attention",
    "decode_attention_contiguous",
    "default_config",
    "default_num_splits",
    "make_workspace",
    "new_paged_cache",
    "quantize_rows",
    "quantize_write",
]

_ACT = (torch.bfloat16, torch.float16)
_META = (torch.bfloat16, torch.float16, torch.float32)
_LOG2E = 1.4426950408889634
LAST_LAUNCH: dict[str, Any] = {}  # kernel name -> compiled handle of the latest launch (registers, spills, asm)


def _kernels() -> tuple[Any, Any]:
    """Import the Triton modules lazily (``TRITON_INTERPRET`` is read when they are first imported)."""
    from oscar_kernels import int2_decode, int2_pack

    return int2_pack, int2_decode


def _bad(name: str, t: torch.Tensor, expected: str) -> ValueError:
    return ValueError(f"{name}: expected {expected}, got {t.dtype} {tuple(t.shape)} on {t.device}")


def _check(name: str, t: Any, expected: str, shape: tuple[int | None, ...], dtypes: tuple[torch.dtype, ...],
           device: torch.device) -> None:
    """Raise ValueError naming ``t`` (shape, dtype, device; never data) unless it matches."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor {expected}, got {type(t).__name__}")
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape, strict=True))
    if not ok or t.dtype not in dtypes or t.device != device:
        raise _bad(name, t, f"{expected} on {device}")


def _ttype(dtype: torch.dtype) -> Any:
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _rot(name: str, r: torch.Tensor | None, h_kv: int, d: int, dev: torch.device) -> tuple[torch.Tensor | None, int]:
    """Rotation ``[D, D]`` or ``[H_kv, D, D]`` float32 -> (contiguous tensor, head stride)."""
    if r is None:
        return None, 0
    shape: tuple[int, ...] = (d, d) if r.dim() == 2 else (h_kv, d, d)
    _check(name, r, f"float32 {list(shape)}", shape, (torch.float32,), dev)
    r = r.contiguous()
    return r, (0 if r.dim() == 2 else d * d)


def _mean(name: str, m: torch.Tensor | None, h_kv: int, d: int, dev: torch.device) -> tuple[torch.Tensor | None, int]:
    if m is None:
        return None, 0
    shape: tuple[int, ...] = (d,) if m.dim() == 1 else (h_kv, d)
    _check(name, m, f"float32 {list(shape)}", shape, (torch.float32,), dev)
    m = m.contiguous()
    return m, (0 if m.dim() == 1 else d)


LAYOUTS = ("rows", "token_quads")


def new_paged_cache(num_pages: int, h_kv: int, page_size: int, d: int, group_size: int | None = None,
                    meta_dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
                    layout: str = "rows") -> QuantizedRows:
    """Empty paged INT2 storage; scale/zero ``[num_pages, H_kv, P, D/G]``.

    ``layout="rows"`` (keys): codes ``uint8 [num_pages, H_kv, P, D/4]``, quarter packing.
    ``layout="token_quads"`` (values, what the decode kernel reads): codes ``uint8 [num_pages, H_kv, P/R·D, R/4]``
    with ``R = min(P, 64)`` tokens per row (``reference.pack_token_quads``; ``P % 16 == 0`` so that every row is
    whole 32-bit words, and pages above 64 tokens are multiples of 64: each 64-token tile is ``D`` rows of 16
    contiguous bytes).
    """
    g = d if group_size is None else group_size
    if layout == "token_quads":
        if page_size % 16 or (page_size > TOKEN_QUAD_ROW and page_size % TOKEN_QUAD_ROW):
            raise ValueError(f"page_size: token quads need a multiple of 16 (of 64 above 64), got {page_size}")
        row = token_quad_row(page_size)
        codes = torch.zeros(num_pages, h_kv, page_size // row * d, row // 4, dtype=torch.uint8, device=device)
    elif layout == "rows":
        codes = torch.zeros(num_pages, h_kv, page_size, d // 4, dtype=torch.uint8, device=device)
    else:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    scale = torch.zeros(num_pages, h_kv, page_size, d // g, dtype=meta_dtype, device=device)
    return QuantizedRows(codes, scale, torch.zeros_like(scale))


def quantize_write(x: torch.Tensor, cache: QuantizedRows, slots: torch.Tensor, *,
                   rotation: torch.Tensor | None = None, mean: torch.Tensor | None = None,
                   clip_ratio: float = 0.0, block_t: int = 16, num_warps: int = 4, layout: str = "rows") -> None:
    """Quantize rows and scatter them into a paged cache, in one launch for all tokens and KV heads.

    Args:
        x: ``[N, H_kv, D]`` bf16/fp16/fp32 post-RoPE keys or values (last dim contiguous).
        cache: paged storage from :func:`new_paged_cache` with the same ``layout`` (``"rows"``:
            ``packed [pages, H_kv, P, D/4]``; ``"token_quads"``: ``packed [pages, H_kv, P/R·D, R/4]``, R = min(P, 64)).
        slots: int64 ``[N]``: destination ``page * P + offset``; negative = skip the row.
        rotation: float32 ``[D, D]`` or ``[H_kv, D, D]``; mean: float32 ``[D]`` or ``[H_kv, D]`` (rotated space).
        clip_ratio: as in ``reference.clip_rows`` (sort-based threshold; ``<= 0``: off).
    """
    dev = x.device
    if x.dim() != 3 or x.dtype not in (*_ACT, torch.float32) or x.shape[-1] % 16 or x.stride(-1) != 1:
        raise _bad("x", x, "bf16/fp16/fp32 [N, H_kv, D] with D % 16 == 0 and contiguous rows")
    n, h_kv, d = x.shape
    codes, scale, zero = cache.packed, cache.scale, cache.zero
    tq = layout == "token_quads"
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if tq:
        _check("cache.packed", codes, f"uint8 [pages, {h_kv}, P/R·{d}, R/4]", (None, h_kv, None, None), (torch.uint8,),
               dev)
        row = 4 * int(codes.shape[-1])
        blocks = int(codes.shape[2]) // d
        if int(codes.shape[2]) % d or blocks < 1 or (blocks > 1 and row != TOKEN_QUAD_ROW):
            raise _bad("cache.packed", codes, f"token-quad pages [pages, {h_kv}, P/R·{d}, R/4] (R = min(P, 64))")
        if codes.shape[-1] % 4 or codes.stride(-1) != 1 or codes.stride(-2) != codes.shape[-1] or \
                codes.stride(1) % 4 or codes.stride(0) % 4 or codes.storage_offset() % 4:
            raise _bad("cache.packed", codes, "contiguous token-quad pages of whole 32-bit words (P % 16 == 0)")
        page_size = blocks * row
    else:
        _check("cache.packed", codes, f"uint8 [pages, {h_kv}, P, {d // 4}]", (None, h_kv, None, d // 4),
               (torch.uint8,), dev)
        page_size = int(codes.shape[2])
    ng = int(scale.shape[-1]) if scale.dim() == 4 else 0
    if ng <= 0 or d % ng or (d // ng) & (d // ng - 1):
        raise _bad("cache.scale", scale, f"[pages, {h_kv}, P, D/G] with G a power of two dividing {d}")
    _check("cache.scale", scale, f"[pages, {h_kv}, P, {ng}]", (codes.shape[0], h_kv, page_size, ng), _META, dev)
    _check("cache.zero", zero, f"{scale.dtype} {list(scale.shape)}", tuple(scale.shape), (scale.dtype,), dev)
    if zero.stride() != scale.stride() or codes.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError("cache: scale and zero must share strides and have contiguous last dims")
    _check("slots", slots, f"int64 [{n}]", (n,), (torch.int64,), dev)
    r, r_stride = _rot("rotation", rotation, h_kv, d, dev)
    mu, mu_stride = _mean("mean", mean, h_kv, d, dev)
    if os.environ.get("OSCAR_KERNEL_DEBUG") == "1" and n and int(slots.max()) >= codes.shape[0] * page_size:
        raise ValueError(f"slots: max slot {int(slots.max())} >= pages*P = {codes.shape[0] * page_size}")
    if n == 0:
        return
    clip_idx = min(int(clip_ratio * d), d - 1) if clip_ratio > 0 else -1
    pack, _ = _kernels()
    grid = (math.ceil(n / block_t), h_kv)
    pack._quantize_write_kernel[grid](
        x, x.stride(0), x.stride(1), r if r is not None else x, r_stride, mu if mu is not None else x, mu_stride,
        slots, codes.view(torch.int32) if tq else codes, codes.stride(0), codes.stride(1), codes.stride(2),
        scale, zero, scale.stride(0), scale.stride(1), scale.stride(2),
        n, page_size, row if tq else 0, clip_idx,
        D=d, G=d // ng, BLOCK_T=block_t, HAS_R=r is not None, HAS_MU=mu is not None, DO_CLIP=clip_idx >= 0,
        TQ=tq, num_warps=num_warps,
    )


def quantize_rows(x: torch.Tensor, rotation: torch.Tensor | None = None, mean: torch.Tensor | None = None,
                  clip_ratio: float = 0.0, group_size: int | None = None,
                  meta_dtype: torch.dtype = torch.bfloat16) -> QuantizedRows:
    """Triton twin of ``reference.quantize_rows`` for ``x [B, H_kv, T, D]`` -> packed ``[B, H_kv, T, D/4]``."""
    if x.dim() != 4:
        raise _bad("x", x, "[B, H_kv, T, D]")
    b, h_kv, t, d = x.shape
    rows = x.permute(0, 2, 1, 3).reshape(b * t, h_kv, d).contiguous()
    cache = new_paged_cache(b * t, h_kv, 1, d, group_size, meta_dtype, x.device)
    slots = torch.arange(b * t, dtype=torch.int64, device=x.device)
    quantize_write(rows, cache, slots, rotation=rotation, mean=mean, clip_ratio=clip_ratio)

    def back(u: torch.Tensor) -> torch.Tensor:
        return u.reshape(b, t, h_kv, -1).permute(0, 2, 1, 3).contiguous()

    return QuantizedRows(back(cache.packed), back(cache.scale), back(cache.zero))


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
    # CUDA: before stage 1 waits for the q rotation, each program prefetches its first tile (INT2 codes, metadata) or
    # its BF16 tier rows into L2 (the DRAM latency overlaps the rotation kernel; at short contexts that is all of it)
    prefetch: bool = True


def default_config(batch: int) -> DecodeConfig:
    """The measured H200 choice (docs/KERNELS.md): one warp per split, 64-token tiles, a double-buffered INT2 loop,
    programmatic dependent launches, L2 prefetch of each program's first tile; from batch 16 the q operands are
    converted to the MMA layout before the loop (``hoist_q``) and the registers are capped at 168 (3 instead of 2
    one-warp programs per scheduler, no spills: 16 x 128K 401 µs vs 424 µs uncapped and 418 µs at a 128 cap with
    spills; at batch 1 the grid is one wave either way and registers buy instruction-level parallelism)."""
    return DecodeConfig(maxnreg=168, hoist_q=True) if batch >= 16 else DecodeConfig()


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
    _check(name, v, f"int32 [{b}]", (b,), (torch.int32,), dev)
    if os.environ.get("OSCAR_KERNEL_DEBUG") == "1" and b and (int(v.min()) < 0 or int(v.max()) > cap):
        raise ValueError(f"{name}: values outside [0, {cap}]")
    return v


def _tier(name: str, t: torch.Tensor, b: int, h_kv: int, d: int, act: torch.dtype, dev: torch.device) -> None:
    _check(name, t, f"{act} [{b}, {h_kv}, T, {d}] (last dim contiguous)", (b, h_kv, None, d), (act,), dev)
    if t.stride(-1) != 1:
        raise _bad(name, t, "a last dim with stride 1")


class DecodePlan:
    """A validated decode launch: check once, :meth:`run` many times (CUDA-graph capturable).

    The plan keeps references to its tensors; refill them in place (new q, new cache rows, new lengths) and call
    :meth:`run` again, or capture :meth:`run` in a CUDA graph and replay it. Arguments as in
    :func:`decode_attention`.
    """

    def __init__(
        self, q: torch.Tensor, k_cache: QuantizedRows, v_cache: QuantizedRows, block_table: torch.Tensor,
        hist_len: torch.Tensor | int, sink_k: torch.Tensor, sink_v: torch.Tensor, sink_len: torch.Tensor | int,
        recent_k: torch.Tensor, recent_v: torch.Tensor, recent_len: torch.Tensor | int, *,
        rotation_k: torch.Tensor | None = None, rotation_v: torch.Tensor | None = None,
        mean_v: torch.Tensor | None = None, sm_scale: float | None = None, num_splits: int | None = None,
        config: DecodeConfig | None = None, out: torch.Tensor | None = None,
        workspace: tuple[torch.Tensor, torch.Tensor] | None = None, paged: bool = True,
    ) -> None:
        cfg = config or default_config(int(q.shape[0]) if q.dim() == 3 else 1)
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
        if q.dim() != 3 or q.dtype not in _ACT or q.stride(-1) != 1 or q.shape[-1] not in (64, 128):
            raise _bad("q", q, "bf16/fp16 [B, H_q, D] with D in {64, 128} and a contiguous last dim")
        b, h_q, d = q.shape
        e_prog = cfg.merge_cols or (d if b * h_q >= 128 else 32)
        if e_prog not in (32, d) or cfg.merge_block_p < 2 or cfg.merge_block_p & (cfg.merge_block_p - 1):
            raise ConfigError(f"config: merge_cols must be 0, 32 or {d} and merge_block_p a power of two >= 2, got "
                              f"{cfg.merge_cols}, {cfg.merge_block_p}")
        kc = k_cache.packed
        if kc.dim() != 4 or kc.shape[-1] != d // 4 or h_q % max(int(kc.shape[1]), 1):
            raise _bad("k_cache.packed", kc, f"uint8 [pages, H_kv, P, {d // 4}] with H_kv dividing {h_q}")
        h_kv, page = int(kc.shape[1]), int(kc.shape[2])
        vrow = _check_cache(k_cache, v_cache, kc, h_kv, page, dev, paged) // 4
        _check("block_table", block_table, f"int32 [{b}, max_pages]", (b, None), (torch.int32,), dev)
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
            _tier(nm, t, b, h_kv, d, q.dtype, dev)
        if sink_k.stride() != sink_v.stride() or recent_k.stride() != recent_v.stride():
            raise ValueError("sink_k/sink_v and recent_k/recent_v must share strides")
        sl = _lengths("sink_len", sink_len, b, int(sink_k.shape[2]), dev)
        rl = _lengths("recent_len", recent_len, b, int(recent_k.shape[2]), dev)
        rk, rk_stride = _rot("rotation_k", rotation_k, h_kv, d, dev)
        rv, rv_stride = _rot("rotation_v", rotation_v, h_kv, d, dev)
        mu, mu_stride = _mean("mean_v", mean_v, h_kv, d, dev)
        if rk is None:
            rk, rk_stride = torch.eye(d, dtype=torch.float32, device=dev), 0
        s = num_splits or default_num_splits(b, h_kv, cap, cfg.block_n, dev)
        o_part, lse_part = workspace if workspace is not None else make_workspace(b, h_q, d, s, dev)
        n_parts = s + TIER_PARTS
        _check("workspace[0]", o_part, f"float32 [{b}, {h_q}, {n_parts}, {d}]", (b, h_q, n_parts, d), (torch.float32,), dev)
        _check("workspace[1]", lse_part, f"float32 [{b}, {h_q}, {n_parts}]", (b, h_q, n_parts), (torch.float32,), dev)
        if out is None:
            out = torch.empty(b, h_q, d, dtype=q.dtype, device=dev)
        _check("out", out, f"{q.dtype} [{b}, {h_q}, {d}]", (b, h_q, d), (q.dtype,), dev)
        if out.stride(-1) != 1:
            raise _bad("out", out, "a contiguous last dim")
        vc = v_cache.packed
        g = h_q // h_kv
        gp = max(cfg.min_gp, 1 << (g - 1).bit_length())
        scale = (sm_scale if sm_scale is not None else d ** -0.5) * _LOG2E
        q_rot = torch.empty_like(q)
        self.out, self.num_splits, self.config = out, s, cfg
        self._kernels = _kernels()[1]
        self._rot: tuple[Any, ...] = ((b * h_kv, d // 32), (q, q.stride(0), q.stride(1), rk, rk_stride, q_rot, q_rot.stride(0),
                                   q_rot.stride(1), scale),
                     dict(H_KV=h_kv, GROUP=g, GP=max(16, gp), D=d, BLOCK_E=32, PREC="tf32x3",
                          PDL=cfg.pdl, num_warps=4))
        ks, kz, vs, vz = k_cache.scale, k_cache.zero, v_cache.scale, v_cache.zero
        self._stage1: tuple[Any, ...] = ((b * h_kv, n_parts), (
            q_rot, q_rot.stride(0), q_rot.stride(1), kc, kc.stride(0), kc.stride(1),
            vc, vc.stride(0), vc.stride(1),
            ks, kz, vs, vz, ks.stride(0), ks.stride(1), block_table, block_table.stride(0), hl,
            sink_k, sink_v, sink_k.stride(0), sink_k.stride(1), sink_k.stride(2), sl,
            recent_k, recent_v, recent_k.stride(0), recent_k.stride(1), recent_k.stride(2), rl,
            o_part, lse_part, o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1), s),
            dict(H_KV=h_kv, GROUP=g, GP=gp, D=d, BLOCK_N=cfg.block_n, BLOCK_NB=cfg.block_nb, PTX=dev.type == "cuda",
                 ACT=_ttype(q.dtype), PAGED=paged, PAGE=page if paged else 1, TIER_PARTS=TIER_PARTS, PDL=cfg.pdl,
                 VROW=vrow,
                 HIST_STAGES=cfg.hist_stages, HOIST_Q=cfg.hoist_q, PREFETCH=cfg.prefetch, num_warps=cfg.num_warps, **({"launch_pdl": True} if cfg.pdl else {}),
                 num_stages=cfg.num_stages, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {})))
        self._merge: tuple[Any, ...] = ((b * h_q, d // e_prog), (
            o_part, lse_part, o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1),
            mu if mu is not None else o_part, mu_stride, rv if rv is not None else o_part, rv_stride,
            out, out.stride(0), out.stride(1), n_parts),
            dict(H_Q=h_q, GROUP=g, D=d, SP=max(2, 1 << (n_parts - 1).bit_length()), BLOCK_E=32, BLOCK_P=cfg.merge_block_p,
                 HAS_MU=mu is not None, HAS_R=rv is not None, E_PROG=e_prog, PDL=cfg.pdl, num_warps=4,
                 **({"launch_pdl": True} if cfg.pdl else {})))

    def run(self) -> torch.Tensor:
        """Launch the three kernels (rotate q, stage 1, merge + rotate back); returns ``out [B, H_q, D]``."""
        k = self._kernels
        k._rotate_q_kernel[self._rot[0]](*self._rot[1], **self._rot[2])
        LAST_LAUNCH["stage1"] = k._decode_stage1_kernel[self._stage1[0]](*self._stage1[1], **self._stage1[2])
        k._merge_rotate_kernel[self._merge[0]](*self._merge[1], **self._merge[2])
        return self.out


def _check_cache(k_cache: QuantizedRows, v_cache: QuantizedRows, kc: torch.Tensor, h_kv: int, page: int,
                 dev: torch.device, paged: bool = True) -> int:
    """Keys: quarter-packed rows ``[pages, H_kv, P, D/4]``; values: token quads ``[pages, H_kv, P/R·D, R/4]`` with
    ``R = min(P, 64)`` tokens per row (paged; pages above 64 tokens are multiples of 64), ``[B, H_kv, ⌈T/64⌉·D, 16]``
    (non-paged). Returns ``R``."""
    d = 4 * int(kc.shape[-1])
    if paged and page > TOKEN_QUAD_ROW and page % TOKEN_QUAD_ROW:
        raise ValueError(f"k_cache.packed: pages above {TOKEN_QUAD_ROW} tokens must be multiples of "
                         f"{TOKEN_QUAD_ROW} (token-quad rows), got {page}")
    row = token_quad_row(page) if paged else TOKEN_QUAD_ROW
    vshape = (kc.shape[0], h_kv, d * max(1, -(-page // row)), (row + 3) // 4)
    _check("v_cache.packed", v_cache.packed, f"uint8 {list(vshape)} (token quads)", vshape, (torch.uint8,), dev)
    vc = v_cache.packed
    if vc.stride(-1) != 1:
        raise _bad("v_cache.packed", vc, "a contiguous last dim (token quads)")
    if kc.stride(-1) != 1 or kc.stride(-2) != kc.shape[-1]:
        raise _bad("k_cache.packed", kc, "contiguous rows")
    for nm, rows in (("k_cache", k_cache), ("v_cache", v_cache)):
        for part in ("scale", "zero"):
            t = getattr(rows, part)
            _check(f"{nm}.{part}", t, f"[pages, {h_kv}, {page}, 1] (G = D)", (kc.shape[0], h_kv, page, 1), _META, dev)
            if t.stride() != k_cache.scale.stride() or t.dtype != k_cache.scale.dtype or t.stride(2) != 1:
                raise _bad(f"{nm}.{part}", t, "the dtype and strides of k_cache.scale, contiguous along P")
    return row


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
        kwargs: passed on (rotation_k, rotation_v, mean_v, sm_scale, num_splits, config, out, workspace).
    """
    squeeze = q.dim() == 4
    if squeeze:
        if q.shape[2] != 1:
            raise _bad("q", q, "[B, H_q, 1, D] (one decode query per sequence)")
        q = q[:, :, 0]
    b = int(q.shape[0])
    pk = hist_k.packed
    if pk.dim() != 4 or pk.shape[0] != b:
        raise _bad("hist_k.packed", pk, f"uint8 [{b}, H_kv, T, D/4]")
    t = int(pk.shape[2])
    table = torch.arange(b, dtype=torch.int32, device=q.device).unsqueeze(1)  # one page of T rows per sequence
    out = decode_attention(
        q, hist_k, hist_v, table, t if hist_len is None else hist_len,
        sink_k, sink_v, int(sink_k.shape[2]) if sink_len is None else sink_len,
        recent_k, recent_v, int(recent_k.shape[2]) if recent_len is None else recent_len, paged=False, **kwargs)
    return out.unsqueeze(2) if squeeze else out
