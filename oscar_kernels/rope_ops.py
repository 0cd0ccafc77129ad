"""The position-dependent key mean's logit term (``quant.key_mean: rope``) as a tensor: what the decode kernel's
``logit_bias`` takes for a history whose keys were written centred by ``RoPE_p(m_pre)``, re-exported by
:mod:`oscar_kernels.ops`. Serving computes the term inside the decode kernel instead (``DecodePlan(rope_mean=…)``,
``int2_decode``'s module docstring), from :func:`position_table`; this unfused form is what ``oscar bench
--key-mean rope-gemm`` measures it against, and a second summation of the same term in tests.

Per query head and history token at position ``p`` the term is ``sm_scale·q·(a·RoPE_p(m_pre))`` (``a`` the rotary
embedding's attention scaling; the float64 spec is ``reference.rope_mean_logits``). Over the ``D/2`` RoPE pairs ``k``
(``rotate_half`` pairing, ``k`` with ``k + D/2``)::

    t(p) = Σ_k A_k·cos(θ_k p) + B_k·sin(θ_k p),   A_k = a·s·(q_k m_k + q_{k+D/2} m_{k+D/2}),
                                                  B_k = a·s·(q_{k+D/2} m_k - q_k m_{k+D/2})

so ``t = [A | B] · [cos θp | sin θp]``: the rows ``[cos θp | sin θp]`` depend on the position alone and are shared
by every layer, batch row and head, and the whole term is one ``[rows·H_q, D] × [D, L]`` float32 GEMM (cuBLAS) over
a float32 table built from float64 angles (no angle ``θ·p`` is ever rounded to float32 whole: at ``p = 128K`` that
would cost ``θ_0`` about 0.008 rad). A separate Triton kernel that recomputed the angles per block and head by
angle addition made a decode step 1.2-2.9x slower than this form on an H200 (docs/BENCHMARKS.md) and was removed.
"""

from __future__ import annotations

import torch

from oscar_kernels.launch_checks import bad_tensor
from oscar_kernels.reference import rope_angles


def position_table(inv_freq: torch.Tensor, positions: int, device: torch.device | str) -> torch.Tensor:
    """float32 ``[positions, D]`` rows ``[cos θ·p | sin θ·p]`` for ``p < positions`` from float64 angles (each entry
    the float32 rounding of the exact value): the right operand of :func:`rope_mean_logits`. It depends on the
    frequencies only, so every layer of a model shares it (64 MB at 128K positions, D = 128)."""
    if inv_freq.dim() != 1 or inv_freq.numel() * 2 not in (64, 128):
        raise bad_tensor("inv_freq", inv_freq, "[D/2] with D in {64, 128}")
    ang = rope_angles(inv_freq.detach().cpu(), torch.arange(max(int(positions), 1), dtype=torch.int64))
    return torch.cat((torch.cos(ang), torch.sin(ang)), -1).float().to(device)


