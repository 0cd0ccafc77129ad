"""Launcher of the K/V rotation (``rotate_kv``), re-exported by :mod:`oscar_kernels.ops`: one launch rotates a step's
new keys and values, ``(float32(x) @ R).to(dtype)``, for the vLLM backend's decode-sized batches (cuBLAS picks a
float32 GEMM tile that takes tens of microseconds for a single row; large batches are better left to it).

CUDA-graph safe: no host sync, the grid only from static sizes.
"""

from __future__ import annotations

import math

import torch

from oscar_kernels.launch_checks import ACT, bad_tensor, check_rows, rotation_arg, triton_module
from oscar_kernels.tier_ops import Q_BLOCK, GatherQuery, query_args, query_rows

ROTATE_DTYPES = (*ACT, torch.float32)


def rotate_kv(k: torch.Tensor, v: torch.Tensor, r_k: torch.Tensor, r_v: torch.Tensor, *,
              out: tuple[torch.Tensor, torch.Tensor] | None = None, dtype: torch.dtype | None = None,
              block_t: int | None = None, block_e: int = 32, num_warps: int = 4,
              query: GatherQuery | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float32(k) @ r_k).to(dtype), (float32(v) @ r_v).to(dtype)`` per KV head, in one launch.

    Args:
        k, v: ``[N, H_kv, D]`` bf16/fp16/fp32 (one dtype), ``D`` 64 or 128, last dim contiguous (row and head
            strides free: views into a wider qkv tensor).
        r_k, r_v: float32 ``[D, D]`` (all heads) or ``[H_kv, D, D]`` (per head); K and V may differ in form.
        out: two ``[N, H_kv, D]`` tensors (last dims contiguous, not overlapping ``k``/``v``) to fill; else
            allocated contiguous in ``dtype`` (default: ``k``'s dtype; float32 gives the unrounded sums).

    The sums are float32 (IEEE, no TF32), in another order than cuBLAS's: results may differ from
    ``x.float() @ r`` in the last bits of float32, so a rounded output may differ by one unit in the last place where
    the float32 value lies next to a rounding boundary. Returns the two outputs.

    ``query`` (a :class:`~oscar_kernels.tier_ops.GatherQuery`, ``q [B_q, H_q, D]``): the same launch also writes the
    decode's rotated queries into ``query.out``, bit for bit what the decode plan's first launch writes (pass it as
    ``DecodePlan(q_rot=...)``, which then launches two kernels); ``cdiv(B_q, QB)`` more programs along the token
    axis, each taking ``QB`` sequences (:func:`~oscar_kernels.tier_ops.query_rows`: 4 for groups of 4 heads).
    """
    if not isinstance(k, torch.Tensor):
        raise ValueError(f"k: expected a torch.Tensor [N, H_kv, D], got {type(k).__name__}")
    dev = k.device
    if k.dim() != 3 or k.dtype not in ROTATE_DTYPES or k.shape[-1] not in (64, 128):
        raise bad_tensor("k", k, "bf16/fp16/fp32 [N, H_kv, D] with D 64 or 128")
    n, h_kv, d = (int(s) for s in k.shape)
    if k.stride(-1) != 1:
        raise ValueError(f"k: expected a contiguous last dim, got strides {k.stride()}")
    check_rows("v", v, f"{k.dtype} [{n}, {h_kv}, {d}] (as k)", (n, h_kv, d), (k.dtype,), dev)
    rk, rk_stride = rotation_arg("r_k", r_k, h_kv, d, dev)
    rv, rv_stride = rotation_arg("r_v", r_v, h_kv, d, dev)
    if rk is None or rv is None:
        raise ValueError("r_k, r_v: expected float32 rotations, got None")
    if out is None:
        dt = dtype or k.dtype
        if dt not in ROTATE_DTYPES:
            raise ValueError(f"dtype: expected bf16/fp16/fp32, got {dt}")
        yk, yv = (torch.empty(n, h_kv, d, dtype=dt, device=dev) for _ in range(2))
    else:
        yk, yv = out
        check_rows("out[0]", yk, f"[{n}, {h_kv}, {d}]", (n, h_kv, d), (dtype,) if dtype else ROTATE_DTYPES, dev)
        check_rows("out[1]", yv, f"{yk.dtype} [{n}, {h_kv}, {d}] (as out[0])", (n, h_kv, d), (yk.dtype,), dev)
    # 16 rows per program up to 64 tokens (decode steps; measured); above, 32: at 64 rows a program's float32 operands
    # do not fit its registers (sm_90 SASS, Triton 3.9: 7 KB of stack per thread, 2,945 spill stores and 4,280 spill
    # loads against 4,096 FMAs; 32 rows: 44 registers, no spills: scripts/sass_stats.py --rotate-kv). Timed on an H100:
    # 32-row tiles beat torch's float32 GEMM + casts from 80 to 2,048 tokens and tie at 4,096 (core.ROTATE_TRITON_MAX_ROWS).
    bt = block_t or (16 if n <= 64 else 32)
    if bt < 16 or bt & (bt - 1) or block_e < 16 or block_e & (block_e - 1) or d % block_e:
        raise ValueError(f"block_t, block_e: expected powers of two >= 16 (block_e dividing {d}), got {bt}, {block_e}")
    if query is not None:
        if block_e != Q_BLOCK:
            raise ValueError(f"block_e: {Q_BLOCK} with a query (the decode plan's rotation tiles), got {block_e}")
        bq = int(query.q.shape[0]) if isinstance(query.q, torch.Tensor) and query.q.dim() == 3 else -1
        q_args, group = query_args(query, bq, h_kv, d, dev)
    else:
        bq, q_args, group = 0, (yk, 0, 0, yk, 0, yk, 0, 0, 1.0), 1
    t_tiles = math.ceil(n / bt)
    gp, qb = query_rows(group)
    q_tiles = math.ceil(bq / qb)
    if t_tiles + q_tiles == 0:
        return yk, yv
    triton_module("rotate_kv")._rotate_kv_kernel[(t_tiles + q_tiles, 2 * h_kv, d // block_e)](
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), rk, rk_stride, rv, rv_stride,
        yk, yk.stride(0), yk.stride(1), yv, yv.stride(0), yv.stride(1), n, t_tiles, *q_args, bq,
        H_KV=h_kv, D=d, BLOCK_T=bt, BLOCK_E=block_e, Q_JOBS=query is not None, GROUP=group, GP=gp, QB=qb,
        num_warps=num_warps)
    return yk, yv
