"""Which layers' INT2 keys change what attention picks while a model copies a needle's value (issue #21).

RULER's multi-key tasks fail under INT2 keys by chimeras: the copied value wanders from one needle into another
(docs/RESULTS.md, "What the wrong answers are"). The calibration scores a layer by its mean attention-output error
on prose; this script asks what that score may miss. For ``--samples`` RULER prompts of ``--task`` at ``--ctx``
it appends the BF16 model's own greedy answer (teacher-forced: the queries that copy the value), captures every
layer's post-RoPE queries and keys, quantizes the keys of the INT2 history (positions ``sink .. n - recent``) with
the artifact's rotation, mean and clip (reference quantizer), and reports per layer, over the answer's queries and
all query heads:

- ``out_err``: relative attention-output error ``‖Ô − O‖ / ‖O‖`` (what the calibration's clip search scores);
- ``logit_rms``: RMS logit error on the INT2 keys;
- ``top1_flip``: how often the most-attended INT2-history key changes, over the (query, head) pairs whose BF16
  attention puts at least ``--sharp`` on one history key (heads that point at one token: copying); ``peaked``: the
  share of such pairs;
- ``attn_kl``: KL(BF16 attention ‖ INT2 attention) per (query, head), mean.

    python scripts/layer_key_sensitivity.py smollm2-135m --artifact ART --task niah_multikey_2 --ctx 2048 \\
        --samples 8 --out docs/results/layer-key-sensitivity-smollm2-135m-cpu.json

With ``--text FILE`` the prompts are ``--samples`` evenly spaced windows of ``--ctx`` tokens of prose instead
(:func:`oscar_cli.eval.kl.cut_windows`), and the scored queries are each window's last ``--answer-tokens``
tokens, teacher-forced: what a calibration could measure on its own held-out text, without a task.

Float32 model on the CPU; values are served by the model's own (BF16-exact) values here: keys only.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch


def capture(model: Any, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer ``(q, k, v)`` post-RoPE, ``[1, H, n, D]`` (``k``/``v``: KV heads)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # rotate_half RoPE (Llama, Qwen2)

    seen: dict[int, dict[str, Any]] = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: seen.__setitem__(i, kwargs), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model.model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    n = int(ids.shape[1])
    with torch.no_grad():
        for i, kw in seen.items():
            att = model.model.layers[i].self_attn
            d = att.head_dim
            x, (cos, sin) = kw["hidden_states"], kw["position_embeddings"]
            q = att.q_proj(x).view(1, n, -1, d).transpose(1, 2)
            k = att.k_proj(x).view(1, n, -1, d).transpose(1, 2)
            v = att.v_proj(x).view(1, n, -1, d).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            out[i] = (q, k, v)
    return out


def layer_metrics(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t: Any, sink: int, recent: int,
                  first_query: int, sharp: float) -> dict[str, float]:
    from oscar_kernels.reference import dequantize_rows, quantize_rows

    n, d = k.shape[2], k.shape[3]
    g = q.shape[1] // k.shape[1]
    r = t.k_rotation[0] if t.k_rotation is not None else torch.eye(d)
    y = k @ r
    mean = t.k_mean.unsqueeze(-2).expand_as(y) if t.k_mean is not None else torch.zeros_like(y)
    yh = dequantize_rows(quantize_rows(y - mean, None, None, t.k_clip, None, torch.bfloat16)) + mean
    kh = k.clone()
    hist = slice(sink, max(sink, n - recent))
    kh[:, :, hist] = yh[:, :, hist] @ r.transpose(-1, -2)
    qs = q[:, :, first_query:]  # [1, Hq, m, D]
    kk, kq = k.repeat_interleave(g, 1), kh.repeat_interleave(g, 1)
    vv = v.repeat_interleave(g, 1)
    pos = torch.arange(first_query, n)[:, None]
    mask = torch.arange(n)[None, :] > pos  # causal
    s_ref = (qs @ kk.transpose(-1, -2)) * d ** -0.5
    s_q = (qs @ kq.transpose(-1, -2)) * d ** -0.5
    s_ref, s_q = s_ref.masked_fill(mask, float("-inf")), s_q.masked_fill(mask, float("-inf"))
    p_ref, p_q = s_ref.softmax(-1), s_q.softmax(-1)
    o_ref, o_q = p_ref @ vv, p_q @ vv
    in_hist = torch.zeros(n, dtype=torch.bool)
    in_hist[hist] = True
    diff = (s_q - s_ref)[..., in_hist]
    diff = diff[torch.isfinite(diff)]
    h_ref, h_q = p_ref[..., in_hist], p_q[..., in_hist]  # the INT2 history only (the sink is BF16: never flips)
    top_ref, top_q = h_ref.argmax(-1), h_q.argmax(-1)
    peaked = h_ref.max(-1).values >= sharp
    kl = (p_ref * (p_ref.clamp_min(1e-30).log() - p_q.clamp_min(1e-30).log())).sum(-1)
    return {"out_err": float(((o_q - o_ref).norm(dim=-1) / o_ref.norm(dim=-1).clamp_min(1e-12)).mean()),
            "logit_rms": float(diff.square().mean().sqrt()) if diff.numel() else 0.0,
            "top1_flip": float((top_ref != top_q)[peaked].float().mean()) if peaked.any() else 0.0,
            "peaked": float(peaked.float().mean()),
            "attn_kl": float(kl.mean())}


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--task", default="niah_multikey_2")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--answer-tokens", type=int, default=12, help="greedy BF16 answer tokens appended (the copy)")
    ap.add_argument("--sharp", type=float, default=0.3, help="top1_flip counts heads whose top key holds >= this")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", help="prose file: windows of it instead of RULER prompts (module docstring)")
    return ap.parse_args()


def main() -> None:
    a = _args()
    from oscar_cli.artifact import open_artifact
    from oscar_cli.eval.ruler import RulerConfig, build_samples
    from oscar_cli.model import load_model

    t0 = time.time()
    torch.set_num_threads(a.threads)
    art, lm = open_artifact(a.artifact), load_model(a.model, device="cpu", dtype="float32")
    sink, recent = int(art.manifest.quant.get("sink", 64)), int(art.manifest.quant.get("recent", 256))
    if a.text:
        from oscar_cli.eval.kl import cut_windows
        from oscar_cli.eval.prepare import read_text_file

        ids_all = lm.tokenizer(read_text_file(a.text), add_special_tokens=False)["input_ids"]
        wins = cut_windows(ids_all, a.ctx - a.answer_tokens, a.answer_tokens, a.samples)
        items: list[tuple[Any, list[int]]] = [(None, w.tolist()) for w in wins]
    else:
        cfg = RulerConfig(lengths=[a.ctx], tasks=[a.task], methods=[], samples=a.samples)
        items = build_samples(cfg, lm.tokenizer)[(a.task, a.ctx)]
    sums: dict[int, dict[str, float]] = {}
    for n_item, (sample, ids) in enumerate(items):
        if a.text:  # teacher-forced prose: the last answer_tokens positions are the scored queries
            full, first = torch.tensor([ids]), len(ids) - a.answer_tokens
        else:
            prompt = torch.tensor([ids])
            with torch.no_grad():
                full = lm.model.generate(prompt, max_new_tokens=a.answer_tokens, do_sample=False)
            first = prompt.shape[1]
        qkv = capture(lm.model, full)
        for i, (q, k, v) in qkv.items():
            m = layer_metrics(q, k, v, art.layers[i], sink, recent, first, a.sharp)
            acc = sums.setdefault(i, {key: 0.0 for key in m})
            for key, val in m.items():
                acc[key] += val / len(items)
        if sample is None:
            print(f"window {n_item}: {full.shape[1]} tokens", flush=True)
        else:
            answer = lm.tokenizer.decode(full[0, first:], skip_special_tokens=True)
            print(f"sample {sample.index}: BF16 answer {answer!r}, expected {sample.answers}", flush=True)
    rows = {str(i): {k: round(v, 5) for k, v in m.items()} for i, m in sorted(sums.items())}
    print("| layer | out_err | logit_rms | top1_flip | peaked | attn_kl |\n|---:|---:|---:|---:|---:|---:|")
    for name, m in rows.items():
        print(f"| {name} | {m['out_err']:.4f} | {m['logit_rms']:.3f} | {m['top1_flip']:.3f} | {m['peaked']:.3f} | "
              f"{m['attn_kl']:.4f} |")
    doc = {"model": a.model, "artifact": a.artifact, "task": None if a.text else a.task, "text": a.text,
           "ctx": a.ctx, "samples": len(items),
           "answer_tokens": a.answer_tokens, "sharp": a.sharp, "sink": sink, "recent": recent, "layers": rows,
           "seconds": round(time.time() - t0, 1)}
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {a.out} ({doc['seconds']} s)")


if __name__ == "__main__":
    main()
