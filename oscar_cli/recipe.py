"""Calibration recipes: validated, frozen data loaded from YAML.

``recipes/defaults.yaml`` (package data ``oscar_cli.recipes``) holds every knob; a per-model file
(``recipes/qwen3-8b.yaml``) or a user file lists only differences, which are deep-merged over the defaults.
The schema is a tree of frozen pydantic models: unknown keys are rejected with their dotted path
(``clip.k_ratoi``), values are type- and range-checked without coercion (``"3"`` is not 3), and sizes the INT2
cache needs as multiples are checked here (``quant.sink``/``quant.recent`` multiples of 8, ``quant.group_size`` a
multiple of 4; that it divides the model's head_dim is checked when calibration starts). Every error is one
:class:`RecipeError` line. ``recipe.to_dict()`` round-trips through :func:`recipe_from_dict`.

Example::

    recipe = load_recipe("qwen3-8b")                # a shipped per-model file, merged over the defaults
    recipe = load_recipe("my.yaml", overrides={"data": {"tokens": 4096}})
    recipe.clip.k_ratio                             # 0.96
"""

from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from oscar_cli._schema import FloatList, Schema, StrictFloat, first_error
from oscar_cli.errors import RecipeError
from oscar_kernels.layout import DEFAULT_RECENT, DEFAULT_SINK, UNIFORM_INNER

METHODS = ("oscar", "hadamard", "identity")
# Upper bounds keep every size a recipe can ask for finite (a fuzzed or hostile recipe cannot ask for 10**12).
MAX_TOKENS = 1 << 31
MAX_SEQ_LEN = 1 << 20
MAX_WINDOW = 1 << 20
MAX_KEY_SUBSPACE = 16  # quant.key_subspace: beyond it the BF16 coefficients cost more than INT4 keys would
Ratio = Annotated[StrictFloat, Field(ge=0.0, le=1.0)]
InnerLevel = Annotated[StrictFloat, Field(gt=0.0, lt=0.5)]  # quant.levels: the inner level a (uniform 1/3)
LogitCorrection = Literal["none", "scale"]  # quant.logit_correction (oscar_cli.quant.attention.logit_bias)
Count = Annotated[int, Field(ge=1, le=MAX_TOKENS)]


class DataConfig(Schema):
    """Where calibration tokens come from and how many (see ``recipes/defaults.yaml`` for each knob)."""

    source: str = "self"
    tokens: Count = 16384
    seq_len: Annotated[int, Field(ge=8, le=MAX_SEQ_LEN)] = 1024
    batch_size: Annotated[int, Field(ge=1, le=1 << 16)] = 2
    seed: Annotated[int, Field(ge=0, lt=1 << 63)] = 0
    text_field: str = "text"
    hf_split: str = "train"
    gen_batch_size: Annotated[int, Field(ge=1, le=1 << 16)] = 16
    gen_max_new_tokens: Annotated[int, Field(ge=1, le=MAX_SEQ_LEN)] = 512
    gen_temperature: Annotated[StrictFloat, Field(ge=0.0, le=100.0)] = 0.8
    gen_top_p: Annotated[StrictFloat, Field(gt=0.0, le=1.0)] = 0.95


class StatisticsConfig(Schema):
    """Which second-moment targets drive the K and V rotations."""

    k_target: Literal["qqt", "ktk"] = "qqt"
    v_target: Literal["sst", "softmax", "sv", "vtv"] = "sst"
    v_metric: Literal["none", "wo_mcm", "wo_cmc"] = "none"  # calibration.wo_metric; left out of to_dict while none
    exclude_sink: bool = True
    sst_max_tokens: Annotated[int, Field(ge=16, le=MAX_TOKENS)] = 16384


class RotationConfig(Schema):
    """How rotations are built from the targets."""

    grouping: Literal["layer", "head"] = "layer"
    composition: Literal["r_h_pbr", "r_h", "plain", "pbr", "br", "h_pbr"] = "r_h_pbr"
    center_keys: bool = True
    center_values: bool = True
    dc: Literal["min", "max"] = "min"  # eigenvector on H's all-ones row (zero point); left out of to_dict while min


