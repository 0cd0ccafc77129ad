"""Launchers of the BF16 tier copies (``tier_copy``), re-exported by :mod:`oscar_kernels.ops`: one launch writes a
step's new tokens into the sink / recent tiers, one gathers and centres a decode batch's tier rows.

Tiers are ``[rows + 1, H_kv, T, D]`` in the activation dtype (bf16 / fp16, or fp32), last dim contiguous; K and V
tiers (and the gather's K and V outputs) share strides. Both launches are CUDA-graph safe (no host sync, shapes only from static sizes).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from oscar_kernels.launch_checks import ACT, bad_tensor, check_tensor, mean_arg, next_pow2, rotation_arg, triton_module

TIER_DTYPES = (*ACT, torch.float32)
Q_BLOCK = 32  # output columns per query-rotation program (the decode plan's rotation kernel's BLOCK_E)


def query_rows(group: int, rows: int = 16) -> tuple[int, int]:
    """(``GP``, ``QB``) of a query-rotation program for GQA groups of ``group`` heads: its MMA's rows (``group``
    padded to a power of two, at least ``rows``) and the sequences it rotates, ``GP // group`` (the heads of one
    sequence fill the rows the next sequences' heads would leave as padding: Qwen3-8B's groups of 4 take 4 sequences
    a program; on an H100 80 queries' rotation took 7.5 µs against 21.3 with one sequence a program, docs/VLLM.md)."""
    gp = max(rows, next_pow2(group))
    return gp, gp // group


class GatherQuery(NamedTuple):
    """The decode's query rotation as extra programs of :func:`tier_gather`: ``out = (q @ R_K) · qk_scale`` in
    ``q``'s dtype, bit for bit what the decode plan's first launch writes (pass ``out`` as ``DecodePlan(q_rot=)``).
    ``q`` ``[B, H_q, D]`` post-RoPE queries of the gathered sequences, ``rotation`` float32 ``[D, D]`` or
    ``[H_kv, D, D]``, ``qk_scale`` :func:`oscar_kernels.decode_ops.query_scale`."""

    q: torch.Tensor
    rotation: torch.Tensor
    out: torch.Tensor
    qk_scale: float


def query_args(gq: GatherQuery, b: int, h_kv: int, d: int, dev: torch.device) -> tuple[tuple[object, ...], int]:
    """(kernel arguments, GQA group) of a valid :class:`GatherQuery`; raises ValueError naming the tensor."""
    q, out = gq.q, gq.out
    if q.dim() != 3 or q.dtype not in ACT or q.device != dev or tuple(q.shape[::2]) != (b, d) or q.shape[1] % h_kv \
            or q.stride(-1) != 1:
        raise bad_tensor("query.q", q, f"bf16/fp16 [{b}, H_q, {d}] on {dev}, H_q a multiple of {h_kv}, a contiguous "
                         "last dim")
    if out.shape != q.shape or out.dtype != q.dtype or out.device != dev or out.stride(-1) != 1:
        raise bad_tensor("query.out", out, f"{q.dtype} {list(q.shape)} with a contiguous last dim")
    r, r_stride = rotation_arg("query.rotation", gq.rotation, h_kv, d, dev)
    assert r is not None
    return (q, q.stride(0), q.stride(1), r, r_stride, out, out.stride(0), out.stride(1), float(gq.qk_scale)), \
        int(q.shape[1]) // h_kv


def _pair(name: str, a: torch.Tensor, b: torch.Tensor, shape: tuple[int | None, ...], dtypes: tuple[torch.dtype, ...],
          dev: torch.device, what: str) -> None:
    """``name`` is the pair's K/V names joined by '/'; both match ``shape``, share dtype and strides, stride-1 last dim."""
    nk, nv = name.split("/")
    check_tensor(nk, a, what, shape, dtypes, dev)
    check_tensor(nv, b, f"{a.dtype} {list(a.shape)} (as {nk})", tuple(a.shape), (a.dtype,), dev)
    if a.stride() != b.stride() or a.stride(-1) != 1:
        raise ValueError(f"{name}: must share strides and have a contiguous last dim, got {a.stride()}, {b.stride()}")


