"""Attach a :class:`~oscar_cli.quant.methods.QuantMethod` to a loaded transformers model, and take it off.

``session = attach(model, method)`` (or ``with use_method(model, method) as session:``) does, for every decoder
layer, **in place**:

- **fold** ``R_V`` into the weights (exact per-head block fold, computed in float32, cast back to the weight
  dtype): ``v_proj`` rows of KV head ``h``: ``W_v[h] <- R_V[h]ᵀ·W_v[h]`` (bias ``b_v[h] <- b_v[h]·R_V[h]``),
  so ``v_proj`` emits ``v·R_V``; ``o_proj`` columns of query head ``j``: ``W_o[:, j] <- W_o[:, j]·R_V[j//g]``,
  so ``o_proj`` consumes the rotated output, i.e. ``o·R_Vᵀ`` happens inside ``o_proj``. With
  ``fold_values=False`` both run at run time instead (the cache rotates v, the attention function rotates
  the output back);
- set ``module._oscar_runtime`` with ``R_K`` (``[N, D, D]``, mapped onto the query heads per call): ``q·R_K``
  runs at **run time** in the attention function (RoPE sits between ``k_proj`` and the rotation, so ``R_K`` cannot be folded; keys are
  rotated at run time by the cache);
- switch the model to the registered ``oscar_int2`` attention;
- add a forward pre-hook that reads a batch's left padding off the attention mask when ``model.generate``
  starts on a fresh cache (so the BF16 sink covers it, as with :func:`oscar_cli.quant.generation.prefill`).

``session.close()`` (the end of the ``with`` block) restores the original weights (copies of ``v_proj``/``o_proj``
kept in host memory, so attaching takes no accelerator memory for them), removes the hook and the transforms and restores the attention implementation, so one
loaded model serves every method in turn.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from oscar_cli.errors import OscarError
from oscar_cli.quant.attention import LayerRuntime, per_head, register_attention
from oscar_cli.quant.cache import Int2Cache
from oscar_cli.quant.kernel_path import BACKENDS
from oscar_cli.quant.key_mean import RopeTable
from oscar_cli.quant.methods import QuantMethod
from oscar_cli.quant.pages import DEFAULT_PAGE


@dataclass
class MethodSession:
    """A model with a method attached: makes caches that match the attached transforms; :meth:`close` detaches."""

    model: Any
    method: QuantMethod
    rotate_values: bool
    backend: str = "auto"
    page_size: int = DEFAULT_PAGE
    active: Int2Cache | None = None
    api_key: Any = None  # what :func:`oscar_cli.api.attach` attached (it reuses a session with the same key)
    _restore: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def new_cache(self) -> Int2Cache:
        """A fresh, empty cache for one batch (prefill + decode; ``model.generate(past_key_values=...)``)."""
        cfg = self.model.config
        self.active = Int2Cache(
            self.method,
            int(cfg.num_hidden_layers),
            rotate_values=self.rotate_values,
            backend=self.backend,
            page_size=self.page_size,
            max_positions=int(getattr(cfg, "max_position_embeddings", 0) or 0) or None,
            rope_table=RopeTable(self.model) if self.method.key_mean == "rope" else None,
        )
        return self.active

    @property
    def attached(self) -> bool:
        return getattr(self.model, "_oscar_session", None) is self

    def close(self) -> None:
        """Restore the model: unfold ``R_V`` (original weights), drop the run-time transforms, the padding hook
        and the attention implementation. Idempotent."""
        while self._restore:
            self._restore.pop()()


def decoder_attention_modules(model: Any) -> list[Any]:
    """The self-attention module of every decoder layer (``model.model.layers[i].self_attn``)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: no decoder layers found at model.model.layers")
    return [layer.self_attn for layer in layers]


def _fold_values(attn: Any, r_v: torch.Tensor, n_kv: int, n_q: int, d: int) -> None:
    """Fold ``R_V`` into ``v_proj`` (rows per KV head) and ``R_Vᵀ`` into ``o_proj`` (columns per query head)."""
    rk = per_head(r_v.float(), n_kv).to(attn.v_proj.weight.device)  # [H_kv, D, D]
    w = attn.v_proj.weight.data
    wv = w.float().reshape(n_kv, d, -1)
    w.copy_(torch.einsum("hde,hdi->hei", rk, wv).reshape(w.shape).to(w.dtype))  # R_Vᵀ · W_v per head
    if attn.v_proj.bias is not None:
        b = attn.v_proj.bias.data
        b.copy_(torch.einsum("hd,hde->he", b.float().reshape(n_kv, d), rk).reshape(b.shape).to(b.dtype))
    rq = per_head(r_v.float(), n_q).to(attn.o_proj.weight.device)  # [H_q, D, D]
    wo = attn.o_proj.weight.data
    wo3 = wo.float().reshape(wo.shape[0], n_q, d)
    wo.copy_(torch.einsum("ojd,jde->oje", wo3, rq).reshape(wo.shape).to(wo.dtype))  # W_o[:, j] · R_V


