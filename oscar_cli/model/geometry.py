"""Architecture facts of a model config: the fingerprint artifacts match against, and the support check."""

from __future__ import annotations

from typing import Any

from oscar_cli.errors import UnsupportedModelError


def _rope(cfg: Any) -> dict[str, Any]:
    """The full-attention RoPE parameters of a config (v5 ``rope_parameters``, or v4 ``rope_scaling``)."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    if not isinstance(params, dict):
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        if getattr(cfg, "rope_theta", None) is not None:
            params.setdefault("rope_type", params.get("type", "default"))
            params["rope_theta"] = cfg.rope_theta
    return params


def architecture_fingerprint(config: Any) -> dict[str, Any]:
    """What an artifact must match: the attention geometry and positional encoding of a model config.

    Returns:
        ``{"model_type", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_type",
        "rope_theta", "max_position_embeddings"}`` (ints/floats/strings; ``None`` for what the config lacks).
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_heads = int(cfg.num_attention_heads)
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    rope = _rope(cfg)
    theta = rope.get("rope_theta")
    max_pos = getattr(cfg, "max_position_embeddings", None)
    return {
        "model_type": cfg.model_type,
        "num_layers": int(cfg.num_hidden_layers),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv),
        "head_dim": int(head_dim),
        "rope_type": rope.get("rope_type"),
        "rope_theta": float(theta) if theta is not None else None,
        "max_position_embeddings": int(max_pos) if max_pos is not None else None,
    }


def unsupported_reasons(config: Any) -> list[str]:
    """Why oscar's INT2 cache cannot serve this architecture (empty list: supported)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    fp = architecture_fingerprint(cfg)
    reasons = []
    if fp["rope_theta"] is None:
        reasons.append("no rotary position embedding (RoPE)")
    layer_types = set(getattr(cfg, "layer_types", None) or [])
    if layer_types - {"full_attention"}:
        reasons.append(f"non-full-attention layers ({', '.join(sorted(layer_types - {'full_attention'}))})")
    elif getattr(cfg, "use_sliding_window", None) is True or (
        not hasattr(cfg, "use_sliding_window") and not layer_types and getattr(cfg, "sliding_window", None)
    ):
        reasons.append(f"sliding-window attention (window {getattr(cfg, 'sliding_window', None)})")
    if getattr(cfg, "kv_lora_rank", None):
        reasons.append("multi-head latent attention (MLA)")
    if fp["head_dim"] % 4 or fp["num_attention_heads"] % fp["num_key_value_heads"]:
        reasons.append(f"head_dim {fp['head_dim']} not divisible by 4 or query heads not a multiple of KV heads")
    return reasons


def check_supported(config: Any) -> None:
    """Raise :class:`UnsupportedModelError` naming every reason the architecture is out of scope."""
    reasons = unsupported_reasons(config)
    if reasons:
        model_type = getattr(config, "model_type", "?")
        raise UnsupportedModelError(
            f"{model_type} is not supported by oscar: {'; '.join(reasons)}",
            hint="oscar supports decoder-only RoPE models with full attention (Llama, Qwen3, Mistral v0.2+)",
        )
