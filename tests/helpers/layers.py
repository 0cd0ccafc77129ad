"""Driving one cache layer the way a server does: chunked prefill, then single-token decode steps; the dense
reference of what each step must return.

The dense reference does not use the cache: it quantizes every token's rotated row on its own (per-token INT2 is
independent of when a token is demoted), and decides each slot's tier from docs/METHOD.md §7's rules (sink = slots
``[0, S0 + max_pad)``, recent = the last ``r`` slots where ``r`` follows the chunk/decode rules, the rest INT2).
"""

from __future__ import annotations

from typing import Any

import torch

from oscar_cli.quant import LayerTransform
from oscar_cli.quant.methods import QuantMethod
from oscar_kernels.reference import dequantize_rows, quantize_rows, rotate


def feed(layer: Any, k: torch.Tensor, v: torch.Tensor, chunks: list[int], decode: int) -> list:
    """Prefill ``chunks`` (sizes; last is final) then ``decode`` single tokens; return every update's output.

    ``layer``: an ``Int2Layer`` or ``KiviLayer`` (anything with ``final_chunk`` and ``update(k, v)``)."""
    outs, s = [], 0
    for i, c in enumerate(chunks):
        layer.final_chunk = i == len(chunks) - 1
        outs.append(layer.update(k[..., s : s + c, :], v[..., s : s + c, :]))
        s += c
    layer.final_chunk = True
    for _ in range(decode):
        outs.append(layer.update(k[..., s : s + 1, :], v[..., s : s + 1, :]))
        s += 1
    return outs


