"""oscar: accurate and fast 2-bit (INT2) KV caches for long-context LLM serving.

The CLI (``oscar``) is a thin shell over this library; every command has a library function.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