def tier_write(k: torch.Tensor, v: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor, ring_k: torch.Tensor,
               ring_v: torch.Tensor, sink_row: torch.Tensor, sink_pos: torch.Tensor, ring_row: torch.Tensor,
               ring_slot: torch.Tensor, *, block_t: int = 16, num_warps: int = 4) -> None:
    """``sink_*[sink_row[i], :, sink_pos[i]] = x[i]`` and ``ring_*[ring_row[i], :, ring_slot[i]] = x[i]`` for every
    token ``i`` of ``k``/``v`` ``[N, H_kv, D]``, in one launch (indices int64 ``[N]``, in range: tokens that go
    nowhere point at a scratch row; when several tokens share a destination one of them is kept)."""
    check_tier_write(k, v, sink_k, sink_v, ring_k, ring_v, sink_row, sink_pos, ring_row, ring_slot)
    n, h_kv, d = k.shape
    if n == 0:
        return
    triton_module("tier_copy")._tier_write_kernel[(math.ceil(n / block_t), h_kv)](
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), sink_k, sink_v, sink_k.stride(0), sink_k.stride(1), sink_k.stride(2),
        ring_k, ring_v, ring_k.stride(0), ring_k.stride(1), ring_k.stride(2), sink_row, sink_pos, ring_row, ring_slot,
        n, D=d, BLOCK_D=next_pow2(d), BLOCK_T=block_t, num_warps=num_warps)


def check_tier_write(k: torch.Tensor, v: torch.Tensor, sink_k: torch.Tensor, sink_v: torch.Tensor, ring_k: torch.Tensor,
                     ring_v: torch.Tensor, sink_row: torch.Tensor, sink_pos: torch.Tensor, ring_row: torch.Tensor,
                     ring_slot: torch.Tensor) -> None:
    """:func:`tier_write`'s argument checks (a bad argument raises, naming it)."""
    dev = k.device
    if k.dim() != 3 or k.dtype not in TIER_DTYPES:
        raise bad_tensor("k", k, "bf16/fp16/fp32 [N, H_kv, D]")
    n, h_kv, d = k.shape
    check_tensor("v", v, f"{k.dtype} [{n}, {h_kv}, {d}]", (n, h_kv, d), (k.dtype,), dev)
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"k, v: expected contiguous last dims, got strides {k.stride()}, {v.stride()}")
    _pair("sink_k/sink_v", sink_k, sink_v, (None, h_kv, None, d), (k.dtype,), dev, f"{k.dtype} [rows, {h_kv}, S, {d}]")
    _pair("ring_k/ring_v", ring_k, ring_v, (None, h_kv, None, d), (k.dtype,), dev, f"{k.dtype} [rows, {h_kv}, R, {d}]")
    for nm, t in (("sink_row", sink_row), ("sink_pos", sink_pos), ("ring_row", ring_row), ("ring_slot", ring_slot)):
        check_tensor(nm, t, f"int64 [{n}]", (n,), (torch.int64,), dev)
        if t.stride(0) != 1:
            raise bad_tensor(nm, t, "a contiguous int64 vector")