class ClipConfig(Schema):
    """Clip ratios: published global values or a per-layer search on held-out tokens."""

    mode: Literal["search", "global"] = "search"
    objective: Literal["mean", "topk"] = "mean"
    topk_keys: Annotated[int, Field(ge=1, le=MAX_WINDOW)] = 8
    k_ratio: Ratio = 0.96
    v_ratio: Ratio = 0.92
    k_grid: FloatList = (0.0, 0.9, 0.92, 0.94, 0.96, 0.98)  # floors: docs/RESULTS.md, "Clip grid"
    v_grid: FloatList = (0.0, 0.88, 0.9, 0.92, 0.94, 0.96)
    holdout_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS)] = 1024
    holdout_queries: Count = 256

    @field_validator("k_grid", "v_grid")
    @classmethod
    def _ratios(cls, grid: tuple[float, ...]) -> tuple[float, ...]:
        bad = [x for x in grid if not 0.0 <= x <= 1.0]
        if bad:
            raise ValueError(f"values must lie in [0, 1] (0 = no clipping), got {bad[0]}")
        return grid


class KeepConfig(Schema):
    """A per-token BF16 keep budget chosen at write time (:mod:`oscar_cli.quant.keep`): of the tokens demoted
    to INT2, the ``fraction`` with the largest ``score`` (``qerr``: relative INT2 error of the rotated key plus
    that of the value; ``knorm``: key norm) are also kept in BF16 and attention reads those; ``side``: keys,
    values or both. 0 = off."""

    fraction: Annotated[StrictFloat, Field(ge=0.0, le=1.0)] = 0.0
    score: Literal["qerr", "knorm"] = "qerr"
    # which rows the tier keeps: both (K and V), or one side only (a diagnostic: with fraction 1 it serves that
    # side in BF16 and the other in INT2, which attributes an accuracy loss to keys or values)
    side: Literal["both", "keys", "values"] = "both"
    # the decoder layers the budget applies to (absent: every INT2 layer); with fraction 1 and side keys it serves
    # those layers' keys in BF16, a diagnostic of which layers' INT2 keys cost accuracy
    layers: Annotated[list[Annotated[int, Field(ge=0, lt=1024)]], Field(min_length=1, max_length=1024)] | None = None


class QuantConfig(Schema):
    """The INT2 layout the rotations and clips are calibrated for (recorded in the artifact)."""

    group_size: Annotated[int, Field(ge=4, le=1024, multiple_of=4)] | None = None
    meta_dtype: Literal["bfloat16", "float16", "float32", "uint8"] = "bfloat16"
    sink: Annotated[int, Field(ge=0, le=MAX_WINDOW, multiple_of=8)] = DEFAULT_SINK
    recent: Annotated[int, Field(ge=0, le=MAX_WINDOW, multiple_of=8)] = DEFAULT_RECENT
    keep: KeepConfig = Field(default_factory=KeepConfig)
    levels: InnerLevel = UNIFORM_INNER  # non-uniform INT2 levels zero + scale·3·(0, a, 1-a, 1) (reference path)
    logit_correction: LogitCorrection = "none"  # scale: -σ²/2 on INT2 keys' logits (reference path)
    # keys' coordinates along the top-m directions of the key target (query covariance) kept in BF16, the rest
    # INT2 (oscar_cli.quant.key_subspace; reference path); 0 = off
    key_subspace: Annotated[int, Field(ge=0, le=MAX_KEY_SUBSPACE)] = 0
    # INT2 keys centred by one constant mean, or by RoPE_p(m_pre) at each key's position (oscar_cli.quant.key_mean;
    # reference path)
    key_mean: Literal["constant", "rope"] = "constant"
    # keys in BF16 for the N layers whose INT2 keys most often change which history token a focused head picks on
    # the held-out tokens (oscar_cli.calibration.copy_score); served through the keep tier (quant.keep.layers,
    # reference path); 0 = off
    bf16_keys: Annotated[int, Field(ge=0, le=1024)] = 0
    # keys at 4 bits (a second INT2 plane, reference formula 9; no clip) for the N layers of largest copy score,
    # stored once: +2 bits on those layers' history keys (transformers paths and vLLM); 0 = off
    int4_keys: Annotated[int, Field(ge=0, le=1024)] = 0


