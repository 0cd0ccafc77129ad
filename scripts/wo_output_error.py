#!/usr/bin/env python
"""Held-out INT2 attention-output error of artifacts, plain and after ``o_proj`` (W_O-weighted). Not a test.

The diagnostic behind docs/RESULTS.md "W_O-aware value metric": ``statistics.v_metric`` aims R_V at the error
*after* the output projection, which calibration's held-out error (plain ℓ2 of the attention output) does not
measure. For each artifact and layer, on ``--windows`` windows of ``--ctx`` tokens of ``--text``, the last
``--queries`` positions are scored under the serving tiers (sink/recent exact, the rest INT2 keys and values at
the artifact's clips, :class:`oscar_cli.calibration.clipping.LayerClipProblem`; ``--values-only``: exact keys):

    plain = Σ ‖Ô − O‖² / Σ ‖O‖²        W_O = Σ ‖(Ô − O)·W_Oᵀ‖² / Σ ‖O·W_Oᵀ‖²

(per query head ``j``, ``W_O,j`` its ``o_proj`` column block). Prints the mean over layers per artifact and on how
many layers each has a lower W_O error than the first artifact.

  python scripts/wo_output_error.py ART_BASE ART_VARIANT... --text held_out.txt --ctx 2048 --windows 2
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    from oscar_cli.artifact import open_artifact
    from oscar_cli.calibration.capture import HoldoutStore, capture_attention, run_forward
    from oscar_cli.calibration.clipping import LayerClipProblem
    from oscar_cli.model import load_model
    from oscar_cli.quant.runtime import decoder_attention_modules

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifacts", nargs="+", help="artifact folders; the first is the one compared against")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", required=True, help="held-out text")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--queries", type=int, default=128, help="scored positions at the end of each window")
    ap.add_argument("--values-only", action="store_true", help="exact keys: only the value side's error")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(a.model, device="cpu")
    model, cfg = lm.model, lm.model.config
    with open(a.text, encoding="utf-8") as f:
        ids = lm.tokenizer(f.read(), return_tensors="pt").input_ids[0]
    if ids.numel() < a.ctx:
        raise SystemExit(f"{a.text}: {ids.numel()} tokens, fewer than --ctx {a.ctx}")
    hq, hkv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    arts = [open_artifact(p, expect_architecture=cfg) for p in a.artifacts]
    d = arts[0].layers[0].v_rotation.shape[-1]
    stride = (ids.numel() - a.ctx) // max(a.windows, 1)
    store = HoldoutStore(int(cfg.num_hidden_layers), a.queries)
    with torch.no_grad(), capture_attention(model, store):
        for w in range(a.windows):
            run_forward(model, ids[w * stride : w * stride + a.ctx][None])
    errs: dict[str, dict[str, list[float]]] = {p: {"plain": [], "wo": []} for p in a.artifacts}
    for i, attn in enumerate(decoder_attention_modules(model)):
        wo = attn.o_proj.weight.detach().float().reshape(-1, hq, d)  # [hidden, H_q, D]
        for p, art in zip(a.artifacts, arts, strict=True):
            lay, qc = art.layers[i], art.manifest.recipe["quant"]
            sums = torch.zeros(4, dtype=torch.float64)
            for qq, k, v in store.layers[i]:
                pr = LayerClipProblem(qq, k, v, lay.k_rotation, lay.v_rotation, lay.k_mean, lay.v_mean,
                                      store.scaling, qc["sink"], qc["recent"], qc.get("group_size"), qc["meta_dtype"])
                if not a.values_only:
                    pr.set_key_ratio(lay.k_clip)
                rv = (torch.eye(d) if lay.v_rotation is None else lay.v_rotation.float()).expand(hkv, d, d)
                b, tq = qq.shape[0], qq.shape[2]
                def model_space(x: torch.Tensor, rv: torch.Tensor = rv, b: int = b, tq: int = tq) -> torch.Tensor:
                    return torch.einsum("bhte,hde->bhtd", x, rv).reshape(b, hq, tq, d)  # rows (j % g, position)

                err = model_space(pr.served_output(lay.v_clip) - pr.out)
                full = model_space(pr.out + pr.mu_v)
                ye, yf = (torch.einsum("bjtd,ojd->bto", x, wo) for x in (err, full))
                sums += torch.tensor([float(err.square().sum()), float(full.square().sum()),
                                      float(ye.square().sum()), float(yf.square().sum())], dtype=torch.float64)
            errs[p]["plain"].append(float(sums[0] / sums[1]))
            errs[p]["wo"].append(float(sums[2] / sums[3]))
    first = errs[a.artifacts[0]]["wo"]
    out = {}
    for p in a.artifacts:
        pl, w = errs[p]["plain"], errs[p]["wo"]
        lower = sum(x < y for x, y in zip(w, first, strict=True))
        out[p] = {"plain": sum(pl) / len(pl), "wo": sum(w) / len(w), "layers_lower_wo": lower}
        print(f"{p}: plain {out[p]['plain']:.5f}  W_O-weighted {out[p]['wo']:.5f}  "
              f"lower W_O error than the first on {lower}/{len(w)} layers")
    print(json.dumps({"ctx": a.ctx, "windows": a.windows, "queries": a.queries, "values_only": a.values_only,
                      "rows": out}))


if __name__ == "__main__":
    main()
