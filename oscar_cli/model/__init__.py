"""Models: references -> files on this machine -> a loaded transformers model with its identity and geometry.

- :mod:`.resolve` — model references (alias, Hub repo, directory, GGUF) -> :class:`ModelIdentity`
- :mod:`.hub` — Hub snapshot resolution (cache first, offline-aware)
- :mod:`.loaders` — transformers loads, GGUF -> safetensors conversion
- :mod:`.cache` — ``$OSCAR_CACHE_DIR``: sha256 index and converted-GGUF entries
- :mod:`.load` — :func:`load_model` / :func:`load_config`, device and dtype defaults
- :mod:`.geometry` — :class:`ModelGeometry` (heads, head_dim, RoPE, support check) and its fingerprint dict
- :mod:`.report` — ``oscar info``'s report
"""

from oscar_cli.model.geometry import ModelGeometry, architecture_fingerprint, check_supported, unsupported_reasons
from oscar_cli.model.load import (
    LoadedModel,
    load_config,
    load_model,
    model_directory,
    resolve_device,
    resolve_dtype,
)
from oscar_cli.model.resolve import ACCEPTED_FORMS, ALIASES, DEFAULT_MODEL, EMBEDDED_FILE, ModelIdentity, resolve_model

__all__ = [
    "ACCEPTED_FORMS",
    "ALIASES",
    "DEFAULT_MODEL",
    "EMBEDDED_FILE",
    "LoadedModel",
    "ModelGeometry",
    "ModelIdentity",
    "architecture_fingerprint",
    "check_supported",
    "load_config",
    "load_model",
    "model_directory",
    "resolve_device",
    "resolve_dtype",
    "resolve_model",
    "unsupported_reasons",
]
