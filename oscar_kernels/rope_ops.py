"""Launcher of the position-dependent key mean's logit term (``rope_bias``), re-exported by :mod:`oscar_kernels.ops`,
and its tables (:class:`RopeTables`): what the decode kernel's ``logit_bias`` takes for a history whose keys were
written centred by ``RoPE_p(m_pre)`` (``quant.key_mean: rope``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from oscar_kernels.launch_checks import ACT, bad_tensor, check_tensor, next_pow2, triton_module
from oscar_kernels.reference import rope_angles

FINE = 128  # rows of the fine table: positions P = FINE·u + r; the term kernel's blocks are at most this long


@dataclass(frozen=True)
class RopeTables:
    """float32 ``[cos | sin]`` tables of a model's RoPE frequencies, from float64 angles: ``coarse [U, D]`` at
    positions ``FINE·u`` (``u < U``) and ``fine [FINE, D]`` at ``r < FINE``; they cover positions below ``FINE·U``.
    ``scaling`` is the rotary embedding's attention scaling (YaRN's mscale; 1 for plain RoPE)."""

    inv_freq: torch.Tensor  # [D/2] as the model stores it
    scaling: float
    coarse: torch.Tensor
    fine: torch.Tensor

    @property
    def positions(self) -> int:
        return FINE * int(self.coarse.shape[0])


def _table(inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    ang = rope_angles(inv_freq, positions)
    return torch.cat((torch.cos(ang), torch.sin(ang)), -1).float().contiguous()


def rope_tables(inv_freq: torch.Tensor, scaling: float, positions: int, device: torch.device | str) -> RopeTables:
    """Tables for RoPE positions ``[0, positions)`` (rounded up to whole coarse rows) on ``device``."""
    if inv_freq.dim() != 1 or inv_freq.numel() * 2 not in (64, 128):
        raise bad_tensor("inv_freq", inv_freq, "[D/2] with D in {64, 128}")
    if not math.isfinite(scaling) or scaling <= 0:
        raise ValueError(f"scaling: expected a positive finite attention scaling, got {scaling}")
    inv = inv_freq.detach().to("cpu", torch.float64)
    u = max(1, -(-int(positions) // FINE))
    coarse = _table(inv, torch.arange(u, dtype=torch.int64) * FINE)
    fine = _table(inv, torch.arange(FINE, dtype=torch.int64))
    return RopeTables(inv_freq.detach(), float(scaling), coarse.to(device), fine.to(device))


def rope_mean_logits(q: torch.Tensor, mean_pre: torch.Tensor, tables: RopeTables, position0: torch.Tensor,
                     hist_len: torch.Tensor, sm_scale: float, *, length: int | None = None,
                     out: torch.Tensor | None = None, block: int = 64, num_warps: int = 4) -> torch.Tensor:
    """``out[b, h_q, n] = sm_scale·q[b, h_q]·(scaling·RoPE_p(m_pre))`` at ``p = position0[b] + n`` for every history
    token ``n < hist_len[b]`` (the rest of ``out`` is left as it was): the decode kernel's ``logit_bias``. One launch;
    CUDA-graph safe (lengths are device tensors).

    Args:
        q: ``[B, H_q, D]`` bf16/fp16/fp32 post-RoPE queries (unrotated; the term is the same in an orthogonal
            rotation's space).
        mean_pre: float32 ``[H_kv, D]`` pre-RoPE key means of the layer (``H_q % H_kv == 0``).
        tables: :func:`rope_tables` covering every position read (``position0 + hist_len <= tables.positions``:
            the lengths stay on the device, so this is the caller's to size; a position past them reads the
            tables' last row, a wrong term but no read out of bounds).
        position0, hist_len: int32 ``[B]``: the RoPE position of each row's history token 0, its history length.
        length: ``L``, history slots in ``out`` (default ``out``'s, else ``max(hist_len)`` read once from the device).
        out: float32 ``[B, H_q, L]`` (contiguous last dim) to fill.
    """
    dev = q.device
    if q.dim() != 3 or q.dtype not in (*ACT, torch.float32) or q.stride(-1) != 1 or q.shape[-1] not in (64, 128):
        raise bad_tensor("q", q, "bf16/fp16/fp32 [B, H_q, D] with D in {64, 128} and a contiguous last dim")
    b, h_q, d = q.shape
    h_kv = int(mean_pre.shape[0]) if mean_pre.dim() == 2 else 0
    if h_kv == 0 or h_q % h_kv:
        raise bad_tensor("mean_pre", mean_pre, f"float32 [H_kv, {d}] with H_kv dividing {h_q}")
    check_tensor("mean_pre", mean_pre, f"float32 [{h_kv}, {d}]", (h_kv, d), (torch.float32,), dev)
    check_tensor("tables.coarse", tables.coarse, f"float32 [U, {d}]", (None, d), (torch.float32,), dev)
    check_tensor("tables.fine", tables.fine, f"float32 [{FINE}, {d}]", (FINE, d), (torch.float32,), dev)
    for nm, t in (("position0", position0), ("hist_len", hist_len)):
        check_tensor(nm, t, f"int32 [{b}]", (b,), (torch.int32,), dev)
    if block < 16 or block > FINE or block & (block - 1):
        raise ValueError(f"block: expected a power of two in [16, {FINE}], got {block}")
    if out is None:
        n = int(hist_len.max()) if length is None and b else (length or 0)
        out = torch.zeros(b, h_q, max(n, 1), dtype=torch.float32, device=dev)
    check_tensor("out", out, f"float32 [{b}, {h_q}, L]", (b, h_q, None), (torch.float32,), dev)
    if out.stride(-1) != 1:
        raise bad_tensor("out", out, "a contiguous last dim")
    g = h_q // h_kv
    m = (mean_pre * tables.scaling).contiguous()
    slots = int(out.shape[2])
    if slots == 0 or b == 0:
        return out
    triton_module("rope_bias")._rope_bias_kernel[(b * h_kv, math.ceil(slots / block))](
        q, q.stride(0), q.stride(1), m, m.stride(0), tables.coarse, int(tables.coarse.shape[0]), tables.fine, position0, hist_len,
        out, out.stride(0), out.stride(1), float(sm_scale),
        H_KV=h_kv, GROUP=g, GP=max(16, next_pow2(g)), D=d, BLOCK=block, F=FINE,
        PREC="tf32x3" if dev.type == "cuda" else "ieee", num_warps=num_warps)
    return out
