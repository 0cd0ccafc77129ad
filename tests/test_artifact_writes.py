"""Race-free artifact writes: one of two concurrent writers wins, --overwrite replaces only artifacts, a crash
between the two renames is repaired, modes follow the umask, the manifest records what made it."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import stat
from pathlib import Path

import pytest
from helpers.fakehub.artifacts import _layers, make_artifact, make_manifest

from oscar_cli.artifact import open_artifact, verify_artifact, write_artifact
from oscar_cli.artifact.build import build_manifest
from oscar_cli.errors import ArtifactError
from oscar_cli.recipe import load_recipe

pytestmark = pytest.mark.unit


def _write(out: str, variant: int, barrier: object, results: object) -> None:
    """One writer process: wait for the other, then write; put "ok" or the error line on ``results``."""
    from contextlib import contextmanager

    import oscar_cli.artifact.write as w

    real = w.locked

    @contextmanager
    def locked(parent: Path):  # type: ignore[no-untyped-def]
        barrier.wait(timeout=60)  # type: ignore[attr-defined]  # both have written their temp folder
        with real(parent):
            yield

    w.locked = locked  # type: ignore[assignment]
    try:
        write_artifact(out, make_manifest(variant), _layers(variant), f"name: tiny\ndata:\n  seed: {variant}\n")
        results.put("ok")  # type: ignore[attr-defined]
    except ArtifactError as exc:
        results.put(exc.message)  # type: ignore[attr-defined]


def test_two_writers_to_one_out_one_wins(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")  # fork after torch started its threads can hang the child
    barrier = ctx.Barrier(2)
    queue = ctx.Queue()
    out = str(tmp_path / "art")
    procs = [ctx.Process(target=_write, args=(out, v, barrier, queue)) for v in (0, 1)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    assert sorted(r == "ok" for r in results) == [False, True], results
    assert any("already exists (another process wrote it meanwhile)" in r for r in results)
    verify_artifact(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # no temp folder left


@pytest.mark.parametrize("missing", [True, False])
def test_crash_between_the_renames_is_repaired_by_the_next_load(tmp_path: Path, missing: bool) -> None:
    art = make_artifact(tmp_path, 0)
    old = tmp_path / ".art-0.old-x1y2z3"
    if missing:  # killed after moving the old artifact away, before moving the new one in
        os.replace(art, old)
    else:  # killed after the swap, before removing the old copy
        make_artifact(tmp_path / "other", 1)
        os.replace(tmp_path / "other" / "art-1", old)
    open_artifact(art)
    assert art.is_dir() and not old.exists()
    assert verify_artifact(art).seed == 0


def test_overwrite_replaces_an_artifact_and_nothing_else(tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 0)
    make_artifact(tmp_path, 0)  # overwrite=True: an artifact folder is replaced
    (art / "notes.txt").write_text("mine\n")
    with pytest.raises(ArtifactError, match="holds notes.txt, which is not part of an oscar artifact"):
        make_artifact(tmp_path, 0)
    assert (art / "notes.txt").read_text() == "mine\n"


def test_modes_follow_the_umask(tmp_path: Path) -> None:
    before = os.umask(0o022)
    try:
        art = make_artifact(tmp_path, 0)
    finally:
        os.umask(before)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in art.iterdir()}
    assert set(modes.values()) == {0o644}, modes
    assert stat.S_IMODE(art.stat().st_mode) == 0o755


def test_manifest_records_versions_device_and_dtype(tmp_path: Path) -> None:
    m = build_manifest(load_recipe(), reference="tiny", resolved="sha256:" + "0" * 64,
                       architecture=make_manifest(0).architecture, data={"source": "x"}, clip_layers=[],
                       orthogonality_error=0.0, statistics_tokens=1, holdout_tokens=0, timings={},
                       device="cpu", dtype="torch.float32")
    env = m.extra["environment"]
    assert {"oscar", "torch", "transformers", "triton", "python"} <= set(env)
    assert env["device"] == "cpu" and env["dtype"] == "float32"
    written = write_artifact(tmp_path / "a", m, _layers(0), load_recipe().to_yaml())
    assert json.loads((written / "manifest.json").read_text())["environment"] == env
