"""oscar: accurate and fast 2-bit (INT2) KV caches for long-context LLM serving.

The CLI (``oscar``) is a thin shell over this library; every command has a library function. Run a model on
an artifact (:mod:`oscar_cli.api`; imported on first use, so ``import oscar_cli`` stays fast)::

    import oscar_cli as oscar
    cache = oscar.kv_cache(model, "hf://org/repo@v1")
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from oscar_cli._version import __version__

__all__ = ["__version__", "attach", "detach", "kv_cache"]

if TYPE_CHECKING:
    from oscar_cli.api import attach, detach, kv_cache

_API = ("attach", "detach", "kv_cache")


def __getattr__(name: str) -> Any:
    if name in _API:
        from oscar_cli import api

        return getattr(api, name)
    raise AttributeError(f"module 'oscar_cli' has no attribute {name!r}")
