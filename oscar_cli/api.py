"""The library entry points: run a transformers model on an oscar KV cache in three lines.

::

    import oscar_cli as oscar
    cache = oscar.kv_cache(model, "hf://org/repo@v1")          # or a local artifact directory
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)

:func:`kv_cache` **modifies the model in place** (:func:`oscar_cli.quant.runtime.attach`): it folds the value
rotation ``R_V`` into ``v_proj``/``o_proj``, sets the registered ``oscar_int2`` attention and a pre-hook that reads
the left padding of a batch. The model keeps serving that method (call :func:`kv_cache` again for each new
generation: a cache holds one batch) until :func:`detach` restores the original weights and attention.
Greedy and sampled ``model.generate`` work, and so do batches of different lengths when they are left-padded
(``tokenizer.padding_side = "left"``) with their ``attention_mask``.
"""

from __future__ import annotations

from typing import Any

from oscar_cli.quant.cache import Int2Cache
from oscar_cli.quant.runtime import MethodSession


def attach(
    model: Any, artifact: str | None = None, *, method: str = "oscar", backend: str = "auto",
    windows: tuple[int, int] | None = None,
) -> MethodSession:
    """Attach a KV method to ``model`` in place and return its session (``session.new_cache()`` per batch).

    Args:
        model: a loaded transformers causal LM (Llama/Qwen-style decoder layers).
        artifact: an OSCAR calibration artifact (local path or ``hf://ORG/NAME@REV``); needed by ``oscar``.
        method: ``oscar``, ``bf16``, ``naive-int2``, ``quarot-int2`` or ``kivi-2``.
        backend: ``auto`` (the Triton kernels on CUDA where they apply, else torch), ``reference`` or ``triton``.
        windows: ``(S0, W)`` BF16 sink/recent override for the per-token INT2 methods.

    A model that already has the same method attached keeps it; another method is detached first.
    Raises ``ArtifactError`` for an artifact made for another model.
    """
    from oscar_cli.method_registry import build_method
    from oscar_cli.quant.runtime import attach as attach_method

    key = (method, artifact, backend, windows)
    current: MethodSession | None = getattr(model, "_oscar_session", None)
    if current is not None:
        if getattr(current, "api_key", None) == key:
            return current
        current.close()
    session = attach_method(model, build_method(method, model.config, artifact, windows), backend=backend)
    session.api_key = key
    return session


def kv_cache(
    model: Any, artifact: str | None = None, *, method: str = "oscar", backend: str = "auto",
    windows: tuple[int, int] | None = None,
) -> Int2Cache:
    """A fresh oscar KV cache for one ``model.generate`` call (attaches the method first, see :func:`attach`).

    Pass it as ``model.generate(..., past_key_values=cache)``.
    """
    return attach(model, artifact, method=method, backend=backend, windows=windows).new_cache()


def detach(model: Any) -> None:
    """Undo :func:`attach`: original ``v_proj``/``o_proj`` weights and attention implementation (no-op if none)."""
    session: MethodSession | None = getattr(model, "_oscar_session", None)
    if session is not None:
        session.close()
