"""Streaming float64 second-moment statistics per layer and per KV head (docs/METHOD.md §2).

One :class:`LayerStatistics` per decoder layer accumulates, from post-RoPE ``q [B, H_q, T, D]`` and
``k, v [B, H_kv, T, D]`` (unpadded sequences starting at position 0), only what the recipe's targets need:

- ``qq``  ``[H_kv, D, D]``: Σ over tokens and the group's ``g`` query heads of ``qᵀq`` → ``qqt``:
  ``A_h = qq_h / (n·g)``; the layer target is ``mean_h A_h`` (the uncentred second moment of all queries).
- ``kk``, ``vv``: plain ``Σ kᵀk``, ``Σ vᵀv`` (``ktk`` / ``vtv``).
- ``sst`` (published value target): ``w_t = k_t A_h k_tᵀ`` (squared raw logit averaged over the group's
  queries, no softmax / scale / mask), ``C_V,h = Σ_t w_t v_tᵀv_t / Σ_t w_t`` (weights normalised to mean 1).
  ``A_h`` is only known at the end, so keys and values are kept in a bounded uniform reservoir of
  ``sst_max_tokens`` token positions per layer (exact while the statistics tokens fit in it).
- ``softmax``: per sequence, ``P = softmax(scale·q kᵀ + causal mask)``; ``w_t = (1/g) Σ_{j∈group} Σ_i P_{j,i,t}²``
  (the diagonal of ``SᵀS``: how much squared attention mass key ``t`` receives), optionally zero for the BF16
  sink positions ``t < sink``; ``C_V,h = Σ w v vᵀ / Σ w``.
- ``sv``: the paper's literal ``(SV)ᵀ(SV)`` = second moment of the attention output per group.
- ``k_sum``, ``v_sum``: for the centering means; ``k_pre_sum`` (recipe ``quant.key_mean: rope``): the pre-RoPE
  keys' sum, handed in by the caller (:func:`oscar_cli.quant.key_mean.pre_rope_mean`).

Memory is independent of the number of tokens (the reservoir is capped). Everything is float64 except the
``T×T`` softmax, computed in float32 one (sequence, KV head) at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

F64 = torch.float64


@dataclass
class LayerTargets:
    """Finalised statistics of one layer (float64, CPU).

    Attributes:
        k_target: ``[H_kv, D, D]`` per-head key metric (qqt: ``A_h``; ktk: ``K_hᵀK_h/n``).
        v_target: ``[H_kv, D, D]`` per-head value metric.
        k_mean: ``[H_kv, D]`` raw (unrotated) key mean; v_mean likewise.
        k_mean_pre: ``[H_kv, D]`` pre-RoPE key mean (None: not accumulated).
        v_weight_mean: ``[H_kv]`` mean of the normalised value weights (1 by construction; a sanity check).
        tokens: statistics tokens seen.
    """

    k_target: torch.Tensor
    v_target: torch.Tensor
    k_mean: torch.Tensor
    v_mean: torch.Tensor
    v_weight_mean: torch.Tensor
    tokens: int
    k_mean_pre: torch.Tensor | None = None


def grouped_queries(q: torch.Tensor, h_kv: int) -> torch.Tensor:
    """``q [B, H_q, T, D]`` → ``[H_kv, B·g·T, D]`` (query head ``j`` belongs to KV head ``j // g``)."""
    b, hq, t, d = q.shape
    g = hq // h_kv
    return q.reshape(b, h_kv, g, t, d).permute(1, 0, 2, 3, 4).reshape(h_kv, b * g * t, d)


def per_head_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [B, H, T, D]`` → ``[H, B·T, D]``."""
    b, h, t, d = x.shape
    return x.permute(1, 0, 2, 3).reshape(h, b * t, d)


def gram(x: torch.Tensor) -> torch.Tensor:
    """``Σ_rows xᵀx`` in float64 for ``x [H, N, D]`` → ``[H, D, D]``."""
    x64 = x.to(F64)
    return x64.transpose(1, 2) @ x64


def softmax_key_weights(q: torch.Tensor, k: torch.Tensor, scaling: float, sink: int) -> torch.Tensor:
    """Causal-softmax key weights ``w [B, H_kv, T]`` (float32): ``(1/g) Σ_{j∈group, i} P_{j,i,t}²``.

    ``q [B, H_q, T, D]``, ``k [B, H_kv, T, D]``; keys ``t < sink`` get weight 0 (they stay BF16 when served).
    """
    b, hq, t, d = q.shape
    h_kv = k.shape[1]
    g = hq // h_kv
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    w = torch.empty(b, h_kv, t, dtype=torch.float32, device=q.device)
    for bi in range(b):
        for h in range(h_kv):
            qh = q[bi, h * g : (h + 1) * g].float()  # [g, T, D]
            logits = (qh @ k[bi, h].float().T) * scaling  # [g, T, T]
            logits = logits.masked_fill(~causal, float("-inf"))
            p = torch.softmax(logits, dim=-1)
            w[bi, h] = p.square().sum(dim=(0, 1)) / g
    if sink > 0:
        w[:, :, :sink] = 0.0
    return w


class LayerStatistics:
    """Streaming accumulators of one layer. Create with the layer's head layout and the recipe's targets."""

    def __init__(
        self,
        h_kv: int,
        head_dim: int,
        k_target: str = "qqt",
        v_target: str = "sst",
        sink: int = 0,
        exclude_sink: bool = True,
        reservoir: int = 16384,
        device: torch.device | str = "cpu",
    ) -> None:
        self.h_kv, self.d = h_kv, head_dim
        self.k_target, self.v_target = k_target, v_target
        self.sink = sink if exclude_sink else 0
        self.device = torch.device(device)
        z = lambda *s: torch.zeros(*s, dtype=F64, device=self.device)  # noqa: E731
        self.n = 0
        self.group = 1
        self.k_sum, self.v_sum = z(h_kv, head_dim), z(h_kv, head_dim)
        need_qq = k_target == "qqt" or v_target == "sst"
        self.qq = z(h_kv, head_dim, head_dim) if need_qq else None
        self.kk = z(h_kv, head_dim, head_dim) if k_target == "ktk" else None
        self.vv = z(h_kv, head_dim, head_dim) if v_target == "vtv" else None
        self.wvv = z(h_kv, head_dim, head_dim) if v_target in ("softmax", "sv") else None
        self.wsum = z(h_kv) if v_target in ("softmax", "sv") else None
        self.cap = reservoir
        self.res_k: torch.Tensor | None = None  # [cap, H_kv, D], the incoming dtype
        self.res_v: torch.Tensor | None = None
        self.res_filled = 0
        self.k_pre_sum: torch.Tensor | None = None
        self.k_pre_n = 0

    def add_pre_rope(self, total: torch.Tensor, count: int) -> None:
        """Add ``count`` tokens' pre-RoPE key sum ``[H_kv, D]`` (for ``k_mean_pre``)."""
        t = total.to(self.device, F64)
        self.k_pre_sum = t if self.k_pre_sum is None else self.k_pre_sum + t
        self.k_pre_n += count

    def update(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor | None,
        scaling: float,
        plan: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Add one forward call: ``q [B, H_q, T, D]``, ``k, v [B, H_kv, T, D]``, ``out [B, H_q, T, D]``.

        ``plan`` = (reservoir slots, token indices into the flattened ``B·T`` tokens) for ``sst``.
        """
        b, hq, t, _ = q.shape
        self.group = hq // self.h_kv
        self.n += b * t
        kr, vr = per_head_rows(k), per_head_rows(v)  # [H_kv, B·T, D]
        self.k_sum += kr.to(F64).sum(1)
        self.v_sum += vr.to(F64).sum(1)
        if self.qq is not None:
            self.qq += gram(grouped_queries(q, self.h_kv))
        if self.kk is not None:
            self.kk += gram(kr)
        if self.vv is not None:
            self.vv += gram(vr)
        if self.v_target == "softmax" and self.wvv is not None and self.wsum is not None:
            w = per_head_rows(softmax_key_weights(q, k, scaling, self.sink).unsqueeze(-1))  # [H_kv, B·T, 1]
            v64 = vr.to(F64)
            self.wvv += (v64 * w.to(F64)).transpose(1, 2) @ v64
            self.wsum += w.to(F64).sum(dim=(1, 2))
        if self.v_target == "sv" and self.wvv is not None and self.wsum is not None and out is not None:
            self.wvv += gram(grouped_queries(out, self.h_kv))
            self.wsum += float(b * hq // self.h_kv * t)
        if self.v_target == "sst" and plan is not None:
            self._reservoir_add(k, v, plan)

    def _reservoir_add(self, k: torch.Tensor, v: torch.Tensor, plan: tuple[torch.Tensor, torch.Tensor]) -> None:
        slots, idx = plan
        if self.res_k is None:
            self.res_k = torch.zeros(self.cap, self.h_kv, self.d, dtype=k.dtype, device=k.device)
            self.res_v = torch.zeros(self.cap, self.h_kv, self.d, dtype=v.dtype, device=v.device)
        assert self.res_v is not None
        if slots.numel():
            flat_k = k.permute(0, 2, 1, 3).reshape(-1, self.h_kv, self.d)  # [B·T, H_kv, D]
            flat_v = v.permute(0, 2, 1, 3).reshape(-1, self.h_kv, self.d)
            s, i = slots.to(k.device), idx.to(k.device)
            self.res_k[s] = flat_k[i]
            self.res_v[s] = flat_v[i]
            self.res_filled = max(self.res_filled, int(slots.max()) + 1)

    def finalize(self) -> LayerTargets:
        """Targets per KV head (float64, moved to CPU at the end; the work runs on the statistics' device).

        Raises ValueError if nothing was accumulated."""
        if self.n == 0:
            raise ValueError("no tokens were accumulated for this layer")
        n, g = self.n, self.group
        a = self.qq / (n * g) if self.qq is not None else None
        if self.k_target == "qqt":
            assert a is not None
            k_t = a
        else:
            assert self.kk is not None
            k_t = self.kk / n
        wmean = torch.ones(self.h_kv, dtype=F64, device=self.k_sum.device)
        if self.v_target == "sst":
            assert a is not None and self.res_k is not None and self.res_v is not None
            kk = self.res_k[: self.res_filled].to(F64).transpose(0, 1)  # [H_kv, m, D]
            vv = self.res_v[: self.res_filled].to(F64).transpose(0, 1)
            w = ((kk @ a) * kk).sum(-1)  # k A kᵀ: squared logits averaged over the group's queries [H_kv, m]
            w = w * (w.shape[1] / w.sum(1, keepdim=True).clamp_min(1e-12))  # mean 1 per head
            wmean = w.mean(1)
            v_t = (vv * w.unsqueeze(-1)).transpose(1, 2) @ vv / w.shape[1]
        elif self.v_target == "vtv":
            assert self.vv is not None
            v_t = self.vv / n
        else:
            assert self.wvv is not None and self.wsum is not None
            v_t = self.wvv / self.wsum.clamp_min(1e-12)[:, None, None]
        sym = lambda m: ((m + m.transpose(-1, -2)) / 2).cpu()  # noqa: E731
        pre = None if self.k_pre_sum is None else (self.k_pre_sum / max(self.k_pre_n, 1)).cpu()
        return LayerTargets(sym(k_t), sym(v_t), (self.k_sum / n).cpu(), (self.v_sum / n).cpu(), wmean.cpu(), n, pre)


def reservoir_plan(
    seen: int, count: int, cap: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform reservoir sampling (algorithm R) for ``count`` new tokens after ``seen`` earlier ones.

    Returns ``(slots, token_indices)`` int64 with one entry per slot written (the last writer wins), shared
    by every layer so that the kept K and V of all layers come from the same token positions.
    """
    idx = torch.arange(count, dtype=torch.int64)
    glob = idx + seen
    direct = glob < cap
    slots = torch.where(direct, glob, torch.zeros_like(glob))
    if (~direct).any():
        r = (torch.rand(count, generator=generator, dtype=F64) * (glob + 1).to(F64)).floor().to(torch.int64)
        slots = torch.where(direct, glob, r)
    keep = slots < cap
    slots, idx = slots[keep], idx[keep]
    # last writer wins: keep the final occurrence of each slot
    order = torch.arange(slots.numel())
    last = torch.full((cap,), -1, dtype=torch.int64).scatter_reduce(0, slots, order, reduce="amax")
    chosen = last[last >= 0]
    return slots[chosen], idx[chosen]
