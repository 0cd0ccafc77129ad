"""``oscar bench --kernel KEY=VALUE,...``: decode-kernel knobs on the command line, checked against
:class:`oscar_kernels.ops.DecodeConfig` before anything runs.

Every ``DecodeConfig`` field can be set (``hist_stages=2``, ``maxnreg=128``, ``pdl=false``, ``merge_cols=128`` ...);
fields not named keep ``default_config(batch)``. Values: integers, ``true``/``false`` for flags, ``none`` for
optional integers and flags (``meta_words=none``: the kernel's own choice), words for text fields
(``rope_prec=tf32x3``). Whether a combination is legal (e.g. ``block_n`` a power of two >= 64 on a GPU) is checked
by the kernels' own validation when the bench builds its launch plan.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _fields() -> dict[str, tuple[Any, bool]]:
    """Each DecodeConfig field's default and whether it is a flag (``bool`` or ``bool | None``)."""
    from oscar_kernels.ops import DecodeConfig

    base, hints = DecodeConfig(), typing.get_type_hints(DecodeConfig)
    return {f.name: (getattr(base, f.name), bool in (typing.get_args(hints[f.name]) or (hints[f.name],)))
            for f in dataclasses.fields(DecodeConfig)}


def parse_kernel_options(text: str | None) -> tuple[tuple[str, Any], ...]:
    """``"hist_stages=4,maxnreg=none,pdl=false"`` → ``(("hist_stages", 4), ("maxnreg", None), ("pdl", False))``.

    Raises ValueError naming the bad item and the allowed keys.
    """
    if not text:
        return ()
    fields = _fields()
    out: dict[str, Any] = {}
    for item in text.split(","):
        key, sep, raw = (s.strip() for s in item.partition("="))
        if not sep or not key or not raw:
            raise ValueError(f"expected KEY=VALUE, got {item.strip()!r}")
        if key not in fields:
            raise ValueError(f"unknown kernel option {key!r}; known: {', '.join(sorted(fields))}")
        (default, flag), low = fields[key], raw.lower()
        if flag and low == "none" and default is None:
            value: Any = None
        elif flag:
            if low not in _TRUE | _FALSE:
                raise ValueError(f"{key} takes true or false{' or none' if default is None else ''}, got {raw!r}")
            value = low in _TRUE
        elif isinstance(default, str):
            value = raw
        elif low == "none":
            if default is not None:
                raise ValueError(f"{key} cannot be none")
            value = None
        else:
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"{key} takes an integer, got {raw!r}") from None
        if key in out:
            raise ValueError(f"{key} given twice")
        out[key] = value
    return tuple(out.items())