def tier_gather(sink_k: torch.Tensor, sink_v: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor,
                rows: torch.Tensor, ring_index: torch.Tensor, k_mean: torch.Tensor, v_mean: torch.Tensor, *,
                out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                dtype: torch.dtype | None = None, block_t: int = 32, num_warps: int = 4,
                query: GatherQuery | None = None, pdl: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decode's tier inputs of sequences ``rows`` (int64 ``[B]``), in one launch:
    ``(sink_k_c, sink_v_c, recent_k_c, recent_v_c)`` ``[B, H_kv, S or R, D]`` with
    ``sink_k_c[b, h, j] = (float32(sink_k[rows[b], h, j]) - k_mean[h]).to(dtype)`` for every sink slot ``j`` and
    ``recent_k_c[b, h, j] = (float32(ring_k[rows[b], h, ring_index[b, j]]) - k_mean[h]).to(dtype)`` for every column
    of ``ring_index`` (int64 ``[B, R']``, entries in ``[0, R)``); V alike with ``v_mean`` (float32 ``[D]`` or
    ``[H_kv, D]``). ``out``: four tensors of those shapes (last dims contiguous, K and V sharing strides) to fill;
    else they are allocated contiguous in ``dtype`` (default: the tiers' dtype).

    ``query``: the same launch also rotates the decode's queries (:class:`GatherQuery`; ``D / 32`` more programs per
    sequence and KV head), so that the decode plan (``DecodePlan(q_rot=query.out)``) launches two kernels instead of
    three. ``pdl`` (CUDA): the launch lets a programmatic dependent launch after it (the plan's stage 1) start at once,
    as the plan's own rotation kernel does."""
    dev = sink_k.device
    if sink_k.dim() != 4 or sink_k.dtype not in TIER_DTYPES:
        raise bad_tensor("sink_k", sink_k, "bf16/fp16/fp32 [rows, H_kv, S, D]")
    _, h_kv, s, d = sink_k.shape
    _pair("sink_k/sink_v", sink_k, sink_v, (None, h_kv, s, d), TIER_DTYPES, dev, f"[rows, {h_kv}, {s}, {d}]")
    _pair("ring_k/ring_v", ring_k, ring_v, (None, h_kv, None, d), (sink_k.dtype,), dev,
          f"{sink_k.dtype} [rows, {h_kv}, R, {d}]")
    check_tensor("rows", rows, "int64 [B]", (None,), (torch.int64,), dev)
    b = int(rows.shape[0])
    check_tensor("ring_index", ring_index, f"int64 [{b}, R]", (b, None), (torch.int64,), dev)
    if rows.stride(0) != 1 or ring_index.stride(-1) != 1:
        raise ValueError("rows, ring_index: expected contiguous rows of indices")
    r = int(ring_index.shape[1])
    km, km_stride = mean_arg("k_mean", k_mean, h_kv, d, dev)
    vm, vm_stride = mean_arg("v_mean", v_mean, h_kv, d, dev)
    assert km is not None and vm is not None
    if out is None:
        dt = dtype or sink_k.dtype
        sk, sv = (torch.empty(b, h_kv, s, d, dtype=dt, device=dev) for _ in range(2))
        rk, rv = (torch.empty(b, h_kv, r, d, dtype=dt, device=dev) for _ in range(2))
    else:
        sk, sv, rk, rv = out
        _pair("out[0]/out[1]", sk, sv, (b, h_kv, s, d), TIER_DTYPES, dev, f"[{b}, {h_kv}, {s}, {d}]")
        _pair("out[2]/out[3]", rk, rv, (b, h_kv, r, d), (sk.dtype,), dev, f"{sk.dtype} [{b}, {h_kv}, {r}, {d}]")
        if dtype is not None and sk.dtype != dtype:
            raise bad_tensor("out[0]", sk, f"{dtype} (the dtype asked for)")
    q_args, group = query_args(query, b, h_kv, d, dev) if query is not None else ((sk, 0, 0, sk, 0, sk, 0, 0, 1.0), 1)
    if b == 0:
        return sk, sv, rk, rv
    sink_tiles = math.ceil(s / block_t)
    tiles = sink_tiles + math.ceil(r / block_t)
    q_jobs = d // Q_BLOCK if query is not None else 0
    pdl = pdl and dev.type == "cuda"  # griddepcontrol is a CUDA launch attribute
    triton_module("tier_copy")._tier_gather_kernel[(tiles + q_jobs, h_kv, b)](
        sink_k, sink_v, sink_k.stride(0), sink_k.stride(1), sink_k.stride(2),
        ring_k, ring_v, ring_k.stride(0), ring_k.stride(1), ring_k.stride(2),
        rows, ring_index, ring_index.stride(0), km, vm, km_stride, vm_stride,
        sk, sv, sk.stride(0), sk.stride(1), sk.stride(2), rk, rv, rk.stride(0), rk.stride(1), rk.stride(2),
        s, r, sink_tiles, tiles, *q_args, D=d, BLOCK_D=next_pow2(d), BLOCK_T=block_t, Q_JOBS=q_jobs, Q_BLOCK=Q_BLOCK,
        GROUP=group, GP=max(16, next_pow2(group)), PDL=pdl, num_warps=num_warps)
    return sk, sv, rk, rv
