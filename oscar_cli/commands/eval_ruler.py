"""``oscar eval-ruler MODEL``: RULER's 8 NIAH tasks for each KV-cache method; table, JSON, JSONL, heatmap."""

from __future__ import annotations

import math
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
from oscar_cli.errors import EvalError
from oscar_cli.method_registry import METHOD_NAMES

EXAMPLES = """
[bold]Examples[/bold]

  oscar eval-ruler smollm2-135m --tasks niah_single_1 --ctx 1k --samples 3 --methods bf16,oscar \\
      --artifact artifacts/demo/smollm2-135m --out runs/demo-ruler   # the README demo (CPU, 1-2 minutes)
  oscar eval-ruler smollm2-135m --artifact ART --haystack-dir ~/prose --ctx 1k,2k,4k,8k --samples 50
  oscar eval-ruler smollm2-135m --artifact ART --ctx 1k,2k --seed 7   # another set of prompts (default seed 42)
  oscar eval-ruler qwen2.5-coder-1.5b --artifact ART --ctx 4k,32k,128k    # 128K runs under YaRN x4 (a note says so)
  oscar eval-ruler --ctx 128k                       # the default model under YaRN x16; no artifact: oscar is left out
  oscar --json eval-ruler smollm2-135m --tasks niah_single_1 --ctx 1k --samples 2 --methods bf16
  # rerunning the same command resumes: finished samples in OUT/samples.jsonl are skipped (those of the same
  # method and artifact, RoPE, seed and haystack)

Writes samples.jsonl, summary.json and heatmap.png to --out, by default [bold]ruler-results/<model>[/bold]
(e.g. ruler-results/smollm2-135m).
"""


def _tasks_callback(value: str) -> str:
    from oscar_cli.eval.niah import parse_tasks

    try:
        parse_tasks(value)
    except EvalError as exc:
        raise typer.BadParameter(exc.message) from None
    return value


def _fmt(x: float) -> str:
    return "—" if isinstance(x, float) and math.isnan(x) else f"{x:.1f}"


def _rope_suffix(cfg: dict[str, Any]) -> str:
    return f" (YaRN x{cfg['rope_factor']:g})" if cfg.get("rope_scaling") else ""


def render(res: dict[str, Any]) -> None:
    """The human summary: mean over tasks per method and length (+ BPE), then every task."""
    cfg = res["config"]
    lengths, tasks, methods = cfg["lengths"], cfg["tasks"], cfg["methods"]
    out = _output.stdout
    t = Table(
        title=f"RULER NIAH{_rope_suffix(cfg)}, mean string_match_all over {len(tasks)} task(s) — {res['model']['reference']} "
        f"({cfg['samples']} samples per cell)",
        title_justify="left",
    )
    t.add_column("method")
    for L in lengths:
        t.add_column(format_ctx(L), justify="right")
    for L in lengths:
        t.add_column(f"BPE {format_ctx(L)}", justify="right", style="dim")
    for m in methods:
        t.add_row(
            m,
            *(_fmt(res["mean"][m][L]) for L in lengths),
            *(f"{res['bpe'][m][L]['formula']:.2f}" for L in lengths),
        )
    out.print(t)
    d = Table(title="per task", title_justify="left")
    d.add_column("task")
    d.add_column("method")
    for L in lengths:
        d.add_column(format_ctx(L), justify="right")
    for task in tasks:
        for i, m in enumerate(methods):
            d.add_row(task if i == 0 else "", m, *(_fmt(res["scores"][m][task][L]) for L in lengths))
        d.add_section()
    out.print(d)
    if not res["complete"]:
        out.print("[bold yellow]incomplete:[/bold yellow] --time-budget reached; rerun the command to finish.")
    out.print(
        f"{res['evaluated']} samples evaluated, {res['resumed']} resumed from {res['files']['samples']}; "
        f"{res['seconds']:.0f} s. Heatmap: {res['files']['heatmap']}. BPE: stored bits per K/V element "
        "(docs/METHOD.md §9 formula at the nominal length; 16-bit BF16 tiers)."
    )


