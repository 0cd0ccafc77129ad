"""The artifact manifest (``manifest.json``): what an artifact is, for which model, made how (format v1).

The manifest is plain JSON. :class:`Manifest` parses and validates it (:meth:`Manifest.from_dict` raises
:class:`~oscar_cli.errors.ArtifactError` / :class:`~oscar_cli.errors.ArtifactVersionError` with the field
name); :meth:`Manifest.to_dict` writes it back. See docs/DESIGN.md "Artifact format v1".
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from oscar_cli.errors import ArtifactError, ArtifactVersionError

FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = (1,)
MANIFEST_NAME = "manifest.json"
TENSORS_NAME = "rotations.safetensors"
RECIPE_NAME = "recipe.yaml"
README_NAME = "README.md"
# Files whose sha256 the manifest records. README.md (the model card) is deliberately not hashed: it is
# documentation that `oscar export` re-renders when publishing.
HASHED_FILES = (TENSORS_NAME, RECIPE_NAME)

# Fields of the architecture fingerprint that must match the model an artifact is applied to.
ARCHITECTURE_KEYS = (
    "model_type",
    "num_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_type",
    "rope_theta",
)


def utc_now() -> str:
    """ISO-8601 UTC timestamp with seconds, e.g. ``2026-11-30T01:02:03Z``."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Manifest:
    """Validated content of ``manifest.json``.

    Attributes:
        format_version: integer, bumped on any breaking change (this oscar reads 1).
        oscar_version: version of oscar that wrote the artifact.
        model: ``{"reference": <what the user typed>, "resolved": "repo@sha" | "sha256:<hex>"}``.
        architecture: fingerprint (``oscar_cli.model.architecture_fingerprint``): model_type, num_layers,
            num_attention_heads, num_key_value_heads, head_dim, rope_type, rope_theta, max_position_embeddings.
        method: ``oscar`` | ``hadamard`` | ``identity``.
        grouping: ``layer`` (rotations ``[1, D, D]``) or ``head`` (``[H_kv, D, D]``).
        recipe: the fully resolved recipe (nested dict).
        quant: INT2 layout the clips were chosen for: group_size, meta_dtype, sink, recent.
        data: calibration data identity: source, sha256 (of the token ids), tokens, sequences, ...
        seed: RNG seed.
        files: file name → sha256 hex of every file in the artifact except the manifest.
        created: UTC timestamp.
        calibration: per-layer clip choices with objective values, eigenvalue spreads, timings.
        evaluation: optional results added later (``oscar export``/eval).
    """

    oscar_version: str
    model: dict[str, Any]
    architecture: dict[str, Any]
    method: str
    recipe: dict[str, Any]
    quant: dict[str, Any]
    data: dict[str, Any]
    seed: int
    grouping: str = "layer"
    files: dict[str, str] = field(default_factory=dict)
    created: str = field(default_factory=utc_now)
    calibration: dict[str, Any] = field(default_factory=dict)
    evaluation: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    # Mapping-style read access (``manifest["model"]``, ``manifest.get("license")``, ``dict(manifest)``),
    # so code written against the JSON dict works with the dataclass too.
    def keys(self) -> list[str]:
        return list(self.to_dict().keys())

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.to_dict().get(key, default)

    @property
    def num_layers(self) -> int:
        return int(self.architecture["num_layers"])

    @property
    def head_dim(self) -> int:
        return int(self.architecture["head_dim"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.architecture["num_key_value_heads"])

    @property
    def rotations_per_layer(self) -> int:
        """``N``: 1 for per-layer rotations, ``H_kv`` for per-head."""
        return 1 if self.grouping == "layer" else self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict, ``format_version`` first."""
        d = dataclasses.asdict(self)
        out = {"format_version": d.pop("format_version")}
        extra = d.pop("extra")
        out.update(d)
        if out["evaluation"] is None:
            del out["evaluation"]
        out.update({k: v for k, v in extra.items() if k not in out})
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = MANIFEST_NAME) -> Manifest:
        """Parse and validate; raise ArtifactVersionError for an unknown format_version, else ArtifactError."""
        if not isinstance(data, dict):
            raise ArtifactError(f"{where}: expected a JSON object")
        version = data.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise ArtifactError(f"{where}: format_version missing or not an integer ({version!r})")
        if version not in SUPPORTED_FORMAT_VERSIONS:
            raise ArtifactVersionError(
                f"{where}: artifact format_version {version} is not supported by this oscar "
                f"(reads {', '.join(map(str, SUPPORTED_FORMAT_VERSIONS))})",
                hint="upgrade oscar-kv (pip install -U oscar-kv) or re-run oscar calibrate with this version",
            )
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        # fields added by newer writers of the same format_version are kept (and written back), not dropped
        extra = {k: v for k, v in data.items() if k not in names}
        data = {k: v for k, v in data.items() if k in names}
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
        missing = [n for n in required if n not in data]
        if missing:
            raise ArtifactError(f"{where}: missing field(s) {', '.join(missing)}")
        m = cls(**data, extra=extra)
        m.validate(where)
        return m

    def validate(self, where: str = MANIFEST_NAME) -> None:
        """Check types and the fields later code relies on; raise ArtifactError naming the field."""
        dict_fields = ("model", "architecture", "recipe", "quant", "data", "files", "calibration")
        for name in dict_fields:
            if not isinstance(getattr(self, name), dict):
                raise ArtifactError(f"{where}: field {name} must be an object")
        for key in ("reference", "resolved"):
            if not isinstance(self.model.get(key), str):
                raise ArtifactError(f"{where}: model.{key} must be a string")
        for key in ("num_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = self.architecture.get(key)
            if not isinstance(value, int) or value <= 0:
                raise ArtifactError(f"{where}: architecture.{key} must be a positive integer, got {value!r}")
        if self.method not in ("oscar", "hadamard", "identity"):
            raise ArtifactError(f"{where}: method {self.method!r} is not oscar, hadamard or identity")
        if self.grouping not in ("layer", "head"):
            raise ArtifactError(f"{where}: grouping {self.grouping!r} is not layer or head")
        for name, digest in self.files.items():
            if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ArtifactError(f"{where}: files.{name} is not a sha256 hex digest")


def architecture_mismatches(have: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """``["num_layers: artifact 30, model 32", ...]`` for the fingerprint keys that both define and differ."""
    out = []
    for key in ARCHITECTURE_KEYS:
        if key in have and key in want and not _same(have[key], want[key]):
            out.append(f"{key}: artifact {have[key]!r}, model {want[key]!r}")
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return float(a) == float(b)
    return bool(a == b)


def model_slug(reference: str) -> str:
    """A folder-safe slug of a model reference: ``Qwen/Qwen3-8B@main`` → ``qwen3-8b``."""
    base = reference.split("@", 1)[0].rstrip("/").split("/")[-1]
    if base.endswith(".gguf"):
        base = base[: -len(".gguf")]
    slug = re.sub(r"[^a-z0-9._-]+", "-", base.lower()).strip("-.")
    return slug or "model"
