"""How far a layer's post-RoPE keys drift from the artifact's constant key mean along the context, and what a
position-dependent mean would leave (issue #21: why OSCAR's KL jumps between 16K and 32K on Qwen2.5).

A model with a large ``k_proj`` bias (Qwen2.5) has a key mean ``m`` before RoPE; after RoPE the mean at position
``p`` is ``RoPE_p(m)``, which turns with ``p``. The artifact centres the rotated keys by one constant mean, the
average of ``RoPE_p(m)`` over the calibration positions (8K-token sequences), so beyond them the centred keys
keep a growing component, the per-token INT2 range grows with it, and so does each key's error.

For one window of ``--ctx`` tokens of ``--text`` this runs the model up to the deepest ``--layers`` layer, takes
each chosen layer's real post-RoPE keys and last 64 queries, and quantizes the rotated keys with the artifact's
rotation and clip twice: centred by the artifact's constant mean, and centred by ``RoPE_p(m_pre)`` with ``m_pre``
the layer's mean pre-RoPE key over the window's first ``--mean-positions`` positions (what a calibration of
that sequence length would estimate). Per position bucket it reports the centred key norm, the relative INT2
error and the RMS logit error ``q·(k̂ - k)/√D`` over the 64 queries. Reference quantizer
(``oscar_kernels.reference``), float32 model; about 14 minutes for 8 layers at 32K on 2 CPU cores.

    python scripts/key_mean_drift.py GGUF --artifact ART --text ../shared/data/corpus/austen_persuasion.txt \\
        --ctx 32704 --layers 0,1,7 --out docs/results/key-mean-drift-qwen2.5-coder-1.5b-cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch


def _buckets(n: int) -> list[tuple[int, int]]:
    edges = [0, 4096, 8192, 16384, 24576]
    edges = [e for e in edges if e < n] + [n]
    return list(zip(edges[:-1], edges[1:], strict=True))


def measure(model: Any, ids: torch.Tensor, art: Any, layers: list[int], mean_positions: int) -> dict[str, Any]:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # rotate_half RoPE (Llama, Qwen2)

    from oscar_kernels.reference import dequantize_rows, quantize_rows

    captured: dict[int, dict[str, Any]] = {}
    hooks = [model.model.layers[i].self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: captured.__setitem__(i, kwargs), with_kwargs=True) for i in layers]
    full = model.model.layers
    model.model.layers = full[: max(layers) + 1]  # nothing after the deepest layer asked for is needed
    try:
        with torch.no_grad():
            model.model(input_ids=ids, use_cache=False)
    finally:
        model.model.layers = full
        for h in hooks:
            h.remove()
    out: dict[str, Any] = {}
    n = int(ids.shape[1])
    with torch.no_grad():
        for i in layers:
            kw = captured[i]
            x, (cos, sin) = kw["hidden_states"], kw["position_embeddings"]
            att = full[i].self_attn
            d = att.head_dim
            q = att.q_proj(x).view(1, n, -1, d).transpose(1, 2)
            k = att.k_proj(x).view(1, n, -1, d).transpose(1, 2)
            m_pre = k[:, :, :mean_positions].mean(2, keepdim=True)
            qr, kr = apply_rotary_pos_emb(q, k, cos, sin)
            mu_p = apply_rotary_pos_emb(q, m_pre.expand_as(k), cos, sin)[1]
            t = art.layers[i]
            r = t.k_rotation[0]
            y = kr @ r
            qq = qr[:, :, -64:] @ r
            h_kv = y.shape[1]
            qg = qq.reshape(1, h_kv, -1, d)  # query head j -> KV head j // g
            res = {}
            for name, mean in (("constant", t.k_mean.unsqueeze(-2).expand_as(y)), ("rope_p", mu_p @ r)):
                yh = dequantize_rows(quantize_rows(y - mean, None, None, t.k_clip, None, torch.bfloat16)) + mean
                e = yh - y
                logit = (qg @ e.transpose(-1, -2)) * d ** -0.5
                rows = []
                for a, z in _buckets(n):
                    c = (y - mean)[:, :, a:z]
                    rows.append({"positions": [a, z], "centred_norm": round(float(c.norm(dim=-1).mean()), 2),
                                 "rel_err": round(float((e[:, :, a:z].norm(dim=-1) / c.norm(dim=-1)).mean()), 4),
                                 "logit_err_rms": round(float(logit[..., a:z].square().mean().sqrt()), 4)})
                res[name] = rows
            out[str(i)] = res
            print(f"layer {i}: " + json.dumps(res), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--ctx", type=int, default=32704)
    ap.add_argument("--layers", default="0,1,7")
    ap.add_argument("--mean-positions", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from oscar_cli.artifact import open_artifact
    from oscar_cli.model import load_model

    torch.set_num_threads(a.threads)
    t0 = time.time()
    lm = load_model(a.model, device="cpu", dtype="float32")
    ids = lm.tokenizer(open(a.text, encoding="utf-8").read(), return_tensors="pt").input_ids[:, : a.ctx]
    art = open_artifact(a.artifact)
    layers = [int(x) for x in a.layers.split(",")]
    res = measure(lm.model, ids, art, layers, a.mean_positions)
    doc = {"model": a.model, "artifact": a.artifact, "text": a.text, "ctx": int(ids.shape[1]),
           "mean_positions": a.mean_positions, "layers": res, "seconds": round(time.time() - t0, 1)}
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {a.out} ({doc['seconds']} s)")


if __name__ == "__main__":
    main()