def eval_ruler(
    model: ModelArg = DEFAULT_MODEL,
    artifact: ArtifactOpt = None,
    ctx: Annotated[
        str,
        typer.Option(
            "--ctx", help="Context lengths, comma-separated: 1k,2k,4k,8k (k = 1024).", callback=ctx_list_callback
        ),
    ] = "1k,2k,4k,8k",
    tasks: Annotated[
        str, typer.Option("--tasks", help="Comma-separated NIAH tasks, or 'all'.", callback=_tasks_callback)
    ] = "all",
    methods: Annotated[
        str,
        typer.Option(
            "--methods",
            help=f"Comma-separated: {', '.join(METHOD_NAMES)}. Default: all five with --artifact, "
            "else all but oscar (it needs an artifact; a note says so).",
            callback=methods_or_default_callback,
            show_default=False,
        ),
    ] = "",
    samples: Annotated[int, typer.Option("--samples", min=1, help="Samples per task and length.")] = 50,
    haystack_dir: Annotated[
        str | None,
        typer.Option(
            "--haystack-dir",
            help="Folder of .txt prose for the essay haystacks (default: two public-domain books shipped with oscar).",
        ),
    ] = None,
    seed: Annotated[
        int,
        typer.Option("--seed", help="Seed of the prompts (needles, answers, depths, haystack offsets): another seed is "
                     "another set of prompts, kept apart from this one's in --out."),
    ] = 42,
    out: Annotated[str, typer.Option("--out", help="Output folder (samples.jsonl, summary.json, heatmap.png); default: "
                              "ruler-results/<model>, e.g. ruler-results/smollm2-135m.", show_default=False)] = "",
    rope_scaling: RopeScalingOpt = None,
    rope_factor: RopeFactorOpt = None,
    no_rope_scaling: NoRopeScalingOpt = False,
    batch_size: Annotated[
        int | None,
        typer.Option("--batch-size", min=1, help="Prompts per batch, every batch when given. Default: 4 on CPU, "
                     "~1M tokens on GPU, the run's first sample alone (its result and the ETA come early)."),
    ] = None,
    chunk_size: ChunkSizeOpt = 4096,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Greedy tokens per answer.")] = 128,
    time_budget: Annotated[
        float | None,
        typer.Option("--time-budget", min=1, help="Seconds; no new batch starts after it (rerun to resume)."),
    ] = None,
    bf16_windows: Bf16WindowsOpt = None,
    backend: BackendOpt = "auto",
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
) -> None:
    """Run RULER's NIAH tasks through each KV-cache method and score them (string_match_all)."""
    from oscar_cli.eval.niah import parse_tasks
    from oscar_cli.eval.ruler import RulerConfig, run_ruler
    from oscar_cli.method_registry import parse_windows
    from oscar_cli.model import resolve_model

    lengths = parse_ctx_list(ctx)
    if no_rope_scaling and (rope_scaling or rope_factor):
        raise typer.BadParameter("--no-rope-scaling contradicts --rope-scaling/--rope-factor", param_hint="--no-rope-scaling")
    if not out:
        from oscar_cli.artifact.manifest import model_slug

        out = f"ruler-results/{model_slug(resolve_model(model).reference)}"
    cfg = RulerConfig(
        lengths=lengths,
        tasks=parse_tasks(tasks),
        methods=methods.split(",") if methods else [],  # validated by methods_callback
        samples=samples,
        model=model,
        artifact=artifact,
        haystack_dir=haystack_dir,
        seed=seed,
        out=out,
        rope_scaling=rope_scaling,
        rope_factor=rope_factor,
        auto_rope=not no_rope_scaling,
        batch_size=batch_size,
        device=device,
        dtype=dtype,
        chunk_size=chunk_size,
        bf16_windows=parse_windows(bf16_windows),
        backend=backend,
        max_new_tokens=max_new_tokens,
        time_budget=time_budget,
    )
    res = run_ruler(cfg).to_json()
    _output.emit(res, render)


def register(app: typer.Typer) -> None:
    """Add ``oscar eval-ruler`` to the root app."""
    app.command("eval-ruler", help=eval_ruler.__doc__, epilog=EXAMPLES)(eval_ruler)
