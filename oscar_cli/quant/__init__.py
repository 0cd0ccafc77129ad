"""oscar's INT2 KV cache for transformers: methods, the tiered cache, the registered attention, generation.

Library entry points::

    from oscar_cli.quant import build_method, use_method, greedy_generate
    with use_method(model, build_method("oscar", model.config, artifact="artifacts/...")) as s:
        cache = s.new_cache()

(``attach(model, method)`` is the same without the ``with``: the model stays modified until ``session.close()``.)
"""

from __future__ import annotations

from oscar_cli.method_registry import METHOD_NAMES, build_method, parse_methods
from oscar_cli.quant.attention import ATTN_NAME, register_attention
from oscar_cli.quant.cache import Int2Cache
from oscar_cli.quant.generation import greedy_generate, left_pad, prefill
from oscar_cli.quant.int2_layer import Int2Layer
from oscar_cli.quant.methods import QuantMethod, oscar_method
from oscar_cli.quant.runtime import MethodSession, attach, use_method
from oscar_cli.transform import LayerTransform

__all__ = [
    "ATTN_NAME",
    "METHOD_NAMES",
    "Int2Cache",
    "Int2Layer",
    "LayerTransform",
    "MethodSession",
    "QuantMethod",
    "attach",
    "build_method",
    "greedy_generate",
    "left_pad",
    "oscar_method",
    "parse_methods",
    "prefill",
    "register_attention",
    "use_method",
]
