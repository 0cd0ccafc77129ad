"""Calibration recipes: validated, frozen data loaded from YAML.

``recipes/defaults.yaml`` (package data ``oscar_cli.recipes``) holds every knob; a per-model file
(``recipes/qwen3-8b.yaml``) or a user file lists only differences, which are deep-merged over the defaults.
Unknown keys are rejected with their dotted path (``clip.k_ratoi``), values are type- and range-checked, and
the result is a tree of frozen dataclasses. ``recipe.to_dict()`` round-trips through :func:`recipe_from_dict`.

Example::

    recipe = load_recipe("qwen3-8b")                # a shipped per-model file, merged over the defaults
    recipe = load_recipe("my.yaml", overrides={"data": {"tokens": 4096}})
    recipe.clip.k_ratio                             # 0.96
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from oscar_cli.errors import RecipeError
from oscar_kernels.layout import DEFAULT_RECENT, DEFAULT_SINK

METHODS = ("oscar", "hadamard", "identity")
K_TARGETS = ("qqt", "ktk")
V_TARGETS = ("sst", "softmax", "sv", "vtv")
GROUPINGS = ("layer", "head")
COMPOSITIONS = ("r_h_pbr", "r_h", "plain", "pbr", "br", "h_pbr")
CLIP_MODES = ("search", "global")
META_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class DataConfig:
    """Where calibration tokens come from and how many (see ``recipes/defaults.yaml`` for each knob)."""

    source: str = "self"
    tokens: int = 16384
    seq_len: int = 1024
    batch_size: int = 2
    seed: int = 0
    text_field: str = "text"
    hf_split: str = "train"
    gen_batch_size: int = 16
    gen_max_new_tokens: int = 512
    gen_temperature: float = 0.8
    gen_top_p: float = 0.95


@dataclass(frozen=True)
class StatisticsConfig:
    """Which second-moment targets drive the K and V rotations."""

    k_target: str = "qqt"
    v_target: str = "sst"
    exclude_sink: bool = True
    sst_max_tokens: int = 16384


@dataclass(frozen=True)
class RotationConfig:
    """How rotations are built from the targets."""

    grouping: str = "layer"
    composition: str = "r_h_pbr"
    center_keys: bool = True
    center_values: bool = True


@dataclass(frozen=True)
class ClipConfig:
    """Clip ratios: published global values or a per-layer search on held-out tokens."""

    mode: str = "search"
    k_ratio: float = 0.96
    v_ratio: float = 0.92
    k_grid: tuple[float, ...] = (0.0, 0.9, 0.92, 0.94, 0.96, 0.98)  # floors: docs/RESULTS.md, "Clip grid"
    v_grid: tuple[float, ...] = (0.0, 0.88, 0.9, 0.92, 0.94, 0.96)
    holdout_tokens: int = 1024
    holdout_queries: int = 256


@dataclass(frozen=True)
class QuantConfig:
    """The INT2 layout the rotations and clips are calibrated for (recorded in the artifact)."""

    group_size: int | None = None
    meta_dtype: str = "bfloat16"
    sink: int = DEFAULT_SINK
    recent: int = DEFAULT_RECENT


@dataclass(frozen=True)
class Recipe:
    """A complete, validated calibration recipe."""

    name: str = "default"
    method: str = "oscar"
    data: DataConfig = field(default_factory=DataConfig)
    statistics: StatisticsConfig = field(default_factory=StatisticsConfig)
    rotation: RotationConfig = field(default_factory=RotationConfig)
    clip: ClipConfig = field(default_factory=ClipConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (lists for tuples): YAML/JSON-ready; :func:`recipe_from_dict` inverts it."""
        return _plain(dataclasses.asdict(self))

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