def dense_reference(
    meth: QuantMethod, t: LayerTransform, k: torch.Tensor, v: torch.Tensor, pads: list[int], chunks: list[int],
    decode: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What each update (prefill chunks, then ``decode`` single tokens) must return: stored slots ``[0, prior)``
    (sink and recent raw, INT2 dequantized + mean) then the new tokens raw; rotated, in k's dtype."""
    rot = [None if r is None else (r[0] if r.shape[0] == 1 else r) for r in (t.k_rotation, t.v_rotation)]
    steps = [(c, i == len(chunks) - 1) for i, c in enumerate(chunks)] + [(1, True)] * decode
    bounds = [sum(n for n, _ in steps[:i]) for i in range(len(steps) + 1)]

    def rotated(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:  # per update, as the cache rotates
        return torch.cat([rotate(x[..., a:e, :], r).to(x.dtype) for a, e in zip(bounds, bounds[1:], strict=False)], -2)

    kr, vr = rotated(k, rot[0]), rotated(v, rot[1])
    g, md, a = meth.group_size, meth.meta_dtype, meth.levels

    def fake(x: torch.Tensor, mean: torch.Tensor | None, clip: float) -> torch.Tensor:
        deq = dequantize_rows(quantize_rows(x, None, mean, clip, g, md, a), torch.float32, a)
        return (deq + (0 if mean is None else mean.float().unsqueeze(-2))).to(x.dtype)

    qk, qv = fake(kr, t.k_mean, t.k_clip), fake(vr, t.v_mean, t.v_clip)
    sink = meth.sink + (max(pads) if meth.sink else 0)
    w, block = meth.recent, meth.demotion_block
    outs, pos, recent = [], 0, 0
    for n, final in steps:
        prior, pos = pos, pos + n
        beyond = max(0, pos - max(prior, sink))  # new tokens past the sink
        if n == 1:
            recent += beyond
            if recent >= w + block:
                recent -= ((recent - w) // block) * block
        else:
            recent = min(w, recent + beyond) if final else 0
        tier = torch.arange(prior)
        quantized = (tier >= sink) & (tier < pos - recent)
        sel = quantized[None, None, :, None]
        ks = torch.where(sel, qk[..., :prior, :], kr[..., :prior, :])
        vs = torch.where(sel, qv[..., :prior, :], vr[..., :prior, :])
        outs.append((torch.cat([ks, kr[..., prior:pos, :]], -2), torch.cat([vs, vr[..., prior:pos, :]], -2)))
    return outs


def run_layer(layer: Any, k: torch.Tensor, v: torch.Tensor, pads: list[int], chunks: list[int], decode: int):
    layer.pads = list(pads)
    if layer.method.sink and pads:
        layer.sink_slots = layer.method.sink + max(pads)
    return feed(layer, k, v, chunks, decode)


def chunked(total: int, chunk: int) -> list[int]:
    return [min(chunk, total - s) for s in range(0, total, chunk)]


def assert_kernels_refuse(method: QuantMethod, match: str, match_auto: str, monkeypatch: Any) -> None:
    """A reference-path-only ``method`` knob: ``--backend triton`` refuses it in one line (hint: the reference
    backend); ``auto`` takes the reference path where the kernels could not run anyway (CPU) and refuses where they
    would (``kernel_unsupported`` patched to say they could, as on a CUDA device)."""
    import pytest

    from oscar_cli.errors import OscarError
    from oscar_cli.quant import int2_layer
    from oscar_cli.quant.int2_layer import Int2Layer

    k = torch.randn(1, 2, 40, 16).bfloat16()
    with pytest.raises(OscarError, match=match) as e:
        Int2Layer(method, LayerTransform(), backend="triton").update(k, k)
    assert e.value.hint == "use --backend reference" and "\n" not in e.value.message
    layer = Int2Layer(method, LayerTransform(), backend="auto")
    layer.update(k, k)
    assert layer.path == "reference"
    monkeypatch.setattr(int2_layer, "kernel_unsupported", lambda *a, **kw: None)
    with pytest.raises(OscarError, match=match_auto):
        Int2Layer(method, LayerTransform(), backend="auto").update(k, k)


def kernel_model_and_method(key_mean_pre: float = 0.0) -> tuple[Any, QuantMethod]:
    """A one-layer fp16 model (head_dim 64, the decode kernel's shape) and an OSCAR method with random rotations;
    ``key_mean_pre > 0``: keys centred by position (``quant.key_mean: rope``) with pre-RoPE means of that scale."""
    from dataclasses import replace

    from helpers.tiny import tiny_causal_lm
    from oscar_cli.quant import oscar_method

    model = tiny_causal_lm(dtype=torch.float16, head_dim=64, layers=1, hidden_size=128)
    g = torch.Generator().manual_seed(8)
    q, _ = torch.linalg.qr(torch.randn(1, 64, 64, generator=g, dtype=torch.float64))
    t = LayerTransform(
        k_rotation=q.float(),
        v_rotation=q.float().flip(-1),
        k_mean=0.1 * torch.randn(1, 64, generator=g),
        v_mean=0.1 * torch.randn(1, 64, generator=g),
        k_clip=0.9,
        v_clip=0.9,
    )
    if not key_mean_pre:
        return model, oscar_method([t], sink=8, recent=16)
    h_kv = int(model.config.num_key_value_heads)
    t = replace(t, k_mean_pre=key_mean_pre * torch.randn(h_kv, 64, generator=g))
    return model, replace(oscar_method([t], sink=8, recent=16), key_mean="rope")


def decode_logits(
    model: Any, meth: QuantMethod, backend: str, device: str, steps: int, caches: list | None = None, pad: int = 0,
    length: int = 60,
) -> torch.Tensor:
    """Logits of a 2-row batch (row 1 left-padded by ``pad``): one prefill of ``length`` tokens through the method's
    cache on ``backend``, then ``steps`` greedy-free decode steps (the prompt's tokens fed again)."""
    from oscar_cli.quant import use_method
    from oscar_cli.quant.generation import decode_step, prefill

    ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(9)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    with use_method(model, meth, backend=backend) as session:
        cache = session.new_cache()
        out = [prefill(model, cache, ids, mask, 4096)]
        for i in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out.append(decode_step(model, cache, ids[:, i], mask))
    if caches is not None:
        caches.append(cache)
    return torch.stack(out, 1)
