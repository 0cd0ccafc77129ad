"""Recipe variants for an ablation: one lever each, written as ``[NAME:]KEY=VALUE`` (or ``K1/K2=V1/V2``).

A key is a dotted recipe path (``rotation.grouping``) or a leaf name that is unique in the recipe
(``grouping``, ``seq_len``, ``v_target``). Values are read as YAML scalars (``16384``, ``head``, ``null``,
``[0.0, 0.9]``). Two keys with ``/`` form one lever whose parts move together, e.g. the BF16 split
``sink/recent=32/288`` at the same sink + recent. A variant must change the base recipe, and the resolved
recipe must validate (:class:`~oscar_cli.errors.RecipeError` otherwise).

Example::

    base = load_recipe("smollm2-135m")
    v = parse_variant("heads:rotation.grouping=head", base)     # Variant(name="heads", overrides=...)
    recipe_diff(base.to_dict(), v.recipe.to_dict())            # {"rotation.grouping": ("layer", "head")}
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any

import yaml

from oscar_cli.errors import EvalError
from oscar_cli.recipe import Recipe, recipe_from_dict


@dataclass(frozen=True)
class Variant:
    """A named recipe change: ``overrides`` (nested) merged over the base gives ``recipe``."""

    name: str
    spec: str
    overrides: dict[str, Any]
    recipe: Recipe


def _leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_leaves(value, path + "."))
        else:
            out[path] = value
    return out


def recipe_diff(base: dict[str, Any], other: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{dotted path: (base value, other value)}`` for every leaf that differs (``name`` is ignored); knobs
    a recipe dict leaves out while off (``quant.keep``) count with their defaults."""
    a, b = (_leaves(recipe_from_dict(x).full_dict()) for x in (base, other))
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if k != "name" and a.get(k) != b.get(k)}


def format_change(diff: dict[str, tuple[Any, Any]]) -> str:
    """``rotation.grouping layer→head``; several keys joined by ``, ``; ``—`` for none."""
    if not diff:
        return "—"
    return ", ".join(f"{k} {_short(a)}→{_short(b)}" for k, (a, b) in diff.items())


def _short(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(_short(v) for v in value) + "]"
    return "null" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def resolve_key(key: str, base: Recipe) -> str:
    """The dotted recipe path ``key`` names (itself, or the one leaf of that name); EvalError otherwise."""
    leaves = _leaves(base.full_dict())
    leaves.pop("name", None)
    if key in leaves:
        return key
    matches = [p for p in leaves if p.rsplit(".", 1)[-1] == key]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise EvalError(f"variant key {key!r} is ambiguous: {', '.join(matches)}", hint="use the dotted path")
    close = difflib.get_close_matches(key, list(leaves) + [p.rsplit(".", 1)[-1] for p in leaves], n=3)
    raise EvalError(f"variant key {key!r} is not a recipe knob",
                    hint=f"did you mean {', '.join(close)}?" if close else "see recipes/defaults.yaml for the knobs")


def _nest(path: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    node = out
    parts = path.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def _scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def parse_variant(spec: str, base: Recipe) -> Variant:
    """``[NAME:]KEY=VALUE`` or ``[NAME:]K1/K2=V1/V2`` → :class:`Variant` (NAME defaults to the spec's body)."""
    if "=" not in spec:
        raise EvalError(f"variant {spec!r}: expected KEY=VALUE (e.g. rotation.grouping=head)")
    colon, eq = spec.find(":"), spec.find("=")
    name, body = (spec[:colon], spec[colon + 1 :]) if 0 <= colon < eq else (spec, spec)
    keys_text, _, values_text = body.partition("=")
    keys = [k.strip() for k in keys_text.split("/")]
    values = values_text.split("/") if len(keys) > 1 else [values_text]
    if len(values) != len(keys) or not all(keys):
        raise EvalError(f"variant {spec!r}: {len(keys)} keys need as many /-separated values, got {len(values)}")
    overrides: dict[str, Any] = {}
    from oscar_cli.recipe import deep_merge

    for key, value in zip(keys, values, strict=True):
        overrides = deep_merge(overrides, _nest(resolve_key(key, base), _scalar(value.strip())))
    recipe = base.replace(overrides)
    if not recipe_diff(base.to_dict(), recipe.to_dict()):
        raise EvalError(f"variant {spec!r} changes nothing: the base recipe already has that value")
    return Variant(name.strip() or body, spec, overrides, recipe)


def safe_name(name: str) -> str:
    """``name`` as a file name (letters, digits and ``._=-``; anything else becomes ``_``)."""
    return re.sub(r"[^A-Za-z0-9._=-]", "_", name)[:100] or "variant"


def default_variants(base: Recipe, native_positions: int, head_dim: int) -> list[str]:
    """One lever each, most informative first (a ``--budget`` run stops at the end of the list it reaches).

    - ``clip.objective=topk``: the clip search weighted toward the most attended keys;
    - ``rotation.grouping``: per-KV-head rotations (or per-layer, from a per-head base);
    - ``data.seq_len`` doubled at the same token budget, where the model's positions and the budget allow;
    - ``quant.sink/quant.recent``: half the sink moved to the recent window (the same BF16 tokens);
    - ``statistics.v_target=softmax`` (from ``sst``); ``clip.mode=global`` (from ``search``);
    - ``quant.meta_dtype=float16`` (from ``bfloat16``): 16-bit metadata either way, the same bits per element.
    """
    from oscar_cli.calibration.run import plan_budget
    from oscar_cli.errors import CalibrationError

    out = ["clip.objective=topk" if base.clip.objective == "mean" else "clip.objective=mean"]
    out.append("rotation.grouping=head" if base.rotation.grouping == "layer" else "rotation.grouping=layer")
    longer = 2 * base.data.seq_len
    if longer <= native_positions:
        try:
            plan_budget(base.replace({"data": {"seq_len": longer}}), head_dim)
            out.append(f"data.seq_len={longer}")
        except CalibrationError:  # the token budget does not hold sequences that long: no such variant
            pass
    q = base.quant
    moved = max(8, q.sink // 2 // 8 * 8) if q.sink >= 8 else 0  # sink and recent stay multiples of 8
    if moved:
        out.append(f"sink/recent={q.sink - moved}/{q.recent + moved}")
    if base.statistics.v_target == "sst":
        out.append("statistics.v_target=softmax")
    if base.clip.mode == "search":
        out.append("clip.mode=global")
    if q.meta_dtype == "bfloat16":
        out.append("quant.meta_dtype=float16")
    return out
