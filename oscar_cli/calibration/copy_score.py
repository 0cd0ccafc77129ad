"""Copy score: how often a layer's INT2 keys change which history token a sharply focused head attends to.

The clip search and the per-layer fallback (:mod:`oscar_cli.calibration.schemes`) score a layer by its mean
attention-output error. That metric misses what multi-key retrieval needs: a head that puts most of its weight on
one earlier token (copying a value, following a name) must still pick that token when the keys are INT2. On
SmolLM2-135M the layers ranked first by output error are not the ones whose INT2 keys cost RULER answers; the
layers ranked first by this score are (docs/RESULTS.md, "Per-layer BF16 keys chosen by the copy score").

On the held-out sequences, per layer, with the layer's calibrated rotation, mean and key clip (the keys as the cache
serves them), for each of the last :data:`COPY_QUERIES` query positions ``i`` and each query head:

- the row counts when it has INT2 history keys (``sink ≤ j ≤ i − recent``: the BF16 sink and recent tiers are
  exact and cannot flip);
- it is *peaked* when its exact attention gives at least :data:`SHARP` of the softmax (over every key) to one
  INT2 history key;
- it *flips* when it is peaked and the history key of largest logit differs under the INT2 keys.

The score is ``flipped / rows``: the expected number of such flips per (query, head), i.e. how often a copying head
of the layer is misled. It needs no task data: a calibration measures it on its own held-out text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from oscar_cli.calibration.clipping import META_DTYPES, fake_quantize, head_rotations
from oscar_cli.quant.key_subspace import fake_subspace

SHARP = 0.3
COPY_QUERIES = 1024
CHUNK = 256


@dataclass
class CopyScore:
    """Counts over one layer's held-out (query, head) rows (module docstring)."""

    rows: int = 0
    peaked: int = 0
    flipped: int = 0
    lost: float = 0.0  # over peaked rows: the attention weight the top history key loses under INT2 keys (≥ 0)

    def add(self, other: CopyScore) -> CopyScore:
        return CopyScore(self.rows + other.rows, self.peaked + other.peaked, self.flipped + other.flipped,
                         self.lost + other.lost)

    @property
    def score(self) -> float:
        """Flips per scored (query, head) row."""
        return self.flipped / self.rows if self.rows else 0.0

    @property
    def lost_weight(self) -> float:
        """Weight the focused heads' top keys lose, per scored row: a graded form of :attr:`score`."""
        return self.lost / self.rows if self.rows else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "peaked": self.peaked, "flipped": self.flipped, "score": round(self.score, 6),
                "lost_weight": round(self.lost_weight, 6)}


def served_keys(k_ratio: float, quant: Any, subspace: torch.Tensor | None = None,
                key_bits: int = 2) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`copy_flips`' ``quantize``: rotated, centred keys -> as the cache serves them under the recipe's
    ``quant`` (group size, metadata dtype, levels). ``key_bits`` 2: INT2 with the clip ``k_ratio`` and the BF16 key
    ``subspace`` (what the clip search's keys are); 4: INT4 keys (formula 9, no clip; they take no subspace)."""
    meta = META_DTYPES[quant.meta_dtype]
    if key_bits == 4:
        from oscar_kernels.reference import dequantize_int4_planes, quantize_int4_planes

        return lambda y: dequantize_int4_planes(*quantize_int4_planes(y, quant.group_size, meta))
    return lambda y: fake_subspace(y, subspace, lambda x: fake_quantize(x, k_ratio, quant.group_size, meta,
                                                                        quant.levels), torch.bfloat16)


def copy_flips(
    q: torch.Tensor,
    k: torch.Tensor,
    k_rotation: torch.Tensor | None,
    k_mean: torch.Tensor | None,
    scaling: float,
    sink: int,
    recent: int,
    quantize: Callable[[torch.Tensor], torch.Tensor],
    sharp: float | None = None,
    chunk: int = CHUNK,
) -> CopyScore:
    """Copy counts of one held-out sequence batch.

    Args:
        q: ``[B, H_q, Tq, D]`` queries at the last ``Tq`` positions; k: ``[B, H_kv, T, D]`` (post-RoPE).
        k_rotation: ``[N, D, D]`` (``N`` 1 or ``H_kv``; None: identity).
        k_mean: rotated-space key mean, ``[H_kv, D]`` / ``[1, D]``, or per position ``[B or 1, H_kv, T, D]``
            (recipe ``quant.key_mean: rope``); None: none.
        quantize: rotated, centred keys ``[B, H_kv, T, D]`` -> as the INT2 tier serves them (clip, levels, group
            size, metadata dtype, BF16 key subspace: what the clip search's keys are).
        sharp: the weight that makes a row peaked (None: :data:`SHARP`).
    """
    sharp = SHARP if sharp is None else sharp
    b, hq, tq, d = q.shape
    h_kv, t = k.shape[1], k.shape[2]
    g = hq // h_kv
    dev = q.device
    rk = head_rotations(k_rotation, h_kv, d, dev)
    y = torch.einsum("bhtd,hde->bhte", k.float(), rk)
    if k_mean is None:
        mean = torch.zeros(1, 1, 1, d, device=dev)
    else:
        m = k_mean.to(dev, torch.float32)
        mean = m if m.dim() == 4 else m.expand(h_kv, d)[None, :, None]
    exact_keys = y  # the logits add the mean back: q·(ŷ + m) against q·(y − m + m)
    served_keys = quantize(y - mean) + mean
    qr = torch.einsum("bhgtd,hde->bhgte", q.float().reshape(b, h_kv, g, tq, d), rk)
    j = torch.arange(t, device=dev)
    out = CopyScore()
    for c0 in range(0, tq, chunk):
        qc = qr[:, :, :, c0 : c0 + chunk]
        pos = torch.arange(t - tq + c0, t - tq + c0 + qc.shape[3], device=dev)[:, None]
        causal = j[None, :] <= pos
        hist = (j[None, :] >= sink) & (j[None, :] <= pos - recent)
        exact = torch.einsum("bhgtd,bhsd->bhgts", qc, exact_keys) * scaling
        exact = exact.masked_fill(~causal, float("-inf"))
        lse = torch.logsumexp(exact, -1)
        top_val, top_ref = exact.masked_fill(~hist, float("-inf")).max(-1)
        served = torch.einsum("bhgtd,bhsd->bhgts", qc, served_keys) * scaling
        top_q = served.masked_fill(~hist, float("-inf")).argmax(-1)
        served = torch.where(hist, served, exact)  # the sink and recent tiers are exact
        p_top = (top_val - lse).exp()
        p_top_q = (served.gather(-1, top_ref.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(served, -1)).exp()
        valid = hist.any(-1).expand_as(top_ref)
        peaked = valid & (p_top >= sharp)
        flipped = peaked & (top_q != top_ref)
        lost = float((p_top - p_top_q).clamp_min(0)[peaked].sum())
        out = out.add(CopyScore(int(valid.sum()), int(peaked.sum()), int(flipped.sum()), lost))
    return out


def choose_key_layers(scores: list[CopyScore | None], count: int, schemes: list[str]) -> list[int]:
    """The ``count`` layers of largest copy score among those served as INT2 by the artifact's own transform
    (scheme ``oscar``) with at least one flip, in layer order (fewer when fewer layers flipped)."""
    ranked = sorted(
        (i for i, (s, scheme) in enumerate(zip(scores, schemes, strict=True))
         if s is not None and s.flipped > 0 and scheme == "oscar"),
        key=lambda i: (-scores[i].score, i),  # type: ignore[union-attr]
    )
    return sorted(ranked[:count])
