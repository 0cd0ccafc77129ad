#!/usr/bin/env python
"""Measure the logit error INT2 keys add, and the attention mass it inflates (issue #21, logit-variance premise).

For one prose window, exact post-RoPE queries and keys of every layer are captured from the plain model; keys are
rotated, centred, clipped and INT2-quantized with an artifact's transforms exactly as the cache writes them
(``oscar_kernels.reference.quantize_rows``), and for each of the window's last ``--queries`` queries ``i`` and each
INT2 token ``j`` (``S0 <= j <= i - W``: the serving tiers of a decode step) the script computes

- the logit error ``eps_ij = scaling · q̃_i·(k̂_j - k̃_j)`` (rotated space, ``scaling = 1/√D``);
- the estimate from what is stored, ``sig2_ij = scaling²·‖q̃_i‖²·s_j²/12`` (``s_j`` the token's stored scale,
  one per group; the mean of ``s²`` over groups when ``G < D``), and the exact per-token one
  ``scaling²·‖q̃_i‖²·‖k̂_j - k̃_j‖²/D`` (needs the error, which is not stored);
- the INT2 history's softmax mass relative to the exact one, ``log Σ_j exp(s_ij + eps_ij) - log Σ_j exp(s_ij)``
  (the inflation the correction targets), uncorrected and with ``-sig2_ij/2`` subtracted (the ``scale``
  correction), and the change in the INT2 history's share of the total attention mass (sink + history + recent).

Prints one row per layer and a summary; ``--json`` writes everything. CPU, seconds for SmolLM2-135M at 2K:

  python scripts/logit_variance.py smollm2-135m --artifact ART --text ../shared/data/corpus/austen_persuasion.txt \\
      --ctx 2048 --queries 64 --device cpu --threads 1 --json lv.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch


def _parser() -> argparse.ArgumentParser:
    from _window import window_parser  # scripts/_window.py

    p = window_parser(__doc__, "oscar artifact (rotations, means, clips, sink/recent)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int)
    p.add_argument("--json", help="write the per-layer numbers here")
    return p


def layer_stats(q: torch.Tensor, k: torch.Tensor, rot: torch.Tensor | None, mean: torch.Tensor | None, clip: float,
                group: int | None, meta: torch.dtype, inner: float, scaling: float, sink: int, recent: int,
                n_queries: int) -> dict[str, float]:
    """Premise numbers of one layer: ``q [1, H_q, T, D]``, ``k [1, H_kv, T, D]`` post-RoPE, unrotated."""
    from oscar_kernels.reference import dequantize_rows, quantize_rows, rotate

    _, hq, t, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    if rot is not None:
        rk = rot.expand(hkv, -1, -1) if rot.shape[0] == 1 else rot
        kr = rotate(k.float(), rk)
        qr = rotate(q.float(), rk.repeat_interleave(g, dim=0))
    else:
        kr, qr = k.float(), q.float()
    mu = None if mean is None else (mean.expand(hkv, -1) if mean.shape[0] == 1 else mean).float()
    rows = quantize_rows(kr, None, mu, clip, group, meta, inner)
    khat = dequantize_rows(rows, inner=inner) + (0 if mu is None else mu.unsqueeze(-2))
    err = (khat - kr)[0]  # [H_kv, T, D]
    s2 = rows.scale.float()[0].pow(2).mean(-1)  # [H_kv, T]: s_j² (mean over groups)
    e2 = err.pow(2).mean(-1)  # [H_kv, T]: ‖k̂ - k̃‖² / D
    qi = qr[0, :, t - n_queries :]  # [H_q, n, D]
    kk = kr[0].repeat_interleave(g, dim=0)  # [H_q, T, D]
    ee = err.repeat_interleave(g, dim=0)
    s = scaling * qi @ kk.transpose(-1, -2)  # [H_q, n, T] exact logits
    eps = scaling * qi @ ee.transpose(-1, -2)
    qn2 = scaling**2 * qi.pow(2).sum(-1, keepdim=True)  # [H_q, n, 1]
    est = qn2 * (s2.repeat_interleave(g, dim=0) / 12).unsqueeze(1)  # [H_q, n, T]
    exact = qn2 * e2.repeat_interleave(g, dim=0).unsqueeze(1)
    pos_i = torch.arange(t - n_queries, t).view(1, -1, 1)
    pos_j = torch.arange(t).view(1, 1, -1)
    hist = (pos_j >= sink) & (pos_j <= pos_i - recent)  # INT2 tokens of query i (decode-step tiers)
    causal = pos_j <= pos_i
    hist = hist.expand_as(s)
    ninf = torch.tensor(float("-inf"))

    def lse(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return torch.logsumexp(torch.where(m, x, ninf), -1)

    lse_h = lse(s, hist)
    infl = lse(s + eps, hist) - lse_h  # log of the INT2 mass ratio, per (head, query)
    infl_corr = lse(s + eps - est / 2, hist) - lse_h
    infl_exact = lse(s + eps - exact / 2, hist) - lse_h
    rest = causal.expand_as(s) & ~hist
    lse_r = lse(s, rest)
    share = torch.sigmoid(lse_h - lse_r)  # exact INT2 share of the total mass
    share_q = torch.sigmoid(lse_h + infl - lse_r)
    share_c = torch.sigmoid(lse_h + infl_corr - lse_r)
    p = torch.softmax(torch.where(hist, s, ninf), -1)  # attention within the history
    m = hist.float()
    cnt = m.sum()
    eps_h, est_h, exa_h = eps * m, est * m, exact * m
    mean_eps = eps_h.sum() / cnt
    var_eps = (eps_h.pow(2).sum() / cnt - mean_eps**2).item()
    # per token: realized E_i[eps²] vs the estimate, over (head, token) cells with a full set of queries
    per_tok = (eps.pow(2) * m).sum(1) / m.sum(1).clamp(min=1)
    per_est = (est * m).sum(1) / m.sum(1).clamp(min=1)
    full = m.sum(1) == n_queries
    a, b = per_tok[full], per_est[full]
    corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item() if a.numel() > 2 else float("nan")
    # clipped elements: their error share
    y = kr - (0 if mu is None else mu.unsqueeze(-2))
    from oscar_kernels.reference import clip_rows

    yc = clip_rows(y, clip)
    clip_err2 = (yc - y)[0].pow(2).mean(-1)  # [H_kv, T]
    return {
        "int2_pairs": int(cnt.item()),
        "eps_mean": mean_eps.item(),
        "eps_var": var_eps,
        "eps_attn_mean": (p * eps).nan_to_num().sum(-1).mean().item(),
        "est_mean": (est_h.sum() / cnt).item(),
        "exact_est_mean": (exa_h.sum() / cnt).item(),
        "ratio_var_over_est": var_eps / (est_h.sum() / cnt).item(),
        "per_token_corr": corr,
        "clip_share_of_err2": (clip_err2.sum() / e2.sum()).item(),
        "s2_over_12_over_err2": ((s2 / 12).sum() / e2.sum()).item(),
        "log_inflation": infl.mean().item(),
        "log_inflation_corrected": infl_corr.mean().item(),
        "log_inflation_exact_corrected": infl_exact.mean().item(),
        "predicted_log_inflation": (lse(s + est / 2, hist) - lse_h).mean().item(),
        "int2_share": share.mean().item(),
        "int2_share_quant": share_q.mean().item(),
        "int2_share_corrected": share_c.mean().item(),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from _window import load_window  # scripts/_window.py

    from oscar_cli.calibration.capture import capture_attention

    lm, meth, ids = load_window(args, args.device)
    rows: list[dict[str, Any]] = []

    def observer(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 scaling: float) -> None:
        lm_kind = meth.for_layer(layer).kind
        if lm_kind != "int2":
            return
        t = meth.layer(layer)
        st = layer_stats(q.detach(), k.detach(), t.k_rotation, t.k_mean, t.k_clip, meth.group_size,
                         meth.meta_dtype, meth.levels, scaling, meth.sink, meth.recent, args.queries)
        rows.append({"layer": layer, **st})

    with torch.no_grad(), capture_attention(lm.model, observer):
        lm.model(ids.to(lm.device))
    keys = ["eps_var", "est_mean", "exact_est_mean", "ratio_var_over_est", "per_token_corr", "clip_share_of_err2",
            "eps_mean", "eps_attn_mean", "log_inflation", "predicted_log_inflation", "log_inflation_corrected",
            "int2_share", "int2_share_quant", "int2_share_corrected"]
    print("| layer | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for r in rows:
        print(f"| {r['layer']} | " + " | ".join(f"{r[k]:.4g}" for k in keys) + " |")
    summary = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    summary["max_eps_var"] = max(r["eps_var"] for r in rows)
    print("| mean | " + " | ".join(f"{summary[k]:.4g}" for k in keys) + " |")
    print(f"max eps_var over layers {summary['max_eps_var']:.4g}; mean INT2 mass inflation "
          f"x{math.exp(summary['log_inflation']):.4f}, predicted x{math.exp(summary['predicted_log_inflation']):.4f}, "
          f"after the scale correction x{math.exp(summary['log_inflation_corrected']):.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "layers": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
