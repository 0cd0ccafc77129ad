"""pydantic schemas → one-line errors: the shared base model and the translation of a ``ValidationError``.

Recipes and artifact manifests are validated by pydantic models derived from :class:`Strict`; the first error
becomes one line naming the dotted key path (``clip.k_ratio must be <= 1, got 1.5``), never a pydantic dump.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

StrictFloat = Annotated[float, Strict()]  # an int is accepted, a string is not
# a non-empty list (YAML/JSON have no tuples) of numbers
FloatList = Annotated[tuple[StrictFloat, ...], Field(min_length=1, strict=False)]


class Schema(BaseModel):
    """Frozen, no unknown keys, no type coercion ("3" is not 3, 1 is not true), finite floats only."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def dotted(loc: tuple[Any, ...]) -> str:
    """``("clip", "k_grid", 2)`` → ``clip.k_grid[2]``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe(error: Any) -> tuple[str, str]:
    """``(dotted path, "<path> must be …, got …")`` for one entry of ``ValidationError.errors()``."""
    path = dotted(tuple(error.get("loc") or ())) or "(top level)"
    kind, ctx, got = error.get("type", ""), error.get("ctx") or {}, error.get("input")
    musts = {
        "int_type": "an integer", "int_from_float": "an integer", "bool_type": "true or false",
        "float_type": "a number", "string_type": "a string", "dict_type": "a mapping", "model_type": "a mapping",
        "tuple_type": "a non-empty list", "list_type": "a list", "finite_number": "a finite number",
        "too_short": "a non-empty list", "string_pattern_mismatch": f"a string matching {ctx.get('pattern')}",
    }
    if kind == "extra_forbidden":
        return path, f"unknown key {path}"
    if kind == "missing":
        return path, f"{path} is missing"
    if kind in musts:
        return path, f"{path} must be {musts[kind]}, got {_short(got)}"
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        limit = next(iter(ctx.values()), "?")
        return path, f"{path} must be {bounds[kind]} {limit}, got {_short(got)}"
    if kind == "multiple_of":
        return path, f"{path} must be a multiple of {ctx.get('multiple_of')}, got {_short(got)}"
    if kind == "literal_error":
        return path, f"{path} = {_short(got)} is not one of {ctx.get('expected')}"
    if kind in ("too_long", "string_too_long"):
        return path, f"{path} is too long"
    message = str(error.get("msg", "is invalid")).removeprefix("Value error, ")
    return path, f"{path}: {message}" if path != "(top level)" else message


def first_error(exc: ValidationError) -> tuple[str, str]:
    """:func:`describe` of the first error (pydantic reports them in field order)."""
    errors = exc.errors()
    return describe(errors[0]) if errors else ("", str(exc).splitlines()[0])
