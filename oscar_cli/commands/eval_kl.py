"""``oscar eval-kl MODEL --text FILE``: next-token KL and top-1 agreement of each method against BF16."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from oscar_cli import _output
from oscar_cli._options import DEFAULT_MODEL, DeviceOpt, DtypeOpt, ModelArg, format_ctx, parse_ctx_list
from oscar_cli.commands._eval_options import (
    ArtifactOpt,
    BackendOpt,
    Bf16WindowsOpt,
    ChunkSizeOpt,
    NoRopeScalingOpt,
    RopeFactorOpt,
    RopeScalingOpt,
    ctx_list_callback,
    methods_or_default_callback,
)
from oscar_cli.method_registry import METHOD_NAMES

EXAMPLES = """
[bold]Examples[/bold]

  oscar eval-kl smollm2-135m --text held-out.txt --artifact ART --ctx 2k --tokens 64 --windows 4
  oscar eval-kl smollm2-135m --text book.txt --methods naive-int2,quarot-int2,oscar --artifact ART --ctx 1k,4k
  oscar --json eval-kl smollm2-135m --text book.txt --methods kivi-2 --ctx 1k
  oscar eval-kl smollm2-135m --text book.txt --artifact ART --ctx 12k,16k   # beyond 8K positions: YaRN factor 2
"""


def render(res: dict[str, Any]) -> None:
    """One row per method and length: KL (nats), top-1 agreement, NLL/perplexity, BPE."""
    cfg = res["config"]
    rope = f" (YaRN x{cfg['rope_factor']:g})" if cfg.get("rope_scaling") else ""
    t = Table(
        title=f"next-token KL vs bf16 — {res['model']['reference']}{rope}, {cfg['windows']} windows × {cfg['tokens']} "
        "teacher-forced decode positions after the context",
        title_justify="left",
    )
    for col, just in (
        ("method", "left"),
        ("context", "right"),
        ("KL (nats)", "right"),
        ("top-1 agree", "right"),
        ("ppl", "right"),
        ("BPE", "right"),
    ):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for m, per_len in res["metrics"].items():
        for L, v in per_len.items():
            t.add_row(
                m,
                format_ctx(int(L)),
                f"{v['kl']:.4f}",
                f"{100 * v['top1']:.1f}%",
                f"{v['ppl']:.2f}",
                f"{res['bpe'][m][L]:.2f}",
            )
    _output.stdout.print(t)
    _output.stdout.print(f"{res['seconds']:.0f} s.")


def eval_kl(
    model: ModelArg = DEFAULT_MODEL,
    text: Annotated[str, typer.Option("--text", help="Held-out prose (plain text) to cut windows from.")] = "",
    artifact: ArtifactOpt = None,
    methods: Annotated[
        str,
        typer.Option(
            "--methods",
            help=f"Comma-separated methods of {', '.join(METHOD_NAMES)} (bf16 is always the reference). "
            "Default: naive-int2, quarot-int2, kivi-2, and oscar with --artifact.",
            callback=methods_or_default_callback,
            show_default=False,
        ),
    ] = "",
    ctx: Annotated[
        str,
        typer.Option("--ctx", help="Context lengths before the scored tokens (k = 1024).", callback=ctx_list_callback),
    ] = "2k",
    tokens: Annotated[int, typer.Option("--tokens", min=1, help="Teacher-forced decode positions M per window.")] = 64,
    windows: Annotated[int, typer.Option("--windows", min=1, help="Windows N cut from the text.")] = 4,
    chunk_size: ChunkSizeOpt = 4096,
    bf16_windows: Bf16WindowsOpt = None,
    backend: BackendOpt = "auto",
    rope_scaling: RopeScalingOpt = None,
    rope_factor: RopeFactorOpt = None,
    no_rope_scaling: NoRopeScalingOpt = False,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
) -> None:
    """KL divergence and top-1 agreement of each method's next-token distributions against BF16."""
    from oscar_cli.eval.kl import KLConfig, run_kl
    from oscar_cli.method_registry import parse_windows

    if not text:
        raise typer.BadParameter("--text FILE is required (held-out prose)", param_hint="--text")
    if no_rope_scaling and (rope_scaling or rope_factor):
        raise typer.BadParameter("--no-rope-scaling contradicts --rope-scaling/--rope-factor", param_hint="--no-rope-scaling")
    cfg = KLConfig(
        text=text,
        lengths=parse_ctx_list(ctx),
        methods=methods.split(",") if methods else [],  # validated by methods_or_default_callback
        tokens=tokens,
        windows=windows,
        model=model,
        artifact=artifact,
        device=device,
        dtype=dtype,
        chunk_size=chunk_size,
        bf16_windows=parse_windows(bf16_windows),
        backend=backend,
        rope_scaling=rope_scaling,
        rope_factor=rope_factor,
        auto_rope=not no_rope_scaling,
    )
    res = run_kl(cfg).to_json()
    _output.emit(res, render)


def register(app: typer.Typer) -> None:
    """Add ``oscar eval-kl`` to the root app."""
    app.command("eval-kl", help=eval_kl.__doc__, epilog=EXAMPLES)(eval_kl)
