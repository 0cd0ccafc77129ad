"""Options shared by ``oscar eval-ruler`` and ``oscar eval-kl``: one definition and one help text each."""

from __future__ import annotations

from typing import Annotated

import typer

from oscar_cli._options import parse_ctx_list
from oscar_cli.errors import EvalError


def methods_callback(value: str) -> str:
    """Validate ``--methods`` once, early (usage error, exit 2, listing the valid names); returns the names
    normalised (``"bf16,oscar"``: stripped, deduplicated) so commands split it without checking again."""
    from oscar_cli.method_registry import parse_methods

    try:
        return ",".join(parse_methods(value))
    except EvalError as exc:
        raise typer.BadParameter(exc.message) from None


def methods_or_default_callback(value: str) -> str:
    """``--methods`` whose empty default means "the command's default list" (decided once --artifact is known)."""
    return methods_callback(value) if value else value


def ctx_list_callback(value: str) -> str:
    """Validate a comma-separated ``--ctx`` list (``1k,2k``; empty → usage error)."""
    try:
        parse_ctx_list(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


def backend_callback(value: str) -> str:
    """``--backend`` is ``auto``, ``reference`` or ``triton``."""
    if value not in ("auto", "reference", "triton"):
        raise typer.BadParameter(f"unknown backend {value!r}; valid backends: auto, reference, triton")
    return value


ArtifactOpt = Annotated[
    str | None,
    typer.Option("--artifact", help="OSCAR artifact (local path or hf://ORG/NAME@REV); needed by oscar."),
]
ChunkSizeOpt = Annotated[int, typer.Option("--chunk-size", min=16, help="Prefill chunk in tokens.")]
Bf16WindowsOpt = Annotated[
    str | None,
    typer.Option(
        "--bf16-windows",
        help="SINK,RECENT: override the BF16 sink/recent windows of naive-int2, quarot-int2 and oscar "
        "(e.g. 64,256: an equal-window ablation).",
    ),
]
BackendOpt = Annotated[
    str,
    typer.Option(
        "--backend",
        help="auto (triton on CUDA where the kernels serve the layer, else reference), reference (torch) or triton "
        "(INT2 writes and decode steps through oscar_kernels; CUDA only). -v logs the path each layer runs.",
        callback=backend_callback,
    ),
]
RopeScalingOpt = Annotated[
    str | None,
    typer.Option(
        "--rope-scaling",
        help="yarn: RoPE scaled beyond the model's positions (eval-ruler and eval-kl apply it by themselves when --ctx needs it).",
    ),
]
RopeFactorOpt = Annotated[
    float | None,
    typer.Option("--rope-factor", help="YaRN factor F: positions × F (default: the smallest integer >= 2 that fits)."),
]
NoRopeScalingOpt = Annotated[
    bool,
    typer.Option("--no-rope-scaling", help="Refuse lengths beyond the model's positions instead of applying YaRN."),
]