class Recipe(Schema):
    """A complete, validated calibration recipe."""

    name: Annotated[str, Field(max_length=128)] = "default"
    method: Literal["oscar", "hadamard", "identity"] = "oscar"
    data: DataConfig = Field(default_factory=DataConfig)
    statistics: StatisticsConfig = Field(default_factory=StatisticsConfig)
    rotation: RotationConfig = Field(default_factory=RotationConfig)
    clip: ClipConfig = Field(default_factory=ClipConfig)
    quant: QuantConfig = Field(default_factory=QuantConfig)

    @field_validator("name")
    @classmethod
    def _word(cls, name: str) -> str:
        if not name or any(ch in name for ch in "/\\") or any(ch.isspace() for ch in name):
            raise ValueError(f"{name!r} must be a non-empty word (no slashes or spaces)")
        return name

    @model_validator(mode="before")
    @classmethod
    def _mapping(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise ValueError(f"a recipe must be a mapping of keys, got {type(data).__name__}")
        return data

    @model_validator(mode="after")
    def _dc_needs_h_after_u(self) -> Recipe:
        if self.rotation.dc != "min" and (self.method != "oscar" or self.rotation.composition not in ("r_h_pbr", "r_h")):
            raise ValueError(
                f"rotation.dc: {self.rotation.dc} needs method oscar with composition r_h_pbr or r_h (H after U), "
                f"got method {self.method}, composition {self.rotation.composition}"
            )
        return self

    @model_validator(mode="after")
    def _bf16_keys_alone(self) -> Recipe:
        if self.quant.bf16_keys and self.quant.keep.fraction:
            raise ValueError(f"quant.bf16_keys {self.quant.bf16_keys} and quant.keep.fraction {self.quant.keep.fraction:g} "
                             "both use the BF16 keep tier; set one of them")
        if self.quant.bf16_keys and self.method != "oscar":
            raise ValueError(f"quant.bf16_keys needs method oscar (layers are chosen on its held-out scores), "
                             f"got {self.method}")
        return self

    @model_validator(mode="after")
    def _int4_keys_alone(self) -> Recipe:
        q = self.quant
        if not q.int4_keys:
            return self
        if self.method != "oscar":
            raise ValueError(f"quant.int4_keys needs method oscar (layers are chosen on its held-out scores), "
                             f"got {self.method}")
        clash = [name for name, on in (("quant.bf16_keys", q.bf16_keys), ("quant.keep.fraction", q.keep.fraction),
                                       ("quant.key_subspace", q.key_subspace),
                                       ("quant.levels", q.levels != UNIFORM_INNER),
                                       ("quant.logit_correction", q.logit_correction != "none")) if on]
        if clash:
            raise ValueError(f"quant.int4_keys stores keys in two uniform INT2 planes; it does not combine with "
                             f"{', '.join(clash)}")
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (lists for tuples): YAML/JSON-ready; :func:`recipe_from_dict` inverts it.

        ``quant.keep`` is left out while it is off (fraction 0), its ``side`` while ``both`` and its ``layers`` while
        absent, ``quant.levels`` while uniform (1/3),
        ``quant.logit_correction`` while it is ``none``, ``quant.key_subspace`` while it is 0, ``quant.key_mean`` while ``constant``, ``quant.bf16_keys`` and ``quant.int4_keys`` while 0,
        ``statistics.v_metric`` while it is ``none`` and ``rotation.dc`` while it is ``min``, so a recipe without them writes the same bytes (``recipe.yaml``, the manifest, the default output hash)
        that oscar wrote before the knobs existed, and older readers accept it; :meth:`full_dict` lists every
        knob."""
        out = self.full_dict()
        if self.quant.keep.fraction == 0.0:
            del out["quant"]["keep"]
        else:
            if self.quant.keep.side == "both":
                del out["quant"]["keep"]["side"]
            if self.quant.keep.layers is None:
                del out["quant"]["keep"]["layers"]
        if self.quant.levels == UNIFORM_INNER:
            del out["quant"]["levels"]
        if self.quant.logit_correction == "none":
            del out["quant"]["logit_correction"]
        if self.quant.key_subspace == 0:
            del out["quant"]["key_subspace"]
        if self.quant.key_mean == "constant":
            del out["quant"]["key_mean"]
        if self.quant.bf16_keys == 0:
            del out["quant"]["bf16_keys"]
        if self.quant.int4_keys == 0:
            del out["quant"]["int4_keys"]
        if self.statistics.v_metric == "none":
            del out["statistics"]["v_metric"]
        if self.rotation.dc == "min":
            del out["rotation"]["dc"]
        return out

    def full_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` with every knob present (also the ones left out while off)."""
        return _plain(self.model_dump())

    def to_yaml(self) -> str:
        """The resolved recipe as YAML text (what the artifact's ``recipe.yaml`` holds)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, overrides: dict[str, Any]) -> Recipe:
        """A new recipe with nested ``overrides`` merged in and validated (e.g. ``{"data": {"tokens": 4096}}``)."""
        return recipe_from_dict(deep_merge(self.to_dict(), overrides))


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    return obj


def deep_merge(base: dict[str, Any], diff: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``diff`` merged in recursively (dicts merge, everything else replaces); inputs untouched."""
    out = copy.deepcopy(base)
    for key, value in diff.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _keys_under(path: tuple[Any, ...]) -> list[str]:
    """The valid keys of the recipe section at ``path`` (``("clip",)`` → clip's keys)."""
    model: Any = Recipe
    for part in path:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, Schema):
            break
        model = field.annotation
    return sorted(model.model_fields)