def rope_mean_logits(q: torch.Tensor, mean_pre: torch.Tensor, table: torch.Tensor, scaling: float,
                     position0: list[int], sm_scale: float, out: torch.Tensor) -> torch.Tensor:
    """The term as one float32 GEMM per distinct first position (cuBLAS, TF32 off for it):
    ``out[b, :, n] = [A_b | B_b] · table[position0[b] + n]`` for every slot ``n < L`` of ``out`` (``A``, ``B`` per
    query head from ``q`` and ``m_pre``, the module docstring). The product reads the table once and writes ``out``
    once. Positions are host ints (the transformers path knows each row's padding; a serving engine's rows start at
    one fixed position), so a CUDA graph captures it for fixed positions and ``L``.

    Args:
        q: ``[B, H_q, D]`` post-RoPE queries; mean_pre: float32 ``[H_kv, D]``; table: :func:`position_table`
            covering ``max(position0) + L``; scaling: the rotary embedding's attention scaling.
        out: float32 ``[B, H_q, L]`` (contiguous), filled whole (slots past a row's history get a finite value
            the decode kernel never reads).
    """
    b, h_q, d = (int(x) for x in q.shape)
    h_kv = int(mean_pre.shape[0]) if mean_pre.dim() == 2 else 0
    if h_kv == 0 or h_q % h_kv or int(mean_pre.shape[-1]) != d:
        raise bad_tensor("mean_pre", mean_pre, f"float32 [H_kv, {d}] with H_kv dividing {h_q}")
    if out.shape[:2] != (b, h_q) or out.dtype != torch.float32 or not out.is_contiguous():
        raise bad_tensor("out", out, f"float32 contiguous [{b}, {h_q}, L]")
    if len(position0) != b:
        raise ValueError(f"position0: expected {b} first positions, got {len(position0)}")
    length = int(out.shape[2])
    if table.dim() != 2 or int(table.shape[1]) != d or (b and max(position0) + length > int(table.shape[0])):
        raise bad_tensor("table", table, f"float32 [>= {max(position0, default=0) + length}, {d}] (position_table)")
    half = d // 2
    m = mean_pre.float().repeat_interleave(h_q // h_kv, dim=0) * (scaling * sm_scale)  # [H_q, D]
    qq = q.float()
    ab = torch.cat((qq[..., :half] * m[:, :half] + qq[..., half:] * m[:, half:],
                    qq[..., half:] * m[:, :half] - qq[..., :half] * m[:, half:]), -1)  # [B, H_q, D]
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # a float32 product: TF32's 10-bit mantissa is too coarse here
    try:
        for p0 in sorted(set(position0)):
            rows = [i for i, p in enumerate(position0) if p == p0]
            t = table[p0 : p0 + length].transpose(0, 1)  # [D, L], a view
            if len(rows) == b:
                torch.matmul(ab.reshape(b * h_q, d), t, out=out.view(b * h_q, length))
            else:
                out[rows] = torch.matmul(ab[rows], t)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return out


def rope_mean_matrix(mean_pre: torch.Tensor, rotation: torch.Tensor, scaling: float = 1.0) -> torch.Tensor:
    """float32 ``[H_kv, D, D]`` ``M`` with ``a·RoPE_p(m_pre[h])·R_h = table[p] @ M[h]`` for every position ``p``
    (``table`` :func:`position_table`'s ``[cos θp | sin θp]`` rows, ``a`` = ``scaling``, the rotary embedding's
    attention scaling, folded in): the position-dependent key mean of a token as one product of its table row,
    which is how the vLLM backend centres new keys (one GEMM per layer instead of RoPE's elementwise ops and a
    batched GEMM). Over the pairs ``k``, ``k + D/2``: row ``k`` is ``a·(m_k R_k + m_{k+D/2} R_{k+D/2})`` and row
    ``D/2 + k`` is ``a·(m_k R_{k+D/2} − m_{k+D/2} R_k)``, summed in float64.

    Args:
        mean_pre: ``[H_kv, D]`` pre-RoPE key means (unrotated); rotation: ``[D, D]``, ``[1, D, D]`` or
            ``[H_kv, D, D]``, applied as ``x @ R``.
    """
    if mean_pre.dim() != 2 or mean_pre.shape[1] % 2:
        raise bad_tensor("mean_pre", mean_pre, "[H_kv, D] with D even")
    h, d = (int(x) for x in mean_pre.shape)
    r = rotation.detach().cpu().double()
    r = r[None] if r.dim() == 2 else r
    if r.dim() != 3 or tuple(r.shape[1:]) != (d, d) or r.shape[0] not in (1, h):
        raise bad_tensor("rotation", rotation, f"[{d}, {d}], [1, {d}, {d}] or [{h}, {d}, {d}]")
    r = r.expand(h, d, d)
    m = mean_pre.detach().cpu().double() * float(scaling)
    k = d // 2
    lo, hi = m[:, :k, None], m[:, k:, None]  # [H, D/2, 1]
    top = lo * r[:, :k] + hi * r[:, k:]
    bottom = lo * r[:, k:] - hi * r[:, :k]
    return torch.cat((top, bottom), 1).float().contiguous()
