"""The ``oscar`` root (version, help, usage errors, the OscarError funnel), shared options and ``oscar info``.

Errors are checked through ``oscar_cli.main.main`` (the console-script entry point with the funnel), output
through ``CliRunner`` on the real app. ``oscar info`` runs for real on a tiny random model directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from oscar_cli import __version__
from oscar_cli._options import format_ctx, parse_ctx, parse_ctx_list
from oscar_cli.main import app, main


def _run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the console entry point; return (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    code = e.value.code
    return (code if isinstance(code, int) else 1), out, err


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "tokens"),
    [("4096", 4096), ("4k", 4096), ("128K", 131072), ("1m", 1 << 20), (" 32k ", 32768), ("1.5k", 1536), (7, 7)],
)
def test_parse_ctx(text: str | int, tokens: int) -> None:
    assert parse_ctx(text) == tokens


@pytest.mark.unit
@pytest.mark.parametrize("text", ["", "k", "12q", "-4k", "0", "1.0001k", "4 kb"])
def test_parse_ctx_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="context length"):
        parse_ctx(text)


@pytest.mark.unit
def test_ctx_list_and_format() -> None:
    assert parse_ctx_list("8k,4k,,8192") == [4096, 8192]
    assert parse_ctx_list(["1k,2k", "128k"]) == [1024, 2048, 131072]
    with pytest.raises(ValueError):
        parse_ctx_list(" , ")
    for n in (1, 1000, 4096, 131072, 3 << 20):
        assert parse_ctx(format_ctx(n)) == n
    assert format_ctx(131072) == "128k" and format_ctx(1000) == "1000"


@pytest.mark.unit
def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.strip() == f"oscar {__version__}"
    r = CliRunner().invoke(app, ["--help"])
    assert r.exit_code == 0 and "Examples" in r.stdout and "info" in r.stdout and "--json" in r.stdout
    r = CliRunner().invoke(app, ["info", "--help"])
    assert r.exit_code == 0 and "Examples" in r.stdout and "--no-load" in r.stdout
    assert app.pretty_exceptions_show_locals is False  # tracebacks must never print locals (tokens)


@pytest.mark.unit
@pytest.mark.parametrize(
    "argv",
    [["no-such-command"], ["--no-such-flag"], ["info", "--ctx", "12q"], ["info", "--dtype", "int3"],
     ["info", "--device", "gpu"], ["info", "a", "b"]],
    ids=["command", "flag", "ctx", "dtype", "device", "extra-arg"],
)  # fmt: skip
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run_main(argv, capsys)
    assert code == 2 and out == ""
    code, out, err = _run_main(["--json", *argv], capsys)
    doc = json.loads(out)
    assert code == 2 and set(doc) == {"error"} and set(doc["error"]) == {"type", "message", "hint"}, out
    assert doc["error"]["message"][:12] in err  # the human message (a rich panel) is still on stderr
    assert doc["error"]["hint"].startswith("see 'oscar")


@pytest.mark.unit
@pytest.mark.parametrize("args", [["--json"], ["-v"], ["-vv"], ["--verbose"], ["--json", "-v"]], ids=str)
def test_global_options_are_accepted_after_every_subcommand(args: list[str]) -> None:
    """``oscar CMD --json`` = ``oscar --json CMD`` for every registered command (parsed, not run)."""
    import typer.main

    from oscar_cli._output import SETTINGS
    from oscar_cli.main import hoist_global_options

    root = typer.main.get_command(app)
    for name in root.commands:  # type: ignore[attr-defined]
        for argv in ([name, *args, "--help"], [*args, name, "--help"]):
            r = CliRunner().invoke(app, argv)
            assert r.exit_code == 0 and "Usage" in r.stdout, (argv, r.output)
        ctx = root.make_context("oscar", hoist_global_options([name, *args]), resilient_parsing=False)
        assert ctx.params["json_out"] == ("--json" in args) == SETTINGS.json
        assert ctx.params["verbose"] == sum(a.count("v") if a != "--verbose" else 1 for a in args if a != "--json")
    assert hoist_global_options(["info", "x", "--json", "--", "--json", "-v"]) == ["--json", "info", "x", "--",
                                                                                   "--json", "-v"]


@pytest.mark.unit
def test_json_after_the_subcommand_runs_the_command_in_json_mode(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run_main(["info", "no-such-model", "--json", "-v"], capsys)
    assert code == 1 and json.loads(out)["error"]["type"] == "ModelResolutionError"
    code, out, _ = _run_main(["info", "--no-load", "--bogus", "--json"], capsys)
    assert code == 2 and json.loads(out)["error"] == {"type": "NoSuchOption", "message": "No such option: --bogus",
                                                       "hint": "see 'oscar info --help'"}


@pytest.mark.unit
def test_oscar_error_is_one_line_plus_hint(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OSCAR_DEBUG", raising=False)
    code, out, err = _run_main(["--json", "info", "no-such-model"], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 2, err
    doc = json.loads(out)  # under --json the error is also one JSON document on stdout
    assert doc == {"error": {"type": "ModelResolutionError", "message": lines[0].removeprefix("error: "),
                             "hint": lines[1].removeprefix("hint: ")}}
    assert lines[0].startswith("error: unknown model reference 'no-such-model'")
    assert "ORG/NAME[@REV]" in lines[0]  # rich markup in messages is escaped, not swallowed
    assert lines[1].startswith("hint: ") and "OSCAR_DEBUG=1" in lines[1]
    monkeypatch.setenv("OSCAR_DEBUG", "1")
    code, _, err = _run_main(["info", "no-such-model"], capsys)
    assert code == 1 and "Traceback (most recent call last)" in err and "ModelResolutionError" in err


@pytest.mark.unit
def test_info_json_on_a_local_model(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from oscar_kernels.reference import bits_per_element

    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path / "cache"))
    r = CliRunner().invoke(app, ["--json", "info", str(tiny_model_dir), "--ctx", "4k,32k", "-g", "16", "-g", "8"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["model"]["kind"] == "dir" and doc["model"]["resolved"].startswith("sha256:")
    assert doc["architecture"]["head_dim"] == 16 and doc["architecture"]["num_key_value_heads"] == 2
    assert doc["supported"] is True and doc["loaded"]["source"] == "directory"
    assert doc["loaded"]["dtype"] == "float32" and doc["loaded"]["parameters"] > 0
    rows = doc["bpe"]["rows"]
    assert [(x["ctx"], x["group_size"]) for x in rows] == [(4096, 16), (4096, 8), (32768, 16), (32768, 8)]
    for x in rows:
        bpe = bits_per_element(x["ctx"], head_dim=16, group_size=x["group_size"])
        assert x["bits_per_element"] == bpe
        assert x["kv_bytes_bf16"] == 2 * 2 * 2 * 16 * x["ctx"] * 2  # K+V, 2 layers, 2 KV heads, D 16, 2 bytes
    # The human table on stdout; config-only mode does not load weights.
    r = CliRunner().invoke(app, ["info", str(tiny_model_dir), "--no-load", "--ctx", "512"])
    assert r.exit_code == 0 and "BPE G=16" in r.stdout and "512*" in r.stdout  # 512 > the model's 256 positions
    assert "loaded" not in r.stdout


@pytest.mark.unit
def test_info_group_size_must_divide_head_dim(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path / "cache"))
    code, _, err = _run_main(["info", str(tiny_model_dir), "--no-load", "-g", "12"], capsys)
    assert code == 1 and "group size 12 does not divide head_dim 16" in err


@pytest.mark.unit
def test_calibrate_checks_the_data_file_before_the_budget_and_names_seq_len(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    missing = str(tmp_path / "nonexistent.txt")
    code, _, err = _run_main(["calibrate", str(tiny_model_dir), "--data", missing, "--tokens", "1k"], capsys)
    assert code == 1 and f"error: calibration data {missing} not found" in err and "token budget" not in err
    code, out, err = _run_main(["calibrate", str(tiny_model_dir), "--tokens", "1k", "--json"], capsys)
    doc = json.loads(out)["error"]
    assert code == 1 and doc["type"] == "CalibrationError" and doc["message"].startswith("token budget 1024")
    assert "lower --seq-len" in doc["hint"] and f"hint: {doc['hint']}" in err
    assert not (tmp_path / "artifacts").exists()
