"""Load a resolved model for inference: device and dtype defaults, GGUF through the conversion cache, config-only reads."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from oscar_cli.errors import MissingDependencyError, OscarError, UnsupportedModelError
from oscar_cli.model import cache as model_cache
from oscar_cli.model.geometry import ModelGeometry
from oscar_cli.model.loaders import convert_gguf, gguf_read_once, hf_progress, load_directory, load_gguf_direct
from oscar_cli.model.resolve import DEFAULT_MODEL, ModelIdentity, resolve_model

logger = logging.getLogger(__name__)

# GGUF files above this size are loaded straight from the GGUF every time instead of being converted into a
# float32 safetensors copy (which would be ~8x the size of a 4-bit GGUF).
CONVERT_MAX_BYTES = 4 << 30

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class LoadedModel:
    """A model ready for inference (``eval()`` mode) with its tokenizer and identity.

    Attributes:
        model: a transformers ``*ForCausalLM`` on ``device`` in ``dtype``.
        tokenizer: the matching tokenizer.
        identity: see :class:`ModelIdentity`.
        device, dtype: where and how the weights live.
        load_seconds: wall time of :func:`load_model` (resolution, conversion if any, load).
        source: what was read: ``directory`` (hub/dir), ``cache`` (converted entry), ``converted`` (built
            now, then read), ``gguf`` (large GGUF read directly).
    """

    model: Any
    tokenizer: Any
    identity: ModelIdentity
    device: torch.device
    dtype: torch.dtype
    load_seconds: float = 0.0
    source: str = ""

    @cached_property
    def geometry(self) -> ModelGeometry:
        """:class:`ModelGeometry` of ``model.config`` (read once, on first use)."""
        return ModelGeometry.from_config(self.model.config)


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """``None`` -> ``cuda`` when available, else ``cpu``; a CUDA device that is not there is an error."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise OscarError(f"unknown device {device!r}", hint="use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise OscarError(f"device {device} requested but CUDA is not available here", hint="use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise OscarError(f"device {device} requested but only {torch.cuda.device_count()} GPU(s) are visible")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` -> float32 on CPU, bfloat16 on CUDA; accepts float32/fp32, bfloat16/bf16, float16/fp16."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise OscarError(f"unsupported model dtype {dtype}", hint="use float32, bfloat16 or float16")
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise OscarError(f"unknown dtype {dtype!r}", hint="use float32, bfloat16 or float16") from None


def _load_gguf(identity: ModelIdentity, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any, str]:
    """GGUF -> (model, tokenizer, source), through the conversion cache unless the file is very large."""
    gguf = identity.path
    if gguf.stat().st_size > CONVERT_MAX_BYTES:
        logger.info("%s is larger than %d GiB: loading it from the GGUF directly", gguf, CONVERT_MAX_BYTES >> 30)
        model, tok = load_gguf_direct(gguf, device, dtype)
        return model, tok, "gguf"
    sha = identity.resolved.removeprefix("sha256:")
    info = {"source": str(gguf), "reference": identity.reference}
    for attempt in (1, 2):
        entry, built = model_cache.ensure_entry(sha, lambda out: convert_gguf(gguf, out), info)
        if built:
            logger.info("converted %s once into %s; later loads read that copy", gguf.name, entry)
        try:
            model, tok = load_directory(entry, device, dtype)
            return model, tok, "converted" if built else "cache"
        except MissingDependencyError:
            raise
        except Exception as exc:  # a cache entry that passes its hashes yet does not load: rebuild once
            if attempt == 2:
                raise
            logger.warning("could not load the conversion cache %s (%s): rebuilding it", entry, exc)
            model_cache.remove_entry(entry)
    raise AssertionError("unreachable")


def model_directory(ref: str = DEFAULT_MODEL, *, revision: str | None = None) -> Path:
    """A transformers model directory for ``ref``, for engines that read one (vLLM): a directory or Hub snapshot as
    it is; a GGUF or an alias its conversion-cache entry (float32 safetensors + config + tokenizer), converted on
    first use. GGUFs too large for the conversion cache are refused (load them with :func:`load_model`)."""
    identity = resolve_model(ref, revision)
    if identity.kind not in ("alias", "gguf"):
        return identity.path
    if identity.path.stat().st_size > CONVERT_MAX_BYTES:
        raise OscarError(f"{identity.path.name} is larger than {CONVERT_MAX_BYTES >> 30} GiB: oscar does not keep a "
                         "converted copy of it", hint="convert it to a transformers directory yourself")
    gguf = identity.path
    info = {"source": str(gguf), "reference": identity.reference}
    with hf_progress():
        entry, _ = model_cache.ensure_entry(identity.resolved.removeprefix("sha256:"),
                                            lambda out: convert_gguf(gguf, out), info)
    return entry


def load_model(
    ref: str = DEFAULT_MODEL,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    revision: str | None = None,
) -> LoadedModel:
    """Resolve ``ref`` and load it for inference (``eval()``, no gradients needed).

    Args:
        ref: a model reference (module docstring); default: the embedded ``smollm2-135m``.
        device: ``cpu``, ``cuda``, ``cuda:N`` or None (CUDA when available).
        dtype: float32/bfloat16/float16 or None (float32 on CPU, bfloat16 on CUDA).
        revision: Hub revision for Hub references.

    Returns:
        :class:`LoadedModel`.

    Raises:
        OscarError subclasses for every user-fixable failure (see :func:`resolve_model`), and
        ``UnsupportedModelError`` when transformers cannot build the architecture.
    """
    t0 = time.perf_counter()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    identity = resolve_model(ref, revision)
    with hf_progress():
        if identity.kind in ("alias", "gguf"):
            model, tokenizer, source = _load_gguf(identity, dev, dt)
        else:
            model, tokenizer = load_directory(identity.path, dev, dt)
            source = "directory"
    model.eval()
    seconds = time.perf_counter() - t0
    logger.info("loaded %s (%s) on %s as %s in %.1f s", identity.reference, identity.resolved, dev, dt, seconds)
    return LoadedModel(model, tokenizer, identity, dev, dt, seconds, source)


def load_config(ref: str = DEFAULT_MODEL, *, revision: str | None = None) -> tuple[ModelIdentity, Any]:
    """Resolve ``ref`` and read only its transformers config (no weights): ``(identity, config)``.

    For a GGUF, the converted cache entry's ``config.json`` is used when present (no hashing of the weights),
    else the GGUF's metadata is parsed (~1 s of CPU for the embedded model).
    """
    from transformers import AutoConfig

    identity = resolve_model(ref, revision, weights=False)
    try:
        if identity.kind in ("alias", "gguf"):
            entry = model_cache.converted_path(identity.resolved.removeprefix("sha256:"))
            if (entry / model_cache.META_NAME).is_file() and (entry / "config.json").is_file():
                return identity, AutoConfig.from_pretrained(entry)
            with gguf_read_once():
                return identity, AutoConfig.from_pretrained(identity.path.parent, gguf_file=identity.path.name)
        return identity, AutoConfig.from_pretrained(identity.path)
    except (ValueError, KeyError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsupportedModelError(f"cannot read the config of {identity.reference}: {first}") from exc
