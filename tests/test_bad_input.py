"""docs/BAD_INPUT.md, row by row: each bad input gets exactly one ``error:`` line (the table's text) and exit 1.

The table is the specification: the test ids are read from it, every row has a setup here and every setup a
row (``test_table_and_tests_agree``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.cli import restore_cli_state, run_cli  # noqa: F401 (fixture)
from helpers.fakehub import FakeHub
from helpers.fakehub.artifacts import make_artifact
from helpers.fakehub.fixtures import WRITE_TOKEN
from helpers.tiny import write_tiny_model

from oscar_cli.artifact.manifest import content_digest

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("restore_cli_state")]
TABLE = Path(__file__).resolve().parents[1] / "docs" / "BAD_INPUT.md"
ROW_RE = re.compile(r"^\| `([a-z0-9-]+)` \| (.+?) \| `(.+)` \|$")


def table_rows() -> dict[str, str]:
    """``{id: expected error text}`` from docs/BAD_INPUT.md."""
    rows = {}
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        m = ROW_RE.match(line)
        if m:
            rows[m.group(1)] = m.group(3)
    return rows


Setup = Callable[[Path, pytest.MonkeyPatch], list[str]]
SETUPS: dict[str, Setup] = {}


def row(name: str) -> Callable[[Setup], Setup]:
    def register(fn: Setup) -> Setup:
        SETUPS[name] = fn
        return fn
    return register


# -- helpers ----------------------------------------------------------------------------------------------
def _art(tmp: Path) -> Path:
    return make_artifact(tmp, 0)


def _dry_run(art: Path) -> list[str]:
    return ["export", str(art), "--repo-id", "org/x", "--dry-run"]


def _edit(art: Path, change: Callable[[dict], None], *, reseal: bool = True) -> None:
    data = json.loads((art / "manifest.json").read_text())
    change(data)
    if reseal:
        data["digest"] = content_digest(data)
    (art / "manifest.json").write_text(json.dumps(data))


def _edit_file(art: Path, name: str, content: bytes) -> None:
    """Replace an artifact file and reseal its sha256 and the digest (a hostile but consistent supplier)."""
    import hashlib

    (art / name).write_bytes(content)
    _edit(art, lambda d: d["files"].__setitem__(name, hashlib.sha256(content).hexdigest()))


def _set(path: str, value: object) -> Callable[[dict], None]:
    def change(d: dict) -> None:
        *parents, last = path.split(".")
        for p in parents:
            d = d[p]
        d[last] = value
    return change


def _manifest_row(name: str, change: Callable[[dict], None], reseal: bool = True) -> None:
    def setup(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
        art = _art(tmp)
        _edit(art, change, reseal=reseal)
        return _dry_run(art)
    SETUPS[name] = setup


def _recipe_file(tmp: Path, text: str) -> Path:
    f = tmp / "r.yaml"
    f.write_text(text)
    return f


def _tiny_model(tmp: Path) -> str:
    return str(write_tiny_model(tmp / "tiny-model"))


# -- export -----------------------------------------------------------------------------------------------
@row("export-symlink")
def _(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    art = _art(tmp)
    (tmp / "secret.txt").write_text("outside the artifact\n")
    (art / "notes.txt").symlink_to(tmp / "secret.txt")
    return _dry_run(art)


@row("export-unlisted-file")
def _(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    art = _art(tmp)
    (art / "credentials.json").write_text('{"token": "hf_x"}\n')
    return _dry_run(art)


# -- manifest ---------------------------------------------------------------------------------------------
_manifest_row("manifest-edited", _set("quant.sink", 128), reseal=False)
_manifest_row("manifest-method-edited", _set("method", "identity"), reseal=False)
_manifest_row("manifest-rope-theta-deleted", lambda d: d["architecture"].pop("rope_theta"))
_manifest_row("manifest-sink-string", _set("quant.sink", "sixty-four"))
_manifest_row("manifest-sink-7", _set("quant.sink", 7))
_manifest_row("manifest-group-size-7", _set("quant.group_size", 7))
_manifest_row("manifest-group-size-not-dividing", _set("quant.group_size", 12))
_manifest_row("manifest-num-layers-huge", _set("architecture.num_layers", 50_000_000))
_manifest_row("manifest-path-traversal", lambda d: d["files"].__setitem__("../../x", "0" * 64))
_manifest_row("manifest-absolute-path", lambda d: d["files"].__setitem__("/etc/hostname", "0" * 64))
_manifest_row("manifest-no-digest", lambda d: d.pop("digest"), reseal=False)
_manifest_row("manifest-unknown-scheme", _set("calibration.layers", [{"scheme": "oscar"}, {"scheme": "bf8"}]))
_manifest_row("manifest-scheme-rows-short", _set("calibration.layers", [{"scheme": "bf16"}]))


@row("manifest-not-utf8")
def _(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    art = _art(tmp)
    (art / "manifest.json").write_bytes(b'{"format_version": 1, "x": "\xff\xfe"}')
    return _dry_run(art)


@row("manifest-deep-nesting")
def _(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    art = _art(tmp)
    (art / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    return _dry_run(art)


@row("manifest-duplicate-key")
def _(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    art = _art(tmp)
    text = (art / "manifest.json").read_text()
    (art / "manifest.json").write_text(text.replace('"method": "oscar"', '"method": "oscar", "method": "identity"'))
    return _dry_run(art)


# -- files ------------------------------------------------------------------------------------------------
@row("tensors-symlink")
def _(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    art = _art(tmp)
    outside = tmp / "copy.safetensors"
    shutil.copyfile(art / "rotations.safetensors", outside)
    (art / "rotations.safetensors").unlink()
    (art / "rotations.safetensors").symlink_to(outside)
    return _dry_run(art)


@row("tensors-truncated")
def _(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    art = _art(tmp)
    data = (art / "rotations.safetensors").read_bytes()
    (art / "rotations.safetensors").write_bytes(data[: len(data) // 2])
    return _dry_run(art)


@row("recipe-yaml-python-tag")
def _(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    art = _art(tmp)
    _edit_file(art, "recipe.yaml", b"name: !!python/object/apply:os.system ['echo pwned']\n")
    return _dry_run(art)


@row("recipe-yaml-invalid")
def _(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    art = _art(tmp)
    _edit_file(art, "recipe.yaml", b"a: [\n")
    return _dry_run(art)


# -- recipes and calibrate --------------------------------------------------------------------------------
@row("recipe-sink-7")
def _(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["calibrate", "--recipe", str(_recipe_file(tmp, "quant:\n  sink: 7\n")), "--out", str(tmp / "a")]


@row("recipe-group-size-7")
def _(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["calibrate", "--recipe", str(_recipe_file(tmp, "quant:\n  group_size: 7\n")), "--out", str(tmp / "a")]


@row("recipe-group-size-not-dividing")
def _(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    recipe = _recipe_file(tmp, "quant:\n  group_size: 12\n")
    return ["calibrate", _tiny_model(tmp), "--recipe", str(recipe), "--out", str(tmp / "a")]


@row("recipe-invalid-yaml")
def _(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["calibrate", "--recipe", str(_recipe_file(tmp, "a: [\n")), "--out", str(tmp / "a")]


@row("recipe-python-tag")
def _(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    text = "name: !!python/object/apply:os.system ['echo pwned']\n"
    return ["calibrate", "--recipe", str(_recipe_file(tmp, text)), "--out", str(tmp / "a")]


@row("calibrate-out-below-file")
def _(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    (tmp / "FILE").write_text("x\n")
    return ["calibrate", _tiny_model(tmp), "--out", str(tmp / "FILE" / "art")]


@row("calibrate-out-unwritable")
def _(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    if os.geteuid() == 0:
        pytest.skip("root can write anywhere: no unwritable folder to test with")
    locked = tmp / "locked"
    locked.mkdir(mode=0o555)
    return ["calibrate", _tiny_model(tmp), "--out", str(locked / "art")]


@row("calibrate-overwrite-folder")
def _(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    (tmp / "mine").mkdir()
    (tmp / "mine" / "thesis.tex").write_text("months of work\n")
    return ["calibrate", _tiny_model(tmp), "--overwrite", "--out", str(tmp / "mine")]


@row("calibrate-overwrite-file")
def _(tmp: Path, mp: pytest.MonkeyPatch) -> list[str]:
    (tmp / "notes.txt").write_text("keep me\n")
    return ["calibrate", _tiny_model(tmp), "--overwrite", "--out", str(tmp / "notes.txt")]


# -- pull from a hostile or corrupted source --------------------------------------------------------------
def _published(tmp: Path, hub: FakeHub) -> str:
    from oscar_cli.artifact.hub import push_artifact

    push_artifact(_art(tmp), "org/x", tag="v1", token=WRITE_TOKEN, endpoint=hub.endpoint)
    return "org/x@v1"


HUB_ROWS = ("pull-crafted-commit", "pull-crafted-etag", "pull-poisoned-cache", "pull-other-digest")


def _hub_setup(name: str, tmp: Path, hub: FakeHub, mp: pytest.MonkeyPatch) -> list[str]:
    ref = _published(tmp, hub)
    argv = ["pull", ref, "--endpoint", hub.endpoint]
    if name == "pull-crafted-commit":
        hub.resolve_headers = {"X-Repo-Commit": "../../evil"}
    elif name == "pull-crafted-etag":
        hub.resolve_headers = {"ETag": '"../../../../evil"'}
    elif name == "pull-poisoned-cache":
        from huggingface_hub import constants

        from oscar_cli.artifact.hub import pull_artifact

        snapshot = pull_artifact(ref, endpoint=hub.endpoint)
        blob = (snapshot / "rotations.safetensors").resolve()
        blob.write_bytes(blob.read_bytes()[::-1])
        mp.setattr(constants, "HF_HUB_OFFLINE", True)
    elif name == "pull-other-digest":
        argv += ["--expect-digest", "sha256:" + "0" * 64]
    return argv


# -- the tests --------------------------------------------------------------------------------------------
def test_table_and_tests_agree() -> None:
    assert sorted(table_rows()) == sorted([*SETUPS, *HUB_ROWS])


def _check(code: int, out: str, err: str, expected: str) -> None:
    lines = [ln for ln in (out + err).splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert code == 1, (code, out, err)
    assert len(errors) == 1 and expected in errors[0], lines
    assert "Traceback" not in out + err
    assert lines[-1].startswith("hint:") or lines[-1] is errors[0], lines  # the error (+ hint) ends the output


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_bad_input(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture[str], hf_isolated: Path) -> None:
    expected = table_rows()[name]
    argv = SETUPS[name](tmp_path, monkeypatch)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "hf-" not in p.parts[0])
    capsys.readouterr()
    _check(*run_cli(capsys, *argv), expected)
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "hf-" not in p.parts[0])
    assert after == before  # nothing written, nothing deleted


@pytest.mark.parametrize("name", HUB_ROWS)
def test_bad_input_from_the_hub(name: str, tmp_path: Path, fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    argv = _hub_setup(name, tmp_path, fake_hub, monkeypatch)
    capsys.readouterr()
    _check(*run_cli(capsys, *argv), table_rows()[name])
