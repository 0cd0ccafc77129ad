"""``oscar export`` / ``oscar pull`` through the real CLI entry point (``oscar_cli.main.main``), against the
fake Hub: stdout contract, --json, --dry-run, one-line errors, and token hygiene."""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path

import pytest
from helpers.cli import restore_cli_state, run_cli  # noqa: F401 (fixture)
from helpers.fakehub import FakeHub
from helpers.fakehub.artifacts import make_artifact
from helpers.fakehub.fixtures import READ_TOKEN, WRITE_TOKEN

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("restore_cli_state")]  # the CLI sets global state
REPO = "org/cli-art"


def _tags(hub: FakeHub) -> dict[str, str]:
    return {t.name: t.target for t in hub.store.refs("model", REPO)[1]}


def test_export_prints_the_pinned_ref(fake_hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    art = make_artifact(tmp_path, 0)
    code, out, err = run_cli(capsys, "export", str(art), "--repo-id", REPO, "--tag", "v0.1.0",
                             "--token", WRITE_TOKEN, "--endpoint", fake_hub.endpoint)
    assert code == 0, err
    sha = _tags(fake_hub)["v0.1.0"]
    assert out == f"{REPO}@{sha}\n"
    assert "tagged v0.1.0" in err
    code, out, err = run_cli(capsys, "--json", "export", str(art), "--repo-id", REPO, "--tag", "v0.1.0",
                             "--token", WRITE_TOKEN, "--endpoint", fake_hub.endpoint)
    doc = json.loads(out)
    assert code == 0 and doc["ref"] == f"{REPO}@{sha}" and doc["commit"] == sha
    assert doc["created_commit"] is False and doc["created_tag"] is False and doc["tag"] == "v0.1.0"
    assert err == ""  # --json: nothing human on stderr


def test_dry_run_lists_files_and_sends_nothing(fake_hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    art = make_artifact(tmp_path, 0)
    code, out, err = run_cli(capsys, "export", str(art), "--repo-id", REPO, "--tag", "v0.1.0", "--dry-run",
                             "--endpoint", fake_hub.endpoint)
    assert code == 0, err
    assert [line.split("\t")[0] for line in out.splitlines()] == [
        "README.md", "manifest.json", "recipe.yaml", "rotations.safetensors"]
    assert "nothing was sent" in err and fake_hub.requests == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--repo-id", "no-slash"], "invalid Hub repo id"),
        (["--repo-id", REPO, "--token", "hf_wrong"], "rejected the token (401"),
        (["--repo-id", REPO, "--tag", "v0.1.0"], "tag v0.1.0 already exists"),
        (["--repo-id", REPO, "--token", READ_TOKEN, "--tag", "v0.3.0"], "may not write"),
    ],
    ids=["bad-repo-id", "bad-token", "tag-exists", "read-only-token"],
)
def test_errors_are_one_line_plus_hint(
    fake_hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    run_cli(capsys, "export", str(make_artifact(tmp_path, 0)), "--repo-id", REPO, "--tag", "v0.1.0",
            "--token", WRITE_TOKEN, "--endpoint", fake_hub.endpoint)
    tags = _tags(fake_hub)
    args = ["export", str(make_artifact(tmp_path, 1)), *argv, "--endpoint", fake_hub.endpoint]
    if "--token" not in argv:
        args += ["--token", WRITE_TOKEN]
    code, out, err = run_cli(capsys, *args)
    lines = err.splitlines()
    assert code == 1 and out == ""
    assert len(lines) == 2 and lines[0].startswith("error: ") and message in lines[0] and lines[1].startswith("hint: ")
    assert _tags(fake_hub) == tags  # nothing (re)tagged


def test_export_of_a_broken_artifact(fake_hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    art = make_artifact(tmp_path, 0)
    (art / "recipe.yaml").write_text("tampered: true\n")
    code, out, err = run_cli(capsys, "export", str(art), "--repo-id", REPO, "--token", WRITE_TOKEN,
                             "--endpoint", fake_hub.endpoint)
    assert code == 1 and "checksum mismatch for recipe.yaml" in err and len(err.splitlines()) == 2
    code, _, err = run_cli(capsys, "export", str(tmp_path / "missing"), "--repo-id", REPO, "--dry-run")
    assert code == 1 and "not found" in err
    assert fake_hub.requests == []


def test_pull_prints_ref_and_path(fake_hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str], hf_isolated: Path) -> None:
    run_cli(capsys, "export", str(make_artifact(tmp_path, 0)), "--repo-id", REPO, "--tag", "v0.1.0",
            "--token", WRITE_TOKEN, "--endpoint", fake_hub.endpoint)
    sha = _tags(fake_hub)["v0.1.0"]
    code, out, err = run_cli(capsys, "pull", f"{REPO}@v0.1.0", "--endpoint", fake_hub.endpoint)
    assert code == 0, err
    ref, path = out.splitlines()
    assert ref == f"{REPO}@{sha}" and Path(path).name == sha and path.startswith(str(hf_isolated))
    code, out, _ = run_cli(capsys, "--json", "pull", f"hf://{REPO}@{sha}")
    doc = json.loads(out)
    assert code == 0 and doc["commit"] == sha and doc["path"] == path and doc["method"] == "oscar"
    code, out, err = run_cli(capsys, "pull", "hf://org/nothing-here@v1")
    assert code == 1 and out == "" and "not found" in err.splitlines()[0]


def _leaks(token: str, root: Path) -> list[str]:
    """Every file under ``root`` whose bytes (or zlib-inflated git objects) contain ``token``."""
    needle = token.encode()
    found = []
    for p in root.rglob("*"):
        if not p.is_file() or p.is_symlink():
            continue
        data = p.read_bytes()
        if "objects" in p.parts:
            try:
                data = zlib.decompress(data)
            except zlib.error:
                pass
        if needle in data:
            found.append(str(p))
    return found


def test_token_never_printed_logged_or_written(
    fake_hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_DEBUG", True)  # the client logs every request as a curl command
    keep = Keep(level=logging.DEBUG)
    for name in ("", "huggingface_hub", "oscar_cli", "httpx2", "httpcore2"):  # debug logs of the client too
        monkeypatch.setattr(logging.getLogger(name), "level", logging.DEBUG)
        logging.getLogger(name).addHandler(keep)
    bad = "hf_badTOKENthatMustNotLeak987654"
    outputs = []
    try:
        e = ["--endpoint", fake_hub.endpoint]
        outputs.append(run_cli(capsys, "-vv", "export", str(make_artifact(tmp_path, 0)), "--repo-id", REPO,
                               "--tag", "v0.1.0", "--token", WRITE_TOKEN, *e))
        monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)  # the token from the environment, as in CI
        outputs.append(run_cli(capsys, "-vv", "--json", "export", str(make_artifact(tmp_path, 1)),
                               "--repo-id", REPO, "--tag", "v0.2.0", *e))
        outputs.append(run_cli(capsys, "-vv", "export", str(make_artifact(tmp_path, 1)), "--repo-id", REPO,
                               "--tag", "v0.1.0", *e))  # tag exists: error path
        fake_hub.fail("commit", 500)
        outputs.append(run_cli(capsys, "-vv", "export", str(make_artifact(tmp_path, 2)), "--repo-id", REPO,
                               "--tag", "v0.3.0", *e))  # server error path
        monkeypatch.delenv("HF_TOKEN")
        outputs.append(run_cli(capsys, "-vv", "export", str(make_artifact(tmp_path, 2)), "--repo-id", REPO,
                               "--token", bad, *e))  # 401 path
        outputs.append(run_cli(capsys, "-vv", "pull", f"{REPO}@v0.2.0", "--token", WRITE_TOKEN, *e))
        outputs.append(run_cli(capsys, "-vv", "export", str(make_artifact(tmp_path, 0)), "--repo-id", REPO,
                               "--dry-run", "--token", WRITE_TOKEN))
    finally:
        for name in ("", "huggingface_hub", "oscar_cli", "httpx2", "httpcore2"):
            logging.getLogger(name).removeHandler(keep)
    codes = [c for c, _, _ in outputs]
    assert codes == [0, 0, 1, 1, 1, 0, 0], outputs
    assert set(_tags(fake_hub)) == {"v0.1.0", "v0.2.0"}  # the token did work where it should
    assert any("Send: curl" in r for r in records)  # the client's debug log ran (with the header masked)
    text = "\n".join(o + e for _, o, e in outputs) + "\n".join(records)
    for token in (WRITE_TOKEN, bad):
        assert token not in text
        assert _leaks(token, tmp_path) == []  # artifacts, staged card, HF cache, the Hub's git objects


def _summary(art: Path, resolved: str) -> dict:
    """The shape of `oscar eval-ruler`'s summary.json (scores[method][task][ctx], 0-100)."""
    return {
        "config": {"artifact": str(art), "methods": ["bf16", "oscar"]},
        "model": {"reference": "smollm2-135m", "resolved": resolved},
        "scores": {"bf16": {"niah_single_1": {"1024": 100.0}}, "oscar": {"niah_single_1": {"1024": 75.0}}},
        "counts": {"bf16": {"niah_single_1": {"1024": 4}}, "oscar": {"niah_single_1": {"1024": 4}}},
        "environment": {"device": "cpu"},
    }


def test_export_with_eval_summary(fake_hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    art = make_artifact(tmp_path, 0)
    local_manifest = (art / "manifest.json").read_bytes()
    summary = tmp_path / "summary.json"
    resolved = json.loads(local_manifest)["model"]["resolved"]
    summary.write_text(json.dumps(_summary(art, resolved)))
    args = ["export", str(art), "--repo-id", REPO, "--tag", "v0.1.0", "--eval-summary", str(summary),
            "--token", WRITE_TOKEN, "--endpoint", fake_hub.endpoint]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    sha = out.strip().split("@")[1]
    tree = {e.path: e.oid for e in fake_hub.store.tree("model", REPO, sha)}
    published = json.loads(fake_hub.store.read_blob("model", REPO, tree["manifest.json"]))
    rows = published["evaluation"]["results"]
    assert published["evaluation"]["complete"] is True
    assert [(r["method"], r["ctx"], r["value"], r["samples"]) for r in rows] == [
        ("oscar", 1024, 75.0, 4), ("bf16", 1024, 100.0, 4)]
    meta = yaml.safe_load(fake_hub.store.read_blob("model", REPO, tree["README.md"]).decode().split("---")[1])
    assert [r["metrics"][0]["value"] for r in meta["model-index"][0]["results"]] == [75.0]
    assert (art / "manifest.json").read_bytes() == local_manifest  # the local artifact is untouched
    code, out2, _ = run_cli(capsys, *args)  # identical re-export (same summary): no new commit
    assert code == 0 and out2 == out
    summary.write_text(json.dumps(_summary(art, "sha256:" + "0" * 64)))
    code, _, err = run_cli(capsys, *args[:4], "--eval-summary", str(summary), "--dry-run")
    assert code == 1 and "measured on sha256:000" in err

