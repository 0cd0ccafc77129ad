"""The schema of ``manifest.json`` (format v1) as pydantic models: types, ranges and cross-field rules.

Everything later code sizes or allocates from is bounded here, before any tensor is read: layers, heads and
head_dim (:data:`MAX_LAYERS`, :data:`MAX_HEADS`, :data:`MAX_HEAD_DIM`), the BF16 windows (multiples of 8, as the
cache stores them), ``group_size`` (a multiple of 4 dividing ``head_dim``), file names (plain names inside the
artifact folder, no paths) and digests. The recipe section is a full :class:`~oscar_cli.recipe.Recipe`.
Free-form sections (``data``, ``calibration``, ``environment``, ``evaluation``) are only bounded in size and
depth by the reader (:mod:`oscar_cli.artifact.io`), except ``calibration.layers``, which decides how the cache
serves each layer: when present it lists every layer, each with a known ``scheme``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from oscar_cli._schema import Schema, StrictFloat
from oscar_cli.recipe import MAX_KEY_SUBSPACE, MAX_WINDOW, InnerLevel, KeepConfig, LogitCorrection, Recipe
from oscar_cli.transform import LAYER_SCHEMES

MANIFEST_NAME = "manifest.json"
TENSORS_NAME = "rotations.safetensors"
RECIPE_NAME = "recipe.yaml"
README_NAME = "README.md"
# Files whose sha256 the manifest records. README.md (the model card) is not hashed: it is documentation that
# `oscar export` re-renders when publishing (it quotes the digest).
HASHED_FILES = (TENSORS_NAME, RECIPE_NAME)
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_FILES = 16
# A file of an artifact: a plain name (no folder, no leading dot), so it can only name a file inside the folder.
FILE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SHA256_RE = r"^[0-9a-f]{64}$"
DIGEST_RE = r"^sha256:[0-9a-f]{64}$"
Text = Annotated[str, Field(min_length=1, max_length=1024)]


class ModelIdentity(Schema):
    """``reference``: what the user typed; ``resolved``: ``ORG/NAME@<sha>`` or ``sha256:<hex>``."""

    reference: Text
    resolved: Text


class Architecture(Schema):
    """The fingerprint an artifact is applied against (every key present; ``null`` where the config has none)."""

    model_type: Text
    num_layers: Annotated[int, Field(ge=1, le=MAX_LAYERS)]
    num_attention_heads: Annotated[int, Field(ge=1, le=MAX_HEADS)]
    num_key_value_heads: Annotated[int, Field(ge=1, le=MAX_HEADS)]
    head_dim: Annotated[int, Field(ge=4, le=MAX_HEAD_DIM, multiple_of=4)]
    rope_type: Text | None
    rope_theta: Annotated[StrictFloat, Field(gt=0)] | None
    max_position_embeddings: Annotated[int, Field(ge=1, le=1 << 30)] | None

    @model_validator(mode="after")
    def _groups(self) -> Architecture:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"architecture.num_key_value_heads {self.num_key_value_heads} does not divide "
                             f"num_attention_heads {self.num_attention_heads}")
        return self


class Quant(Schema):
    """The INT2 layout the clips were chosen for (what the cache uses when serving the artifact)."""

    group_size: Annotated[int, Field(ge=4, le=MAX_HEAD_DIM, multiple_of=4)] | None
    meta_dtype: Literal["bfloat16", "float16", "float32", "uint8"]
    sink: Annotated[int, Field(ge=0, le=MAX_WINDOW, multiple_of=8)]
    recent: Annotated[int, Field(ge=0, le=MAX_WINDOW, multiple_of=8)]
    keep: KeepConfig | None = None  # absent: no BF16 keep budget
    levels: InnerLevel | None = None  # absent: uniform INT2 levels (inner 1/3)
    logit_correction: LogitCorrection | None = None  # absent: none
    key_subspace: Annotated[int, Field(ge=1, le=MAX_KEY_SUBSPACE)] | None = None  # absent: off (layers.{i}.k_subspace)
    key_mean: Literal["rope"] | None = None  # absent: constant key mean; rope: layers.{i}.k_mean_pre (quant.key_mean)
    # the layers whose history keys are stored at 4 bits (two INT2 planes; recipe quant.int4_keys); absent: none
    int4_keys: Annotated[list[Annotated[int, Field(ge=0, lt=1024)]], Field(min_length=1, max_length=1024)] | None = None


class ManifestSchema(Schema):
    """``manifest.json``. Unknown top-level keys (from a newer writer of format v1) are kept, and the digest
    covers them too."""

    model_config = ConfigDict(extra="allow")

    format_version: Literal[1]
    oscar_version: Annotated[str, Field(min_length=1, max_length=64)]
    model: ModelIdentity
    architecture: Architecture
    method: Literal["oscar", "hadamard", "identity"]
    grouping: Literal["layer", "head"]
    recipe: Recipe
    quant: Quant
    data: dict[str, Any]
    seed: Annotated[int, Field(ge=0, lt=1 << 63)]
    files: dict[str, Annotated[str, Field(pattern=SHA256_RE)]] = Field(max_length=MAX_FILES)
    created: Annotated[str, Field(max_length=64)]
    calibration: dict[str, Any]
    evaluation: Any = None
    environment: dict[str, Any] | None = None
    digest: Annotated[str, Field(pattern=DIGEST_RE)]

    @field_validator("files")
    @classmethod
    def _plain_names(cls, files: dict[str, str]) -> dict[str, str]:
        for name in files:
            if not FILE_NAME_RE.match(name) or name in (MANIFEST_NAME, README_NAME):
                raise ValueError(f"{name!r} is not a plain file name of an artifact (no folders, no leading dot)")
        missing = [n for n in HASHED_FILES if n not in files]
        if missing:
            raise ValueError(f"no sha256 for {missing[0]}")
        return files

    @model_validator(mode="after")
    def _layout(self) -> ManifestSchema:
        g, d = self.quant.group_size, self.architecture.head_dim
        if g is not None and d % g:
            raise ValueError(f"quant.group_size {g} does not divide architecture.head_dim {d}")
        n = self.architecture.num_layers
        kept = self.quant.keep.layers if self.quant.keep is not None else None
        if kept and max(kept) >= n:
            raise ValueError(f"quant.keep.layers names layer {max(kept)}; the model has {n} layers")
        four = self.quant.int4_keys
        if four and max(four) >= n:
            raise ValueError(f"quant.int4_keys names layer {max(four)}; the model has {n} layers")
        rows = self.calibration.get("layers")
        if rows is None:
            return self
        if not isinstance(rows, list) or len(rows) != n:
            raise ValueError(f"calibration.layers must list the {n} layers of architecture.num_layers")
        for i, row in enumerate(rows):
            scheme = row.get("scheme") if isinstance(row, dict) else None
            if scheme not in LAYER_SCHEMES:
                raise ValueError(f"calibration.layers[{i}].scheme {scheme!r} is not one of {', '.join(LAYER_SCHEMES)}")
        return self
