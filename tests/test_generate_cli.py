"""``oscar generate``: streaming, metrics, --json, prompts from flags/files/stdin, one-line errors at the limits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers.fakehub.artifacts import make_artifact
from typer.testing import CliRunner

from oscar_cli import textgen
from oscar_cli.main import app, main

pytestmark = pytest.mark.unit
runner = CliRunner()


def flat(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("│", " "))


def test_json_has_text_tokens_and_metrics(tiny_model_dir: Path) -> None:
    res = runner.invoke(app, ["--json", "generate", str(tiny_model_dir), "--method", "naive-int2", "-p", "w1 w2 w3",
                              "-p", "w5", "--max-new-tokens", "5"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert len(out["texts"]) == 2 and all(len(t) <= 5 for t in out["new_tokens"])
    m = out["metrics"]
    assert m["path"] == "reference" and m["method"] == "naive-int2" and m["new_tokens"] == 5
    assert m["ttft_s"] > 0 and m["tpot_s"] > 0 and m["kv_allocated_bytes"] >= m["kv_bytes"] > 0
    assert m["kv_tokens"] == 2 * (3 + 5 - 1) and m["peak_memory_bytes"] > 0


def test_streams_to_stdout_and_reports_on_stderr_from_stdin(tiny_model_dir: Path) -> None:
    res = runner.invoke(app, ["generate", str(tiny_model_dir), "--method", "quarot-int2", "--max-new-tokens", "4",
                              "--temperature", "0.8", "--seed", "3"], input="w7 w8 w9 w10")
    assert res.exit_code == 0, res.output
    assert "TTFT" in res.stderr and "TPOT" in res.stderr and "B/token" in res.stderr and "peak memory" in res.stderr
    again = runner.invoke(app, ["generate", str(tiny_model_dir), "--method", "quarot-int2", "--max-new-tokens", "4",
                                "--temperature", "0.8", "--seed", "3"], input="w7 w8 w9 w10")
    assert again.stdout == res.stdout  # the seed fixes the sample


def test_streamed_text_is_the_generated_text(tiny_loaded) -> None:
    pieces: list[str] = []
    cfg = textgen.GenerateConfig(prompts=["abc abc"], method="bf16", max_new_tokens=6)
    res = textgen.generate_text(cfg, loaded=tiny_loaded, on_text=pieces.append)
    assert "".join(pieces) == res.texts[0] + "\n" and len(res.new_tokens[0]) <= 6


def one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the console entry point; assert exit 1 with ``error: ...`` + ``hint: ...``; return the error line."""
    code: object = 0
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), lines
    return lines[0]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--prompt", " ".join(["w3"] * 300)], "prompt of 300 tokens + 2 new tokens is beyond the model's 256 positions"),
        (["--method", "oscar", "--prompt", "w1"], "needs --artifact"),
        (["--method", "naive-int2", "--backend", "triton", "--prompt", "w1"], "backend triton: the decode kernel takes"),
        (["--method", "bf16", "-p", "w1 w2", "-p", "w3", "--max-new-tokens", "50"],
         "the bf16 KV cache of 2 x 52 tokens needs 0.00 GiB, 0.00 GiB are free on cpu"),
    ],
    ids=["positions", "no-artifact", "triton-on-fp32", "batch-too-big"],
)
def test_bad_input_is_one_line_naming_the_limit(
    tiny_model_dir: Path, args: list[str], needle: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(textgen, "free_memory", lambda device: 1000)  # 1000 bytes free: only a tiny cache fits
    monkeypatch.delenv("OSCAR_DEBUG", raising=False)
    line = one_line_error(["generate", str(tiny_model_dir), "--max-new-tokens", "2", *args], capsys)
    assert needle in line, line


def test_artifact_for_another_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from helpers.tiny import write_tiny_model

    art = make_artifact(tmp_path)  # made for 2 layers
    other = write_tiny_model(tmp_path / "three-layers", layers=3)
    capsys.readouterr()  # save_pretrained's progress bar
    line = one_line_error(["generate", str(other), "--artifact", str(art), "--prompt", "w1"], capsys)
    assert "another model" in line, line


def test_bf16_has_no_kernel_path_and_runs_with_backend_triton(tiny_model_dir: Path) -> None:
    res = runner.invoke(app, ["--json", "generate", str(tiny_model_dir), "--method", "bf16", "--backend", "triton",
                              "--prompt", "w1", "--max-new-tokens", "2"])
    assert res.exit_code == 0 and json.loads(res.stdout)["metrics"]["path"] == "dense", res.output


@pytest.mark.slow
def test_embedded_model_generates_a_few_tokens() -> None:
    res = runner.invoke(app, ["--json", "generate", "smollm2-135m", "--method", "naive-int2", "--prompt",
                              "The capital of France is", "--max-new-tokens", "3", "--dtype", "float32"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["metrics"]["new_tokens"] == 3 and out["texts"][0]