def _build(cls: type, data: Any, path: str) -> Any:
    """Instantiate dataclass ``cls`` from ``data``, checking keys and field types; errors name the path."""
    where = path or "recipe"
    if not isinstance(data, dict):
        raise RecipeError(f"recipe: {where} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        full = ", ".join(f"{path + '.' if path else ''}{k}" for k in unknown)
        raise RecipeError(
            f"recipe: unknown key {full}",
            hint=f"valid keys under {where}: {', '.join(sorted(names))}",
        )
    kwargs = {name: _convert(hints[name], data[name], f"{path + '.' if path else ''}{name}") for name in data}
    return cls(**kwargs)


def _convert(tp: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _build(tp, value, path)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, path)
    if origin is tuple:
        if not isinstance(value, list | tuple) or not value:
            raise RecipeError(f"recipe: {path} must be a non-empty list, got {value!r}")
        return tuple(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise RecipeError(f"recipe: {path} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecipeError(f"recipe: {path} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RecipeError(f"recipe: {path} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise RecipeError(f"recipe: {path} must be a string, got {value!r}")
        return value
    raise RecipeError(f"recipe: {path} has an unsupported type")  # pragma: no cover


def _choice(path: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise RecipeError(f"recipe: {path} = {value!r} is not one of {', '.join(options)}")


def _positive(path: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise RecipeError(f"recipe: {path} must be >= {minimum}, got {value}")


def validate(recipe: Recipe) -> Recipe:
    """Check ranges and choices across the whole recipe; returns it unchanged or raises RecipeError."""
    _choice("method", recipe.method, METHODS)
    d, s, r, c, q = recipe.data, recipe.statistics, recipe.rotation, recipe.clip, recipe.quant
    if not recipe.name or any(ch in recipe.name for ch in "/\\ "):
        raise RecipeError(f"recipe: name {recipe.name!r} must be a non-empty word (no slashes or spaces)")
    _positive("data.tokens", d.tokens)
    _positive("data.seq_len", d.seq_len, 8)
    _positive("data.batch_size", d.batch_size)
    _positive("data.gen_batch_size", d.gen_batch_size)
    _positive("data.gen_max_new_tokens", d.gen_max_new_tokens)
    if not 0 < d.gen_top_p <= 1 or d.gen_temperature < 0:
        raise RecipeError("recipe: data.gen_top_p must be in (0, 1] and data.gen_temperature >= 0")
    _choice("statistics.k_target", s.k_target, K_TARGETS)
    _choice("statistics.v_target", s.v_target, V_TARGETS)
    _positive("statistics.sst_max_tokens", s.sst_max_tokens, 16)
    _choice("rotation.grouping", r.grouping, GROUPINGS)
    _choice("rotation.composition", r.composition, COMPOSITIONS)
    _choice("clip.mode", c.mode, CLIP_MODES)
    for name, ratios in (("clip.k_ratio", (c.k_ratio,)), ("clip.v_ratio", (c.v_ratio,)),
                         ("clip.k_grid", c.k_grid), ("clip.v_grid", c.v_grid)):
        for x in ratios:
            if not 0.0 <= x <= 1.0:
                raise RecipeError(f"recipe: {name} values must lie in [0, 1] (0 = no clipping), got {x}")
    _positive("clip.holdout_tokens", c.holdout_tokens, 0)
    _positive("clip.holdout_queries", c.holdout_queries)
    if q.group_size is not None:
        _positive("quant.group_size", q.group_size, 4)
    _choice("quant.meta_dtype", q.meta_dtype, META_DTYPES)
    _positive("quant.sink", q.sink, 0)
    _positive("quant.recent", q.recent, 0)
    return recipe


def recipe_from_dict(data: dict[str, Any]) -> Recipe:
    """Build and validate a full recipe from a nested dict (missing keys take the dataclass defaults)."""
    return validate(_build(Recipe, data, ""))


def _read_yaml(text: str, where: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {where}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {where}: the top level must be a mapping of keys")
    return data


def shipped_recipe_names() -> list[str]:
    """Names of the recipe files shipped with oscar (``defaults`` and the per-model diffs)."""
    root = resources.files("oscar_cli.recipes")
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def _shipped_text(name: str) -> str:
    return resources.files("oscar_cli.recipes").joinpath(f"{name}.yaml").read_text(encoding="utf-8")


def default_recipe_dict() -> dict[str, Any]:
    """``recipes/defaults.yaml`` as a dict (validated to be a complete recipe)."""
    data = _read_yaml(_shipped_text("defaults"), "defaults.yaml")
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
            diff = _read_yaml(path.read_text(encoding="utf-8"), str(path))
            where = str(path)
            diff.setdefault("name", path.stem)
        elif str(ref) in shipped_recipe_names():
            diff = _read_yaml(_shipped_text(str(ref)), f"{ref}.yaml")
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
