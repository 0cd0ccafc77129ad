"""Attach a :class:`~oscar_cli.quant.methods.QuantMethod` to a loaded transformers model, and take it off.

``with use_method(model, method) as session:`` does, for every decoder layer:

- **fold** ``R_V`` into the weights (exact per-head block fold, computed in float32, cast back to the weight
  dtype): ``v_proj`` rows of KV head ``h``: ``W_v[h] <- R_V[h]ᵀ·W_v[h]`` (bias ``b_v[h] <- b_v[h]·R_V[h]``),
  so ``v_proj`` emits ``v·R_V``; ``o_proj`` columns of query head ``j``: ``W_o[:, j] <- W_o[:, j]·R_V[j//g]``,
  so ``o_proj`` consumes the rotated output, i.e. ``o·R_Vᵀ`` happens inside ``o_proj``. With
  ``fold_values=False`` both run at run time instead (the cache rotates v, the attention function rotates
  the output back);
- set ``module._oscar_runtime`` with ``R_K`` per query head: ``q·R_K`` runs at **run time** in the
  attention function (RoPE sits between ``k_proj`` and the rotation, so ``R_K`` cannot be folded; keys are
  rotated at run time by the cache);
- switch the model to the registered ``oscar_int2`` attention.

On exit the original weights (kept as copies of ``v_proj``/``o_proj``) and attention implementation are
restored, so one loaded model serves every method in turn.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from oscar_cli.quant.attention import LayerRuntime, register_attention
from oscar_cli.quant.cache import Int2Cache
from oscar_cli.quant.methods import QuantMethod


@dataclass
class MethodSession:
    """A model with a method attached: makes caches that match the attached transforms."""

    model: Any
    method: QuantMethod
    rotate_values: bool
    backend: str = "reference"
    active: Int2Cache | None = None

    def new_cache(self) -> Int2Cache:
        """A fresh, empty cache for one batch (also the one the Triton decode path reads)."""
        n_layers = self.model.config.num_hidden_layers
        self.active = Int2Cache(self.method, n_layers, rotate_values=self.rotate_values, backend=self.backend)
        return self.active


def decoder_attention_modules(model: Any) -> list[Any]:
    """The self-attention module of every decoder layer (``model.model.layers[i].self_attn``)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: no decoder layers found at model.model.layers")
    return [layer.self_attn for layer in layers]


def _per_head(r: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``[N, D, D]`` -> ``[n_heads, D, D]`` (``N = 1`` broadcast, or ``N`` KV heads repeated ``g`` times)."""
    if r.shape[0] == n_heads:
        return r
    if n_heads % r.shape[0]:
        raise ValueError(f"rotation has {r.shape[0]} heads, cannot map onto {n_heads}")
    return r.repeat_interleave(n_heads // r.shape[0], dim=0)


def _fold_values(attn: Any, r_v: torch.Tensor, n_kv: int, n_q: int, d: int) -> None:
    """Fold ``R_V`` into ``v_proj`` (rows per KV head) and ``R_Vᵀ`` into ``o_proj`` (columns per query head)."""
    rk = _per_head(r_v.float(), n_kv).to(attn.v_proj.weight.device)  # [H_kv, D, D]
    w = attn.v_proj.weight.data
    wv = w.float().reshape(n_kv, d, -1)
    w.copy_(torch.einsum("hde,hdi->hei", rk, wv).reshape(w.shape).to(w.dtype))  # R_Vᵀ · W_v per head
    if attn.v_proj.bias is not None:
        b = attn.v_proj.bias.data
        b.copy_(torch.einsum("hd,hde->he", b.float().reshape(n_kv, d), rk).reshape(b.shape).to(b.dtype))
    rq = _per_head(r_v.float(), n_q).to(attn.o_proj.weight.device)  # [H_q, D, D]
    wo = attn.o_proj.weight.data
    wo3 = wo.float().reshape(wo.shape[0], n_q, d)
    wo.copy_(torch.einsum("ojd,jde->oje", wo3, rq).reshape(wo.shape).to(wo.dtype))  # W_o[:, j] · R_V


def _set_attn(model: Any, name: str) -> None:
    try:
        model.set_attn_implementation(name)
    except Exception:  # older transformers: the config switch is what the modules read
        model.config._attn_implementation = name


@contextmanager
def use_method(
    model: Any, method: QuantMethod, *, fold_values: bool = True, backend: str = "reference"
) -> Iterator[MethodSession]:
    """Attach ``method`` to ``model`` for the duration of the block (see the module docstring).

    ``backend="triton"`` routes decode steps of INT2 layers through ``oscar_kernels.ops`` where it applies
    (:func:`oscar_cli.quant.attention.kernel_decode`); everything else stays on the torch reference path.
    """
    if backend not in ("reference", "triton"):
        raise ValueError(f"backend: expected 'reference' or 'triton', got {backend!r}")
    session = MethodSession(model, method, rotate_values=not fold_values, backend=backend)
    name = register_attention()
    cfg = model.config
    n_q, n_kv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    attns = decoder_attention_modules(model)
    saved: list[tuple[Any, torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
    previous = getattr(cfg, "_attn_implementation", None) or "sdpa"
    try:
        for i, attn in enumerate(attns):
            t = method.layer(i)
            d = int(attn.head_dim)
            q_rot = None if t.k_rotation is None else _per_head(t.k_rotation.float(), n_q)
            out_rot = None
            if t.v_rotation is not None:
                if fold_values:
                    bias = attn.v_proj.bias
                    saved.append(
                        (
                            attn,
                            attn.v_proj.weight.data.clone(),
                            None if bias is None else bias.data.clone(),
                            attn.o_proj.weight.data.clone(),
                        )
                    )
                    _fold_values(attn, t.v_rotation, n_kv, n_q, d)
                else:
                    out_rot = _per_head(t.v_rotation.float(), n_q).transpose(-1, -2).contiguous()
            dev = attn.o_proj.weight.device
            attn._oscar_runtime = LayerRuntime(
                q_rotation=None if q_rot is None else q_rot.to(dev),
                out_rotation=None if out_rot is None else out_rot.to(dev),
                backend=backend,
                session=session,
            )
        _set_attn(model, name)
        yield session
    finally:
        for attn, wv, bv, wo in saved:
            attn.v_proj.weight.data.copy_(wv)
            if bv is not None:
                attn.v_proj.bias.data.copy_(bv)
            attn.o_proj.weight.data.copy_(wo)
        for attn in attns:
            if hasattr(attn, "_oscar_runtime"):
                del attn._oscar_runtime
        _set_attn(model, previous)
