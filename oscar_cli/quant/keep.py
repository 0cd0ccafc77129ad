"""The BF16 keep tier of an INT2 cache layer: a few demoted tokens per KV head also held in the activation dtype.

Chosen at write time (recipe ``quant.keep``): whenever tokens are demoted to the INT2 history (a prefill chunk's
history part, or a decode block of 8), each gets a score per sequence and KV head:

- ``qerr``: ``‖k − k̂‖/‖k‖ + ‖v − v̂‖/‖v‖``, the relative error of the token's rotated key and value under the INT2
  quantizer they were just written with (``k̂``: dequantized, centring mean added back, as attention reads it);
  high for tokens whose energy sits in a few channels, which per-token min-max INT2 crushes;
- ``knorm``: ``‖k‖`` of the rotated key (the post-RoPE key norm: the rotation is orthogonal).

The tier holds, per sequence and KV head, ``⌊f·n⌋`` tokens, ``n`` the history slots so far (:func:`keep_count`),
so its memory is bounded and known in advance. At each demotion the new count is taken, by score, from the
tokens already kept and the demoted block: a streaming choice (a token not kept when its block is demoted is held
only in INT2 from then on, so it cannot be chosen later). Per KV head rather than per token across heads: the
outlier tokens differ between heads, and with the same count in every head the tier is one dense tensor.

Kept tokens stay in the INT2 pages too (the pages are unchanged; dropping a token from the tier frees only its
BF16 row); attention reads their BF16 rows instead: the reference path's dense view gets them substituted at
their positions (:meth:`KeepTier.substitute`). Pad slots of a left-padded row score ``-inf`` (chosen only when a
row has fewer real tokens than the budget; attention masks them anyway).

Memory per kept (token, KV head): ``2·D`` values in the activation dtype (K and V), an int32 position and a
float32 score: :func:`keep_bits` is what that adds to the bits per element.
"""

from __future__ import annotations

import math

import torch

KEEP_SCORES = ("qerr", "knorm")
KEEP_SIDES = ("both", "keys", "values")
TAG_BITS = 64  # int32 position + float32 score per kept (token, KV head)


def keep_count(fraction: float, n: int) -> int:
    """Tokens per sequence and KV head the tier holds after ``n`` history slots: ``⌊fraction·n⌋``."""
    return int(math.floor(fraction * n + 1e-9)) if fraction > 0 and n > 0 else 0


def keep_bits(context_len: int, head_dim: int, fraction: float, sink: int, recent: int, act_bits: int = 16,
              side: str = "both") -> float:
    """Bits per K/V element the tier adds at ``context_len`` tokens (history ``L - S0 - W``, batch 1):
    ``⌊f·n⌋·(s·D·act_bits + 64) / (2·D·L)``, ``s`` = 2 for ``side`` both, 1 for keys or values alone."""
    kept = keep_count(fraction, max(0, context_len - sink - recent))
    rows = 2 if side == "both" else 1
    return kept * (rows * head_dim * act_bits + TAG_BITS) / (2 * head_dim * context_len)


def token_scores(
    kind: str, k: torch.Tensor, v: torch.Tensor, k_hat: torch.Tensor | None, v_hat: torch.Tensor | None,
    side: str = "both",
) -> torch.Tensor:
    """Scores ``float32 [B, H_kv, m]`` of rotated rows ``k``, ``v`` ``[B, H_kv, m, D]`` (``k_hat``/``v_hat``: the
    same rows as INT2 stores them, needed by ``qerr`` only; ``side`` keys / values: that side's error alone)."""
    if kind == "knorm":
        return k.float().norm(dim=-1)
    if kind != "qerr" or k_hat is None or v_hat is None:
        raise ValueError(f"keep score: expected one of {KEEP_SCORES} (qerr needs the dequantized rows), got {kind!r}")

    def rel(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return (x - x_hat).norm(dim=-1) / x.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)

    if side == "keys":
        return rel(k, k_hat)
    if side == "values":
        return rel(v, v_hat)
    return rel(k, k_hat) + rel(v, v_hat)