def recipe_from_dict(data: Any) -> Recipe:
    """Build and validate a full recipe from a nested dict (missing keys take the defaults).

    Raises:
        RecipeError: one line naming the first offending key path.
    """
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        _, message = first_error(exc)
        hint = None
        if error.get("type") == "extra_forbidden":
            section = tuple(error["loc"][:-1])
            hint = f"valid keys under {'.'.join(map(str, section)) or 'recipe'}: {', '.join(_keys_under(section))}"
        raise RecipeError(f"recipe: {message}", hint=hint) from None


def check_layout(quant: QuantConfig, head_dim: int) -> None:
    """Refuse a ``quant.group_size`` that does not divide the model's ``head_dim`` (before any work)."""
    if quant.group_size is not None and head_dim % quant.group_size:
        raise RecipeError(
            f"recipe: quant.group_size {quant.group_size} does not divide the model's head_dim {head_dim}",
            hint=f"use a divisor of {head_dim} that is a multiple of 4, or null (= head_dim)",
        )
    if quant.key_subspace >= head_dim:
        raise RecipeError(f"recipe: quant.key_subspace {quant.key_subspace} must be below the model's head_dim "
                          f"{head_dim}", hint="a few directions (2-4) carry most of the query energy; 0 = off")


MAX_FLOW_DEPTH = 64


def _flow_depth(text: str | bytes) -> int:
    """The deepest nesting of YAML flow collections (``[`` / ``{``) in ``text`` (an upper bound: quotes are
    not parsed)."""
    raw = text.encode("utf-8", "replace") if isinstance(text, str) else text
    depth = deepest = 0
    for byte in raw.translate(None, delete=bytes(b for b in range(256) if b not in b"[]{}")):
        depth = depth + 1 if byte in b"[{" else max(depth - 1, 0)
        deepest = max(deepest, depth)
    return deepest