def _set_attn(model: Any, name: str) -> None:
    try:
        model.set_attn_implementation(name)
    except Exception:  # older transformers: the config switch is what the modules read
        model.config._attn_implementation = name


def _padding_hook(module: Any, args: tuple, kwargs: dict) -> None:
    """Before a forward on a fresh :class:`Int2Cache` that nobody gave padding (``model.generate``): read the left
    padding off the 2-D attention mask (the BF16 sink then covers it, exactly as in :func:`prefill`)."""
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    mask = kwargs.get("attention_mask")
    if not isinstance(cache, Int2Cache) or cache.padding_set or cache.get_seq_length() or mask is None:
        return
    if mask.dim() != 2:
        return
    pads = (mask.shape[1] - mask.long().sum(-1)).tolist()
    left = torch.arange(mask.shape[1], device=mask.device)[None, :] >= torch.tensor(pads, device=mask.device)[:, None]
    if not torch.equal(mask.bool(), left):
        raise OscarError(
            "the oscar cache needs left-padded batches (the attention mask has padding on the right)",
            hint="set tokenizer.padding_side = 'left'",
        )
    cache.set_padding(pads if any(pads) else None)


def attach(model: Any, method: QuantMethod, *, fold_values: bool = True, backend: str = "auto") -> MethodSession:
    """Attach ``method`` to ``model`` **in place** until :meth:`MethodSession.close` (see the module docstring).

    ``backend``: ``reference`` (torch), ``triton`` (INT2 writes and decode steps through ``oscar_kernels.ops``;
    an error where the kernels cannot run) or ``auto`` (triton on CUDA where they apply, else reference).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    other = getattr(model, "_oscar_session", None)
    if other is not None:
        raise OscarError(
            f"the model already has method {other.method.name} attached", hint="close that session first"
        )
    attns = decoder_attention_modules(model)
    method = _on_layer_devices(method, attns, fold_values)
    session = MethodSession(model, method, rotate_values=not fold_values, backend=backend)
    name = register_attention()
    cfg = model.config
    n_q, n_kv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    previous = getattr(cfg, "_attn_implementation", None) or "sdpa"
    undo = session._restore
    model._oscar_session = session
    undo.append(lambda: delattr(model, "_oscar_session"))
    try:
        for i, attn in enumerate(attns):
            t = method.layer(i)
            d = int(attn.head_dim)
            q_rot = None if t.k_rotation is None else t.k_rotation.float()
            out_rot = None
            if t.v_rotation is not None:
                if fold_values:
                    undo.append(_weights_restorer(attn))
                    _fold_values(attn, t.v_rotation, n_kv, n_q, d)
                else:
                    out_rot = t.v_rotation.float().transpose(-1, -2).contiguous()
            dev = attn.o_proj.weight.device
            attn._oscar_runtime = LayerRuntime(
                q_rotation=None if q_rot is None else q_rot.to(dev),
                out_rotation=None if out_rot is None else out_rot.to(dev),
                session=session,
            )
            undo.append(partial(delattr, attn, "_oscar_runtime"))
        hook = model.register_forward_pre_hook(_padding_hook, with_kwargs=True)
        undo.append(hook.remove)
        _set_attn(model, name)
        undo.append(lambda: _set_attn(model, previous))
    except BaseException:
        session.close()
        raise
    return session


def _on_layer_devices(method: QuantMethod, attns: list[Any], fold_values: bool) -> QuantMethod:
    """``method`` with each layer's run-time transform tensors on that layer's device, so the attention runtime
    and every cache the session makes share one copy of them (a tensor already there is not copied). A folded
    ``R_V`` is used only while folding and stays where it is."""
    if not method.layers:
        return method
    fields = ("k_rotation", "k_mean", "v_mean", "k_mean_pre") + (() if fold_values else ("v_rotation",))
    layers = list(method.layers)
    for i, attn in enumerate(attns[: len(layers)]):
        t, dev = layers[i], attn.o_proj.weight.device
        moved = {f: getattr(t, f).to(dev) for f in fields if isinstance(getattr(t, f), torch.Tensor)}
        layers[i] = replace(t, **moved)
    return replace(method, layers=tuple(layers))


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _weights_restorer(attn: Any) -> Callable[[], None]:
    """Copies of ``v_proj``/``o_proj`` weights in host memory and a function that puts them back."""
    wv = _host_copy(attn.v_proj.weight.data)
    bias = attn.v_proj.bias
    bv = None if bias is None else _host_copy(bias.data)
    wo = _host_copy(attn.o_proj.weight.data)

    def restore() -> None:
        attn.v_proj.weight.data.copy_(wv)
        if bv is not None:
            attn.v_proj.bias.data.copy_(bv)
        attn.o_proj.weight.data.copy_(wo)

    return restore


@contextmanager
def use_method(
    model: Any, method: QuantMethod, *, fold_values: bool = True, backend: str = "auto"
) -> Iterator[MethodSession]:
    """:func:`attach` for the duration of the block; the model is restored on exit."""
    session = attach(model, method, fold_values=fold_values, backend=backend)
    try:
        yield session
    finally:
        session.close()