class KeepTier:
    """The kept rows of one layer: ``k``, ``v`` ``[B, H_kv, C, D]`` (activation dtype, rotated), ``pos`` int32
    ``[B, H_kv, C]`` (cache slot of each row), ``score`` float32 ``[B, H_kv, C]``; ``C`` the same for every head."""

    def __init__(self, fraction: float, score: str, side: str = "both") -> None:
        if score not in KEEP_SCORES:
            raise ValueError(f"keep score: expected one of {KEEP_SCORES}, got {score!r}")
        if side not in KEEP_SIDES:
            raise ValueError(f"keep side: expected one of {KEEP_SIDES}, got {side!r}")
        self.fraction, self.kind, self.side = fraction, score, side
        self.k = self.v = self.pos = self.score = None  # type: torch.Tensor | None

    @property
    def keeps_keys(self) -> bool:
        return self.side in ("both", "keys")

    @property
    def keeps_values(self) -> bool:
        return self.side in ("both", "values")

    @property
    def count(self) -> int:
        """Rows kept per sequence and KV head."""
        return 0 if self.pos is None else int(self.pos.shape[-1])

    def merge(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, score: torch.Tensor, count: int) -> None:
        """Keep the ``count`` highest-scoring rows of the kept ones and a demoted block ``k``, ``v``
        ``[B, H_kv, m, D]`` at cache slots ``pos [m]`` with ``score [B, H_kv, m]`` (per sequence and KV head)."""
        b, h, m, d = k.shape
        new_pos = pos.to(device=k.device, dtype=torch.int32).view(1, 1, m).expand(b, h, m)

        def joined(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
            return new if old is None else torch.cat([old, new], 2)

        all_pos, all_score = joined(self.pos, new_pos), joined(self.score, score.float())
        if count > all_pos.shape[-1]:
            raise AssertionError(f"keep tier: {count} rows asked from {all_pos.shape[-1]} candidates")
        idx = all_score.topk(count, dim=-1).indices  # [B, H, count]
        rows = idx.unsqueeze(-1).expand(-1, -1, -1, d)
        # a one-sided tier holds that side's rows only (its memory is what keep_bits prices)
        self.k = joined(self.k, k).gather(2, rows) if self.keeps_keys else None
        self.v = joined(self.v, v).gather(2, rows) if self.keeps_values else None
        self.pos, self.score = all_pos.gather(2, idx), all_score.gather(2, idx)

    def _below(self, limit: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The kept rows whose slot is below ``limit``: their mask over ``pos [B, H_kv, C]`` and their
        ``(batch, head, slot)`` indices into a dense ``[B, H_kv, T, ...]`` view."""
        assert self.pos is not None
        b, h, c = self.pos.shape
        dev = self.pos.device
        bi = torch.arange(b, device=dev).view(b, 1, 1).expand(b, h, c)
        hi = torch.arange(h, device=dev).view(1, h, 1).expand(b, h, c)
        pos = self.pos.long()
        ok = pos < limit
        return ok, (bi[ok], hi[ok], pos[ok])

    def substitute(self, out_k: torch.Tensor, out_v: torch.Tensor, limit: int) -> None:
        """Write the kept rows into dense views ``[B, H_kv, T, D]`` whose index ``t`` is cache slot ``t``, for the
        rows whose slot is below ``limit``."""
        if not self.count or self.pos is None:
            return
        ok, at = self._below(limit)
        if self.k is not None:
            out_k[at] = self.k[ok].to(out_k.dtype)
        if self.v is not None:
            out_v[at] = self.v[ok].to(out_v.dtype)

    def substitute_rows(self, out: torch.Tensor, value: torch.Tensor, limit: int) -> None:
        """Set the kept rows (slot below ``limit``) of ``out [B, H_kv, T, X]`` to ``value`` (broadcast)."""
        if not self.count or self.pos is None:
            return
        _, at = self._below(limit)
        out[at] = value.to(device=out.device, dtype=out.dtype)

    def nbytes(self) -> int:
        """Bytes the tier holds (allocated exactly: the tensors are rebuilt at each demotion)."""
        return int(sum(t.nbytes for t in (self.k, self.v, self.pos, self.score) if t is not None))

    def select(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` (in that order; a row may repeat)."""
        for name in ("k", "v", "pos", "score"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[rows].contiguous())
