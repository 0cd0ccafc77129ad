"""``oscar generate MODEL``: generate text through an oscar KV cache, streaming tokens; metrics on stderr."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from oscar_cli import _output
from oscar_cli._options import DEFAULT_MODEL, DeviceOpt, DtypeOpt, ModelArg
from oscar_cli.commands._eval_options import ArtifactOpt
from oscar_cli.errors import OscarError

EXAMPLES = """
[bold]Examples[/bold]

  oscar generate smollm2-135m --method bf16 --prompt "Name three rivers." --max-new-tokens 32
  oscar generate smollm2-135m --artifact ART --prompt-file question.txt
  echo "Write a haiku about caches." | oscar generate smollm2-135m --method kivi-2
  oscar --json generate smollm2-135m --method naive-int2 --prompt "Hello" --temperature 0.7 --seed 1
"""


def _prompts(prompt: list[str] | None, prompt_file: Path | None) -> list[str]:
    if prompt and prompt_file is not None:
        raise typer.BadParameter("give --prompt or --prompt-file, not both", param_hint="--prompt")
    if prompt:
        return list(prompt)
    if prompt_file is not None:
        if not prompt_file.is_file():
            raise OscarError(f"--prompt-file {prompt_file}: no such file")
        return [prompt_file.read_text(encoding="utf-8", errors="replace")]
    if sys.stdin.isatty():
        raise OscarError("no prompt given", hint="use --prompt TEXT, --prompt-file FILE or pipe text on stdin")
    return [sys.stdin.read()]


def _metrics_line(m: dict[str, Any]) -> str:
    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{1000 * x:.1f} ms"

    return (f"{m['method']} ({m['path']} path) on {m['device']}: TTFT {ms(m['ttft_s'])}, TPOT {ms(m['tpot_s'])}, "
            f"KV {m['kv_bytes_per_token']:.0f} B/token ({m['kv_bytes'] / 2**20:.2f} MiB stored, "
            f"{m['kv_allocated_bytes'] / 2**20:.2f} MiB allocated), peak memory {m['peak_memory_bytes'] / 2**20:.0f} MiB "
            f"({m['peak_memory_kind']})")


def generate(
    model: ModelArg = DEFAULT_MODEL,
    artifact: ArtifactOpt = None,
    method: Annotated[
        str, typer.Option("--method", help="KV method: oscar (needs --artifact), bf16, naive-int2, quarot-int2, kivi-2.")
    ] = "oscar",
    prompt: Annotated[
        list[str] | None, typer.Option("--prompt", "-p", help="Prompt text (repeat for a batch of prompts).")
    ] = None,
    prompt_file: Annotated[Path | None, typer.Option("--prompt-file", help="Read the prompt from a file.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="0: greedy; > 0: sampling.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sampler.")] = 0,
    no_chat: Annotated[
        bool, typer.Option("--no-chat", help="Do not apply the tokenizer's chat template (raw prompt).")
    ] = False,
    backend: Annotated[
        str,
        typer.Option("--backend", help="auto (Triton kernels on CUDA where they apply), reference (torch) or triton."),
    ] = "auto",
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
) -> None:
    """Generate text with a model whose KV cache runs a method (oscar INT2 by default), streaming the tokens.

    Metrics go to stderr: time to first token, time per output token, KV bytes per token, peak memory; -v says
    which path runs (triton or reference). --json prints one object with the text and the metrics instead.
    """
    from oscar_cli.textgen import GenerateConfig, generate_text

    if backend not in ("auto", "reference", "triton"):
        raise typer.BadParameter(f"unknown backend {backend!r}; valid: auto, reference, triton", param_hint="--backend")
    cfg = GenerateConfig(
        prompts=_prompts(prompt, prompt_file), model=model, artifact=artifact, method=method,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, chat=not no_chat,
        backend=backend, device=device, dtype=dtype,
    )
    stream = None if _output.SETTINGS.json else _write
    res = generate_text(cfg, on_text=stream)
    if _output.SETTINGS.json:
        _output.emit_json(res.to_json())
        return
    if len(res.texts) > 1:
        for i, text in enumerate(res.texts):
            _output.stdout.print(f"[bold]--- prompt {i + 1}[/bold]")
            _output.stdout.print(text, markup=False, highlight=False)
    _output.stderr.print(_metrics_line(res.metrics), markup=False, highlight=False)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def register(app: typer.Typer) -> None:
    """Add ``oscar generate`` to the root app."""
    app.command("generate", help=generate.__doc__, epilog=EXAMPLES)(generate)
