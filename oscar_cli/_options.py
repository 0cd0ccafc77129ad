"""Shared Typer parameter aliases and parsers, so every command spells an option the same way.

Use them as annotations in a command signature::

    def calibrate(model: ModelArg = DEFAULT_MODEL, revision: RevisionOpt = None, ctx: CtxOpt = "32k") -> None:
        n_tokens = parse_ctx(ctx)

Parsers raise ``typer.BadParameter`` (usage error, exit 2) when used as Typer callbacks, and the plain
functions raise :class:`ValueError` with a one-line message for library callers.
"""

from __future__ import annotations

import re
from typing import Annotated

import typer

DEFAULT_MODEL = "smollm2-135m"

_CTX_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")
_CTX_UNITS = {"": 1, "k": 1024, "m": 1024 * 1024}


def parse_ctx(text: str | int) -> int:
    """Parse a context length: ``"128k"`` -> 131072, ``"1m"`` -> 1048576, ``"4096"`` -> 4096.

    ``k`` and ``m`` are binary (1024, 1024²), as context lengths are quoted (128K = 131072). A fractional
    value must land on a whole number of tokens (``"1.5k"`` -> 1536).

    Raises:
        ValueError: the text is not a positive whole number of tokens.
    """
    if isinstance(text, int):
        value = text
    else:
        m = _CTX_RE.match(text)
        if m is None:
            raise ValueError(f"invalid context length {text!r}: use a token count such as 4096, 32k or 128k")
        number, unit = m.group(1), m.group(2).lower()
        exact = float(number) * _CTX_UNITS[unit]
        if exact != int(exact):
            raise ValueError(f"invalid context length {text!r}: not a whole number of tokens")
        value = int(exact)
    if value <= 0:
        raise ValueError(f"invalid context length {text!r}: must be positive")
    return value


def parse_ctx_list(text: str | list[str]) -> list[int]:
    """Parse ``"4k,8k,32k"`` (or a list of such items) into sorted, de-duplicated token counts."""
    items = text.split(",") if isinstance(text, str) else [p for t in text for p in t.split(",")]
    items = [i for i in items if i.strip()]
    if not items:
        raise ValueError("empty list of context lengths: use e.g. 4k,8k,32k")
    return sorted({parse_ctx(i) for i in items})


def format_ctx(tokens: int) -> str:
    """The inverse of :func:`parse_ctx` for display: 131072 -> ``"128k"``, 1000 -> ``"1000"``."""
    if tokens % (1024 * 1024) == 0:
        return f"{tokens // (1024 * 1024)}m"
    if tokens % 1024 == 0:
        return f"{tokens // 1024}k"
    return str(tokens)


def _ctx_callback(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        parse_ctx(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


def _ctx_list_callback(value: list[str] | None) -> list[str] | None:
    if not value:
        return value
    try:
        parse_ctx_list(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


_DEVICES = re.compile(r"^(cpu|cuda|cuda:\d+|mps)$")


def _device_callback(value: str | None) -> str | None:
    if value is not None and not _DEVICES.match(value):
        raise typer.BadParameter(f"unknown device {value!r}: use cpu, cuda or cuda:N")
    return value


DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


def _dtype_callback(value: str | None) -> str | None:
    if value is not None and value.lower() not in DTYPE_NAMES:
        raise typer.BadParameter(f"unknown dtype {value!r}: use float32, bfloat16 or float16")
    return value


# The model reference (positional). Accepted forms are listed in oscar_cli.model.ACCEPTED_FORMS.
ModelArg = Annotated[
    str,
    typer.Argument(
        help="Model: an alias (smollm2-135m: embedded; qwen2.5-coder-1.5b: from its part packages), a Hub repo "
        "ORG/NAME[@REV], a local model directory, or a .gguf file.",
        show_default=True,
    ),
]
RevisionOpt = Annotated[
    str | None,
    typer.Option("--revision", help="Hub branch, tag or commit sha of the model (default: main)."),
]
DeviceOpt = Annotated[
    str | None,
    typer.Option(
        "--device", help="cpu, cuda or cuda:N (default: cuda when available).", callback=_device_callback
    ),
]
DtypeOpt = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        help="Model dtype: float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on CUDA).",
        callback=_dtype_callback,
    ),
]
CtxOpt = Annotated[
    str,
    typer.Option("--ctx", help="Context length in tokens: 4096, 32k, 128k (k = 1024).", callback=_ctx_callback),
]
CtxListOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--ctx",
        help="Context lengths, repeatable or comma-separated: --ctx 4k,8k --ctx 32k (k = 1024).",
        callback=_ctx_list_callback,
    ),
]
SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed (data sampling, initialisation).")]
