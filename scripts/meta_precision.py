#!/usr/bin/env python
"""What 8-bit metadata (formula 10, ``quant.meta_dtype: uint8``) costs on real rows, and which half of it costs.

For one prose window the plain model's post-RoPE queries, keys and values of every layer are captured; keys and
values are rotated, centred and clipped with an artifact's transforms (as the cache writes them) and INT2-quantized
per row with five metadata variants: ``bf16`` (formula 4, the default), ``m8`` (formula 10), ``m8-exactzero``
(formula 10's scale, the centred zero unrounded), ``exactscale-m8zero`` (float32 step, the zero rounded to 1/16 of
it) and ``exactscale-centred`` (float32 step and centred zero). Per variant it prints the mean over layers of the
keys' logit error variance ``E[(scaling · q̃·(k̂ - k̃))²]`` (the window's last ``--queries`` queries against every
token) and the values' relative MSE, each also as a ratio to ``bf16``. CPU, about a minute for SmolLM2-135M at 2K:

  python scripts/meta_precision.py smollm2-135m --artifact ART --text ../shared/data/corpus/austen_persuasion.txt \\
      --offset 5000 --ctx 2048
"""

from __future__ import annotations

import argparse

import torch

VARIANTS = ("bf16", "m8", "m8-exactzero", "exactscale-m8zero", "exactscale-centred")


def _parser() -> argparse.ArgumentParser:
    from _window import window_parser  # scripts/_window.py

    p = window_parser(__doc__, "oscar artifact (rotations, means, clips)")
    p.add_argument("--threads", type=int, default=1)
    return p


def fake_quantize(y: torch.Tensor, variant: str) -> torch.Tensor:
    """Min-max INT2 of rows ``y [..., D]`` (one group per row) with the metadata of ``variant``, in float32."""
    from oscar_kernels import reference as ref

    y = y.float()
    mn, mx = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
    s = torch.clamp(mx - mn, min=1e-8) / 3
    mid = (mn + mx) / 2
    if variant == "bf16":
        sf, zf = s.bfloat16().float(), mn.bfloat16().float()
    elif variant in ("m8", "m8-exactzero"):
        sb, zb = ref.encode_meta(s[..., 0], mn[..., 0], mx[..., 0], 3.0, ref.META8)
        sf, zf = (t[..., None] for t in ref.decode_meta(sb, zb))
        if variant == "m8-exactzero":
            zf = mid - 1.5 * sf
    elif variant == "exactscale-m8zero":
        sf, zf = s, torch.round((mid - 1.5 * s) / (s / 16)) * (s / 16)
    elif variant == "exactscale-centred":
        sf, zf = s, mid - 1.5 * s
    else:
        raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
    return zf + torch.floor((y - zf) / sf + 0.5).clamp(0, 3) * sf


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from _window import load_window  # scripts/_window.py

    from oscar_cli.calibration.capture import capture_attention
    from oscar_kernels.reference import clip_rows, rotate

    lm, meth, ids = load_window(args, "cpu", torch.float32)
    sums = {v: [0.0, 0.0] for v in VARIANTS}
    layers: list[int] = []

    def observer(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 scaling: float) -> None:
        if meth.for_layer(layer).kind != "int2":
            return
        layers.append(layer)
        t = meth.layer(layer)
        h_kv = k.shape[1]
        g = q.shape[1] // h_kv

        def per_head(r: torch.Tensor | None) -> torch.Tensor | None:
            return None if r is None else (r.expand(h_kv, -1, -1) if r.shape[0] == 1 else r)

        rk, rv = per_head(t.k_rotation), per_head(t.v_rotation)
        km = 0.0 if t.k_mean is None else t.k_mean.float().unsqueeze(-2)
        vm = 0.0 if t.v_mean is None else t.v_mean.float().unsqueeze(-2)
        kr = clip_rows(rotate(k.float(), rk) - km, t.k_clip)
        vr = clip_rows(rotate(v.float(), rv) - vm, t.v_clip)
        qr = rotate(q.float()[..., -args.queries :, :], None if rk is None else rk.repeat_interleave(g, 0))
        for var in VARIANTS:
            kh, vh = fake_quantize(kr, var), fake_quantize(vr, var)
            eps = scaling * (qr @ (kh - kr).repeat_interleave(g, 1).transpose(-1, -2))
            sums[var][0] += float((eps**2).mean())
            sums[var][1] += float(((vh - vr) ** 2).mean() / (vr**2).mean())

    with torch.no_grad(), capture_attention(lm.model, observer):
        lm.model(ids)
    n = max(len(layers), 1)
    base_k, base_v = sums["bf16"][0] / n, sums["bf16"][1] / n
    print(f"{len(layers)} INT2 layers, {args.ctx} tokens from offset {args.offset}, {args.queries} queries")
    for var in VARIANTS:
        k_err, v_err = sums[var][0] / n, sums[var][1] / n
        print(f"{var:20s} key logit error variance {k_err:.5f} ({k_err / base_k:.4f}x)  "
              f"value relative MSE {v_err:.5f} ({v_err / base_v:.4f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