def read_recipe_yaml(text: str | bytes, where: str) -> dict[str, Any]:
    """The mapping a recipe YAML text holds (``{}`` for an empty file), read with ``yaml.safe_load`` (no
    ``!!python`` tags); RecipeError for invalid UTF-8 or YAML, a non-mapping, or nesting too deep to read."""
    if _flow_depth(text) > MAX_FLOW_DEPTH:  # PyYAML takes seconds on thousands of nested [ or {
        raise RecipeError(f"recipe {where}: nested too deeply to read (more than {MAX_FLOW_DEPTH} levels)")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RecipeError(f"recipe {where}: not valid YAML ({first})") from None
    except UnicodeDecodeError:
        raise RecipeError(f"recipe {where}: not UTF-8 text") from None
    except RecursionError:
        raise RecipeError(f"recipe {where}: nested too deeply to read") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {where}: the top level must be a mapping of keys")
    return data


MAX_RECIPE_BYTES = 1 << 20


def _read_limited(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_RECIPE_BYTES + 1)
    except OSError as exc:
        raise RecipeError(f"recipe file {path} cannot be read ({exc.strerror or type(exc).__name__})") from None
    if len(data) > MAX_RECIPE_BYTES:
        raise RecipeError(f"recipe file {path} is larger than {MAX_RECIPE_BYTES >> 20} MiB: not a recipe")
    return data


def shipped_recipe_names() -> list[str]:
    """Names of the recipe files shipped with oscar (``defaults`` and the per-model diffs)."""
    root = resources.files("oscar_cli.recipes")
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def _shipped_text(name: str) -> str:
    return resources.files("oscar_cli.recipes").joinpath(f"{name}.yaml").read_text(encoding="utf-8")


def default_recipe_dict() -> dict[str, Any]:
    """``recipes/defaults.yaml`` as a dict (validated to be a complete recipe)."""
    data = read_recipe_yaml(_shipped_text("defaults"), "defaults.yaml")
    recipe_from_dict(data)
    return data


def recipe_for_model(model_slug: str) -> str:
    """The shipped per-model recipe whose name is the longest prefix of ``model_slug`` (else ``defaults``).

    ``qwen3-8b`` and ``qwen3-8b-instruct`` both pick ``qwen3-8b``; an unknown model picks ``defaults``.
    """
    slug = model_slug.lower()
    matches = [n for n in shipped_recipe_names() if n != "defaults" and slug.startswith(n)]
    return max(matches, key=len) if matches else "defaults"


def load_recipe(ref: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Recipe:
    """Load a recipe: ``None``/``"defaults"``, a shipped name (``"qwen3-8b"``), or a YAML file path.

    The file's keys are merged over the defaults, then ``overrides`` (nested dict) over that, and the result
    is validated. Raises :class:`RecipeError` naming the file and the offending key path.
    """
    base = default_recipe_dict()
    diff: dict[str, Any] = {}
    where = "defaults"
    if ref is not None and str(ref) != "defaults":
        path = Path(ref)
        if path.suffix in (".yaml", ".yml") or path.exists():
            if not path.is_file():
                raise RecipeError(f"recipe file {path} not found", hint="pass a YAML file or a shipped recipe name")
            diff = read_recipe_yaml(_read_limited(path), str(path))
            where = str(path)
            diff.setdefault("name", path.stem)
        elif str(ref) in shipped_recipe_names():
            diff = read_recipe_yaml(_shipped_text(str(ref)), f"{ref}.yaml")
            where = f"{ref}.yaml"
        else:
            raise RecipeError(
                f"unknown recipe {str(ref)!r}",
                hint=f"use a YAML file or one of: {', '.join(shipped_recipe_names())}",
            )
    merged = deep_merge(base, diff)
    if overrides:
        merged = deep_merge(merged, overrides)
    try:
        return recipe_from_dict(merged)
    except RecipeError as exc:
        raise RecipeError(f"{where}: {exc.message}", hint=exc.hint) from None
