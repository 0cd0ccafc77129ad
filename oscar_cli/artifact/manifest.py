"""The artifact manifest (``manifest.json``): what an artifact is, for which model, made how (format v1).

The manifest is plain JSON. :class:`Manifest` parses and validates it against
:class:`~oscar_cli.artifact.schema.ManifestSchema` (:meth:`Manifest.from_dict` raises
:class:`~oscar_cli.errors.ArtifactError` / :class:`~oscar_cli.errors.ArtifactVersionError` naming the field);
:meth:`Manifest.to_dict` writes it back.

The **content digest** (``digest``, docs/EXPORT.md) is ``"sha256:" + sha256(canonical_json(manifest minus
"digest"))``, where canonical JSON is ``json.dumps(obj, sort_keys=True, separators=(",", ":"),
ensure_ascii=True, allow_nan=False)`` encoded as UTF-8. The manifest lists the sha256 of every other hashed
file (``files``), so the digest covers the manifest and every file it lists.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from oscar_cli._schema import first_error
from oscar_cli.artifact.schema import (
    HASHED_FILES,
    MANIFEST_NAME,
    README_NAME,
    RECIPE_NAME,
    TENSORS_NAME,
    ManifestSchema,
)
from oscar_cli.errors import ArtifactError, ArtifactVersionError

__all__ = ["HASHED_FILES", "MANIFEST_NAME", "README_NAME", "RECIPE_NAME", "TENSORS_NAME", "Manifest", "sealed"]

FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = (1,)

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
        quant: INT2 layout the clips were chosen for: group_size, meta_dtype, sink, recent (and ``keep``,
            the BF16 keep budget, when the recipe has one; ``levels``, the inner INT2 level, when not uniform;
            ``logit_correction`` when not ``none``; ``key_subspace`` ``m`` when on: then every layer stores
            ``layers.{i}.k_subspace`` ``[N, D, m]``; ``key_mean: rope`` when keys are centred by position: then
            every layer stores ``layers.{i}.k_mean_pre`` ``[H_kv, D]``; ``int4_keys``, the layers whose history
            keys are stored at 4 bits, when the recipe's ``quant.int4_keys`` chose any).
        data: calibration data identity: source, sha256 (of the token ids), tokens, sequences, ...
        seed: RNG seed.
        files: file name → sha256 hex of every hashed file (``rotations.safetensors``, ``recipe.yaml``).
        created: UTC timestamp.
        calibration: per-layer clip choices with objective values, eigenvalue spreads, timings.
        evaluation: optional results added later (``oscar export``/eval).
        extra: top-level keys this version does not know (kept and written back), e.g. ``environment``: the
            versions of oscar, torch, transformers, triton and the device/dtype that made the artifact.
        digest: the content digest (module docstring); ``""`` until :func:`sealed`.
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
    digest: str = ""

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
        try:
            ManifestSchema.model_validate(data)
        except ValidationError as exc:
            raise ArtifactError(f"{where}: {first_error(exc)[1]}") from None
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        # fields added by newer writers of the same format_version are kept (and written back), not dropped
        extra = {k: v for k, v in data.items() if k not in names}
        return cls(**{k: v for k, v in data.items() if k in names}, extra=extra)

    def validate(self, where: str = MANIFEST_NAME) -> None:
        """Check this manifest against the schema; raise ArtifactError naming the field."""
        Manifest.from_dict(self.to_dict(), where)

    def content_digest(self) -> str:
        """The digest this manifest's content has (whatever its ``digest`` field says)."""
        return content_digest(self.to_dict())


def canonical_json(obj: Any) -> bytes:
    """The canonical JSON bytes the digest is computed over (module docstring)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def content_digest(manifest: dict[str, Any]) -> str:
    """``"sha256:<hex>"`` over the canonical JSON of ``manifest`` without its ``digest`` key."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return "sha256:" + hashlib.sha256(canonical_json(body)).hexdigest()


def sealed(m: Manifest) -> Manifest:
    """``m`` with its ``digest`` set, validated (what writers write)."""
    out = dataclasses.replace(m, digest=content_digest(m.to_dict()))
    out.validate()
    return out


def architecture_mismatches(have: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """``["num_layers: artifact 30, model 32", ...]`` for the fingerprint keys that differ (a key the model's
    fingerprint lacks is not compared; the artifact's schema requires every key)."""
    out = []
    for key in ARCHITECTURE_KEYS:
        if key in want and not _same(have.get(key), want[key]):
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
