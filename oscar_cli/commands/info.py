"""``oscar info [MODEL]``: resolve and load a model; print its identity, architecture and INT2 memory table."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Annotated, Any

import typer
from rich.table import Table

from oscar_cli import _output
from oscar_cli._options import (
    DEFAULT_MODEL,
    CtxListOpt,
    DeviceOpt,
    DtypeOpt,
    ModelArg,
    RevisionOpt,
    format_ctx,
    parse_ctx_list,
)

EXAMPLES = """
[bold]Examples[/bold]

  oscar info                                    # the embedded smollm2-135m (converted once, then seconds)
  oscar info Qwen/Qwen3-8B --no-load            # config only: architecture and memory table, no weights
  oscar info ./my-model --ctx 32k,128k -g 128   # a local directory, chosen lengths and group size
  oscar --json info smollm2-135m                # the same report as one JSON document on stdout
"""


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def _render(report: dict[str, Any]) -> None:
    m, fp, loaded = report["model"], report["architecture"], report["loaded"]
    out = _output.stdout
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column(overflow="fold")  # never truncate a sha or a path
    facts.add_row("model", m["reference"])
    facts.add_row("kind", m["kind"])
    facts.add_row("resolved", m["resolved"])
    facts.add_row("path", m["path"])
    if loaded:
        facts.add_row(
            "loaded",
            f"{loaded['parameters'] / 1e6:.1f}M parameters, {loaded['dtype']} on {loaded['device']}, "
            f"{loaded['seconds']:.1f} s (from {loaded['source']})",
        )
    g = fp["num_attention_heads"] // fp["num_key_value_heads"]
    facts.add_row(
        "architecture",
        f"{fp['model_type']}: {fp['num_layers']} layers, {fp['num_attention_heads']} query / "
        f"{fp['num_key_value_heads']} KV heads (group {g}), head_dim {fp['head_dim']}, "
        f"RoPE {fp['rope_type']} theta {fp['rope_theta']:g}, {fp['max_position_embeddings']} positions"
        if fp["rope_theta"] is not None
        else f"{fp['model_type']}: {fp['num_layers']} layers, no RoPE",
    )
    supported = "yes" if report["supported"] else "no: " + "; ".join(report["unsupported_reasons"])
    facts.add_row("INT2 cache", supported)
    out.print(facts)

    bpe = report["bpe"]
    groups = sorted({r["group_size"] for r in bpe["rows"]}, reverse=True)
    table = Table(
        title=f"INT2 bits per element and KV cache size (BF16 sink {bpe['sink']} + recent {bpe['recent']}, "
        f"{bpe['meta_bits']}-bit scale/zero)",
        title_justify="left",
    )
    table.add_column("context", justify="right")
    for gs in groups:
        table.add_column(f"BPE G={gs}", justify="right")
    table.add_column("KV MiB BF16", justify="right")
    table.add_column(f"KV MiB INT2 G={groups[0]}", justify="right")
    by_ctx: dict[int, dict[int, dict[str, Any]]] = {}
    for r in bpe["rows"]:
        by_ctx.setdefault(r["ctx"], {})[r["group_size"]] = r
    max_pos = fp["max_position_embeddings"]
    for ctx, cells in by_ctx.items():
        first = cells[groups[0]]
        beyond = max_pos is not None and ctx > max_pos
        if beyond:
            table.caption = f"* beyond the model's {max_pos} positions (the arithmetic still holds)"
        table.add_row(
            format_ctx(ctx) + ("*" if beyond else ""),
            *(f"{cells[gs]['bits_per_element']:.4f}" for gs in groups),
            _mib(first["kv_bytes_bf16"]),
            _mib(first["kv_bytes_int2"]),
        )
    out.print(table)


def info(
    model: ModelArg = DEFAULT_MODEL,
    revision: RevisionOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    ctx: CtxListOpt = None,
    group_size: Annotated[
        list[int] | None,
        typer.Option("--group-size", "-g", help="Quantization group sizes G (divide head_dim); repeatable."),
    ] = None,
    load: Annotated[
        bool, typer.Option("--load/--no-load", help="Load the weights (default) or read the config only.")
    ] = True,
) -> None:
    """Resolve and load a model; print its identity, architecture and the INT2 bits-per-element table."""
    from oscar_cli.model.report import model_report

    ctxs = parse_ctx_list(ctx) if ctx else None
    what = "loading" if load else "reading the config of"
    status = _output.stderr.status(f"{what} {model}") if _output.progress_enabled() else nullcontext()
    with status:
        report = model_report(
            model, revision=revision, device=device, dtype=dtype, load=load, ctxs=ctxs, group_sizes=group_size
        )
    _output.emit(report, _render)


def register(app: typer.Typer) -> None:
    """Add ``oscar info`` to the root app."""
    app.command("info", help=info.__doc__, epilog=EXAMPLES, no_args_is_help=False)(info)
