"""``oscar calibrate MODEL``: attention-aware rotations, means and clip ratios → a versioned local artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from oscar_cli import _output
from oscar_cli._options import DEFAULT_MODEL, DeviceOpt, DtypeOpt, ModelArg, RevisionOpt, parse_ctx
from oscar_cli.commands._eval_options import RopeFactorOpt, RopeScalingOpt

EXAMPLES = """
[bold]Examples[/bold]

  oscar calibrate                              # embedded smollm2-135m, its recipe: 24K self-generated tokens (3 x 8K)
  oscar calibrate smollm2-135m --tokens 4k --seq-len 1024   # small budget, short sequences (the README demo)
  oscar calibrate Qwen/Qwen3-8B --device cuda  # recipes/qwen3-8b.yaml, bf16 on the GPU
  oscar calibrate ./my-model --data ./corpus/  # local text/JSON(L) files or folder
  oscar calibrate smollm2-135m --data hf:wikitext:wikitext-2-raw-v1   # Hub dataset
  oscar calibrate --recipe my.yaml --out artifacts/try1 --overwrite
  oscar calibrate --tokens 4k --seq-len 1024 --json # result (path, clips, timings) as JSON on stdout
  oscar calibrate qwen2.5-coder-1.5b --rope-scaling yarn --rope-factor 4   # under the YaRN eval-ruler uses at 128K
  oscar calibrate qwen2.5-coder-1.5b --device cuda   # its recipe: keys centred by position, 8 INT4-key layers, 8-bit meta
  oscar calibrate qwen2.5-coder-1.5b --device cuda --int4-keys 0 --meta-bits 16   # 2-bit keys, 16-bit scale/zero
  oscar calibrate qwen2.5-coder-1.5b --device cuda --key-mean constant   # one key mean: a faster decode
  oscar calibrate smollm2-135m --int4-keys 3   # 4-bit keys on the 3 layers of largest copy score
  oscar calibrate Qwen/Qwen3-8B --meta-bits 8   # one-byte scale and zero per row (quant.meta_dtype uint8)

