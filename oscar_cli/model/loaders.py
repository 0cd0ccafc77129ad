"""transformers calls behind :func:`oscar_cli.model.load_model`: directory loads and GGUF conversion.

Failures a user can cause (missing ``gguf``/``accelerate``, an architecture transformers cannot build, a
directory without weights) become one-line :class:`~oscar_cli.errors.OscarError` subclasses.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from oscar_cli._output import progress_enabled
from oscar_cli.errors import MissingDependencyError, ModelResolutionError, UnsupportedModelError

logger = logging.getLogger(__name__)


@contextmanager
def hf_progress() -> Iterator[None]:
    """Let transformers / huggingface_hub draw their progress bars only when oscar would (TTY, no --json)."""
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as tf_logging

    tf_was = tf_logging.is_progress_bar_enabled()
    hub_was = not hub_utils.are_progress_bars_disabled()
    if not progress_enabled():
        tf_logging.disable_progress_bar()
        hub_utils.disable_progress_bars()
    try:
        yield
    finally:
        if tf_was:
            tf_logging.enable_progress_bar()
        if hub_was:
            hub_utils.enable_progress_bars()


@contextmanager
def _gguf_progress() -> Iterator[None]:
    """transformers' GGUF reader uses a bare ``tqdm`` that ignores the switch above: silence it through its
    module attribute for the duration (restored after) when oscar draws no progress bars."""
    try:
        gguf_mod: Any = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except ImportError:  # no GGUF support in this transformers: nothing to silence
        gguf_mod = None
    original = getattr(gguf_mod, "tqdm", None)
    if original is not None and not progress_enabled():
        gguf_mod.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        if original is not None:
            gguf_mod.tqdm = original


@contextmanager
def gguf_read_once() -> Iterator[None]:
    """Within the context, transformers' legacy GGUF path (every architecture its new reader does not cover,
    llama among them) parses a GGUF once instead of three times, and builds gguf-py's tensor-name map once
    instead of once per module.

    ``AutoModelForCausalLM.from_pretrained`` reads the file for the config and again for the weights, and
    ``AutoTokenizer.from_pretrained`` a third time for the config; each is a full ``gguf.GGUFReader`` walk
    that slices every vocabulary and merge string out of a memmap (~3 s CPU each for the embedded model;
    transformers 5.17 reads it a fourth time for the tokenizer). ``get_gguf_hf_weights_map`` recurses into every module of the model and calls
    ``gguf.get_tensor_name_map(arch, n_layers)`` at each (397 times for the embedded model, ~5 s CPU). Both are
    functions of their arguments only (a reader opened read-only is only read from; the map only looked up),
    so handing back the first result changes nothing that is loaded: the converted files are byte-identical
    (tests/test_models.py). transformers imports both names from ``gguf`` at call time, which is where they
    are swapped for the duration (restored after).

    The one reader left is also made cheaper: gguf-py slices the file as an ``np.memmap``, whose Python-level
    ``__getitem__`` / ``__array_finalize__`` run for each of the ~10^6 slices of the metadata walk. The
    reader made here keeps a plain ``ndarray`` view of the same read-only map (no copy, pages still read on
    demand), so every slice is a plain array: 3.0 -> 1.0 s CPU for the embedded model, same bytes.

    Re-entering it (a nested use) shares the outer one's readers. Not meant for several threads loading at once:
    the swap is of module attributes.
    """
    try:
        gguf_mod: Any = importlib.import_module("gguf")
    except ImportError:  # _require reports it
        yield
        return
    if getattr(gguf_mod.GGUFReader, "oscar_read_once", False):  # already inside one
        yield
        return
    import numpy as np

    reader_cls, name_map = gguf_mod.GGUFReader, gguf_mod.get_tensor_name_map

    def plain_data(self: Any, value: Any) -> None:  # GGUFReader.__init__ sets self.data = np.memmap(...)
        self.plain_data = np.asarray(value)  # a base-class view of the same map: no copy, still read-only

    plain_reader = type("PlainViewGGUFReader", (reader_cls,),
                        {"data": property(lambda self: self.plain_data, plain_data)})
    readers: dict[str, Any] = {}

    def read_once(path: Any, mode: str = "r") -> Any:
        if mode != "r":  # a writable map is not shared
            return reader_cls(path, mode)
        key = os.path.realpath(os.fspath(path))
        if key not in readers:
            readers[key] = plain_reader(path, mode)
        return readers[key]

    read_once.oscar_read_once = True  # type: ignore[attr-defined]
    gguf_mod.GGUFReader = read_once
    gguf_mod.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf_mod.GGUFReader, gguf_mod.get_tensor_name_map = reader_cls, name_map


def _first_line(exc: BaseException, limit: int = 240) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _require(module: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise MissingDependencyError(f"{why} needs the {module} package", hint=f"Run: pip install {module}")


def load_directory(path: Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """Load ``AutoModelForCausalLM`` + ``AutoTokenizer`` from a local directory onto ``device`` in ``dtype``.

    Never runs remote code. CUDA loads go straight to the GPU (``device_map``), CPU loads stay on the host.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"dtype": dtype}
    if device.type == "cuda":
        _require("accelerate", "loading onto a GPU")
        kwargs["device_map"] = str(device)
    try:
        model: Any = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except ValueError as exc:  # unknown model_type / config class, remote code required
        raise UnsupportedModelError(f"transformers cannot build the model in {path}: {_first_line(exc)}") from exc
    except OSError as exc:  # missing weights or tokenizer files
        raise ModelResolutionError(f"cannot load a model from {path}: {_first_line(exc)}") from exc
    if device.type != "cuda":
        model = model.to(device)
    return model, tokenizer


def _read_gguf(gguf: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """transformers' GGUF path: dequantize every tensor into a dense model (the slow part: ~5 s CPU for
    135M with :func:`gguf_read_once`, ~22 s without)."""
    _require("gguf", "reading GGUF files")
    _require("accelerate", "reading GGUF files")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _gguf_progress(), gguf_read_once():
            model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise UnsupportedModelError(f"transformers cannot read {gguf.name}: {_first_line(exc)}") from exc
    return model, tokenizer


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF once and write float32 safetensors, config and tokenizer files into ``out``.

    The dequantized weights are the GGUF's values exactly (float32 holds every ``scale * q + min``), so a
    model loaded from ``out`` equals one loaded from the GGUF. transformers refuses to save a GGUF-loaded
    model while it carries its GGUF quantizer; the weights are already dense, so it is dropped first.
    """
    logger.info("converting %s to safetensors (first use only)", gguf.name)
    model, tokenizer = _read_gguf(gguf, torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def load_gguf_direct(gguf: Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """Load a GGUF without the conversion cache (for GGUFs too large to keep a dense copy of)."""
    model, tokenizer = _read_gguf(gguf, dtype)
    moved: Any = model.to(device)
    return moved, tokenizer
