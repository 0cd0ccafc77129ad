"""Architecture facts of a model, read once from its config: :class:`ModelGeometry`.

It holds what the pipeline needs (layers, heads, head_dim, RoPE, positions) and why oscar's INT2 cache
cannot serve the model, if it cannot. :func:`architecture_fingerprint` is its dict form, which artifacts
store and match against.

Example::

    geo = ModelGeometry.from_config(model.config)   # or LoadedModel.geometry
    geo.head_dim, geo.num_key_value_heads, geo.group_ratio
    geo.check()                                     # UnsupportedModelError naming every reason
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oscar_cli.errors import UnsupportedModelError

SUPPORTED_HINT = "oscar supports decoder-only RoPE models with full attention (Llama, Qwen3, Mistral v0.2+)"


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


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _unsupported(cfg: Any, theta: Any, n_heads: int, n_kv: int, head_dim: int) -> tuple[str, ...]:
    reasons = []
    if theta is None:
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
    if head_dim % 4 or n_heads % n_kv:
        reasons.append(f"head_dim {head_dim} not divisible by 4 or query heads not a multiple of KV heads")
    return tuple(reasons)


@dataclass(frozen=True)
class ModelGeometry:
    """The attention geometry and positional encoding of one model (from its text config).

    Attributes:
        model_type: transformers ``model_type`` (``llama``, ``qwen2``, ...).
        num_layers, num_attention_heads, num_key_value_heads, head_dim: attention shape.
        rope_type, rope_theta: RoPE variant and base (None: the config has no RoPE).
        rope_scaling: the other RoPE parameters (``factor``, ...), as sorted ``(key, value)`` pairs.
        max_position_embeddings: native context (None when the config lacks it).
        unsupported_reasons: why oscar's INT2 cache cannot serve the model (empty: supported).
    """

    model_type: str
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_type: str | None
    rope_theta: float | None
    rope_scaling: tuple[tuple[str, Any], ...]
    max_position_embeddings: int | None
    unsupported_reasons: tuple[str, ...]

    @classmethod
    def from_config(cls, config: Any) -> ModelGeometry:
        """Read a transformers config (multimodal configs: their text config)."""
        cfg = _text_config(config)
        n_heads = int(cfg.num_attention_heads)
        n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
        rope = _rope(cfg)
        theta = rope.get("rope_theta")
        max_pos = getattr(cfg, "max_position_embeddings", None)
        rest = tuple(sorted((k, v) for k, v in rope.items() if k not in ("rope_type", "type", "rope_theta")))
        return cls(
            model_type=str(cfg.model_type),
            num_layers=int(cfg.num_hidden_layers),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            rope_type=rope.get("rope_type"),
            rope_theta=float(theta) if theta is not None else None,
            rope_scaling=rest,
            max_position_embeddings=int(max_pos) if max_pos is not None else None,
            unsupported_reasons=_unsupported(cfg, theta, n_heads, n_kv, head_dim),
        )

    @classmethod
    def of(cls, config_or_geometry: Any) -> ModelGeometry:
        """``config_or_geometry`` itself when it is a geometry, else :meth:`from_config`."""
        if isinstance(config_or_geometry, ModelGeometry):
            return config_or_geometry
        return cls.from_config(config_or_geometry)

    @property
    def group_ratio(self) -> int:
        """Query heads per KV head (``g`` of grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def supported(self) -> bool:
        return not self.unsupported_reasons

    def check(self) -> None:
        """Raise :class:`UnsupportedModelError` naming every reason the architecture is out of scope."""
        if self.unsupported_reasons:
            raise UnsupportedModelError(
                f"{self.model_type} is not supported by oscar: {'; '.join(self.unsupported_reasons)}",
                hint=SUPPORTED_HINT,
            )

    def fingerprint(self) -> dict[str, Any]:
        """What an artifact must match (the manifest's ``architecture``): see :func:`architecture_fingerprint`."""
        return {
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_type": self.rope_type,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
        }


def architecture_fingerprint(config: Any) -> dict[str, Any]:
    """What an artifact must match: the attention geometry and positional encoding of a model config.

    Returns:
        ``{"model_type", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_type",
        "rope_theta", "max_position_embeddings"}`` (ints/floats/strings; ``None`` for what the config lacks).
    """
    return ModelGeometry.of(config).fingerprint()


def unsupported_reasons(config: Any) -> list[str]:
    """Why oscar's INT2 cache cannot serve this architecture (empty list: supported)."""
    return list(ModelGeometry.of(config).unsupported_reasons)


def check_supported(config: Any) -> None:
    """Raise :class:`UnsupportedModelError` naming every reason the architecture is out of scope."""
    ModelGeometry.of(config).check()