Writes [bold]artifacts/<model>/<recipe>-<hash>[/bold] unless --out says otherwise, e.g.
artifacts/smollm2-135m/smollm2-135m-e1fda680 (the hash covers the model, the recipe and the data).
"""


def _progress_reporter(p: Any) -> Any:
    tasks: dict[str, Any] = {}
    labels = {"data": "data", "capture": "capture", "solve": "solve", "clip": "clip search", "write": "write"}

    def report(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = p.add_task(labels.get(phase, phase), total=total)
        p.update(tasks[phase], completed=done, total=total)

    return report


def _render(result: Any) -> None:
    out = _output.stdout
    d = result.to_dict()
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column(overflow="fold")
    facts.add_row("artifact", d["artifact"])
    facts.add_row("model", f"{d['model']['reference']} ({d['model']['resolved']})")
    facts.add_row("method", f"{d['method']}, recipe {d['recipe']}")
    data = d["data"]
    gen = f", generated at {d['generation_tokens_per_s']:.0f} tokens/s" if d["generation_tokens_per_s"] else ""
    facts.add_row("data", f"{data['source']}: {data['tokens']} tokens in {data['sequences']} x {data['seq_len']}{gen}")
    t = d["timings_s"]
    facts.add_row("timings", ", ".join(f"{k} {v:.1f} s" for k, v in t.items())
                  + f" (capture+solve+clip {t['capture'] + t['solve'] + t['clip']:.1f} s)")
    out.print(facts)
    table = Table(title="per layer: eigenvalue spread (λmax/λmean), chosen clip ratios, held-out output error",
                  title_justify="left")
    for col in ("layer", "K spread", "V spread", "K clip", "V clip", "rel. error"):
        table.add_column(col, justify="right")
    for row in d["layers"]:
        err = row["clip_error"]
        table.add_row(str(row["index"]), f"{row['k_spread']:.2f}", f"{row['v_spread']:.2f}",
                      f"{row['k_clip']:g}", f"{row['v_clip']:g}", "-" if err is None else f"{err:.4f}")
    out.print(table)
    _render_schemes(d.get("schemes"), d["layers"])
    for knob, what, where in (("bf16_keys", "keys in BF16", "reference path"),
                              ("int4_keys", "keys in INT4", "transformers and vLLM")):
        if d.get(knob) is None:
            continue
        scores = {row["index"]: row["copy_score"] for row in d["layers"]}
        text = ", ".join(f"{i} (copy score {scores[i]:.4f})" for i in d[knob]) or "none (no INT2 key flipped a focused head)"
        out.print(f"{what} (quant.{knob}, {where}): layers {text}")


def _render_schemes(schemes: dict[str, Any] | None, layers: list[dict[str, Any]]) -> None:
    """One line per layer the artifact serves with another scheme, and the comparison with the baseline (a
    worse artifact is also warned about on stderr by the library, under --json too)."""
    if not schemes:
        return
    out = _output.stdout
    for row in layers:
        if row["scheme"] != "oscar":
            errors = ", ".join(f"{k} {v:.4f}" for k, v in row["scheme_errors"].items())
            out.print(f"layer {row['index']}: served as {row['scheme']} (held-out error {errors})")
    bpe = schemes["bits_per_element"]
    out.print(f"held-out error (mean over layers): artifact {schemes['artifact_error']:.4f}, oscar alone "
              f"{schemes['oscar_error']:.4f}, {schemes['baseline']} baseline {schemes['baseline_error']:.4f}; "
              f"bits per element at {schemes['bpe_context'] // 1024}K: {bpe['artifact']:.3f} "
              f"(all INT2 {bpe['all_int2']:.3f})")


def calibrate(
    model: ModelArg = DEFAULT_MODEL,
    recipe: Annotated[
        str | None,
        typer.Option("--recipe", help="A shipped recipe name (defaults, qwen3-8b, ...) or a YAML file. "
                     "Default: the shipped per-model recipe matching MODEL, else defaults."),
    ] = None,
    data: Annotated[
        str | None,
        typer.Option("--data", help="Calibration data: self (model-generated), a text/JSON(L) file or folder, "
                     "or hf:<dataset>[:<config>]. Overrides the recipe's data.source."),
    ] = None,
    tokens: Annotated[
        str | None, typer.Option("--tokens", help="Token budget, e.g. 16k (statistics + held-out).")
    ] = None,
    seq_len: Annotated[
        int | None, typer.Option("--seq-len", min=8, help="Tokens per calibration sequence (recipe data.seq_len).")
    ] = None,
    seed: Annotated[
        int | None, typer.Option("--seed", help="Seed for generation, sampling and the sst reservoir (data.seed).")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Artifact directory (default: artifacts/<model>/<recipe>-<hash>, e.g. "
                     "artifacts/smollm2-135m/smollm2-135m-e1fda680)."),
    ] = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    revision: RevisionOpt = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing artifact at --out.")] = False,
    rope_scaling: RopeScalingOpt = None,
    rope_factor: RopeFactorOpt = None,
    key_mean: Annotated[
        str | None, typer.Option("--key-mean", help="constant | rope: centre INT2 keys by one mean, or by their "
                                 "position's RoPE_p(m_pre) (recipe quant.key_mean; default: the recipe's, rope for "
                                 "qwen2.5-coder-1.5b; rope: lower KL at long context, 1.4-1.8x the decode attention time; "
                                 "docs/RESULTS.md).")
    ] = None,
    int4_keys: Annotated[
        int | None, typer.Option("--int4-keys", min=0, max=1024,
                                 help="Store the history keys of the N layers of largest copy score at 4 bits "
                                 "(recipe quant.int4_keys; +2 bits per history key of those layers; served through "
                                 "transformers and the vLLM backend; SmolLM2-135M, N = 3: "
                                 "+13 / +27 RULER points at 1K / 2K for +0.10 bits per element; docs/RESULTS.md).")
    ] = None,
    meta_bits: Annotated[
        int | None, typer.Option("--meta-bits", help="16 | 8: bits of each INT2 row's scale and of its zero (recipe "
                                 "quant.meta_dtype bfloat16 | uint8; 8: docs/METHOD.md §6, 0.125 fewer bits per "
                                 "element at head_dim 128, 0.25 at 64).")
    ] = None,
    strict: Annotated[
        bool, typer.Option("--strict", help="Fail (and write nothing) when the artifact's held-out error is worse "
                           "than the KIVI baseline's on the same tokens.")
    ] = False,
) -> None:
    """Calibrate OSCAR rotations, centering means and clip ratios for MODEL; write a versioned artifact."""
    from oscar_cli.artifact import model_slug
    from oscar_cli.calibration.run import calibrate as run_calibrate
    from oscar_cli.recipe import load_recipe, recipe_for_model

    overrides: dict[str, Any] = {}
    if data is not None:
        overrides.setdefault("data", {})["source"] = data
    if tokens is not None:
        try:
            overrides.setdefault("data", {})["tokens"] = parse_ctx(tokens)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--tokens") from None
    if seq_len is not None:
        overrides.setdefault("data", {})["seq_len"] = seq_len
    if seed is not None:
        overrides.setdefault("data", {})["seed"] = seed
    if key_mean is not None:
        if key_mean not in ("constant", "rope"):
            raise typer.BadParameter(f"must be constant or rope, got {key_mean!r}", param_hint="--key-mean")
        overrides.setdefault("quant", {})["key_mean"] = key_mean
    if int4_keys is not None:
        overrides.setdefault("quant", {})["int4_keys"] = int4_keys
    if meta_bits is not None:
        if meta_bits not in (8, 16):
            raise typer.BadParameter(f"must be 16 or 8, got {meta_bits}", param_hint="--meta-bits")
        overrides.setdefault("quant", {})["meta_dtype"] = "uint8" if meta_bits == 8 else "bfloat16"
    recipe_obj = load_recipe(recipe or recipe_for_model(model_slug(model)), overrides)
    _output.info(f"calibrating {model} with recipe {recipe_obj.name} ({recipe_obj.method}, "
                 f"{recipe_obj.data.tokens} tokens from {recipe_obj.data.source})")
    with _output.progress(log="calibrate") as p:
        result = run_calibrate(model, recipe=recipe_obj, device=device, dtype=dtype, revision=revision, out=out,
                               overwrite=overwrite, report=_progress_reporter(p), rope_scaling=rope_scaling,
                               rope_factor=rope_factor, strict=strict)
    _output.emit(result.to_dict(), lambda _: _render(result))


def register(app: typer.Typer) -> None:
    """Add ``oscar calibrate`` to the root app."""
    app.command("calibrate", help=calibrate.__doc__, epilog=EXAMPLES, no_args_is_help=False)(calibrate)
