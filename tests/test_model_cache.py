"""oscar's conversion cache: entries are published atomically, checked on every use, rebuilt when bad."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from oscar_cli.model import cache as model_cache

SRC = hashlib.sha256(b"source").hexdigest()


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv(model_cache.CACHE_ENV, str(d))
    return d


class Builder:
    """Writes a fixed two-file model and counts how often it ran."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, out: Path) -> None:
        self.calls += 1
        (out / "config.json").write_text('{"a": 1}')
        (out / "model.safetensors").write_bytes(bytes(range(256)) * 64)


@pytest.mark.unit
def test_cache_dir_env_and_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert model_cache.cache_dir() == tmp_path / "cache"
    monkeypatch.delenv(model_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache.cache_dir() == tmp_path / "xdg" / "oscar"


@pytest.mark.unit
def test_built_once_then_reused() -> None:
    build = Builder()
    entry, built = model_cache.ensure_entry(SRC, build, {"source": "x"})
    assert built and build.calls == 1 and entry == model_cache.converted_path(SRC)
    meta = json.loads((entry / model_cache.META_NAME).read_text())
    assert meta["source_sha256"] == SRC and meta["source"] == "x" and set(meta["files"]) == {
        "config.json",
        "model.safetensors",
    }
    assert model_cache.ensure_entry(SRC, build) == (entry, False) and build.calls == 1
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


@pytest.mark.unit
def test_a_new_entry_is_checked_without_hashing_it_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """build_entry hashes the files once and puts those hashes into the index, so the next load's check does
    not read the weights again; a file changed after publishing is still hashed (its mtime moved)."""
    entry, _ = model_cache.ensure_entry(SRC, Builder())
    hashed: list[str] = []
    real = model_cache.sha256_file
    monkeypatch.setattr(model_cache, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    assert model_cache.check_entry(entry, SRC) is None and hashed == []
    _flip_byte(entry / "model.safetensors")
    reason = model_cache.check_entry(entry, SRC)
    assert hashed == ["model.safetensors"] and reason is not None and "wrong sha256" in reason


def _flip_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[100] ^= 0xFF
    st = p.stat()
    p.write_bytes(bytes(data))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a rewrite always moves mtime


@pytest.mark.unit
@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda e: _flip_byte(e / "model.safetensors"), "wrong sha256"),
        (lambda e: (e / "model.safetensors").write_bytes(b"short"), "wrong size"),
        (lambda e: (e / "config.json").unlink(), "config.json is missing"),
        (lambda e: (e / model_cache.META_NAME).write_text("{not json"), "unreadable"),
        (lambda e: (e / model_cache.META_NAME).unlink(), "unreadable"),
    ],
    ids=["bitflip", "truncated", "file-missing", "meta-corrupt", "meta-missing"],
)
def test_damaged_entry_is_detected_and_rebuilt(damage, problem: str) -> None:  # type: ignore[no-untyped-def]
    build = Builder()
    entry, _ = model_cache.ensure_entry(SRC, build)
    model_cache.check_entry(entry, SRC)  # records the hashes in the index, as a load would
    damage(entry)
    reason = model_cache.check_entry(entry, SRC)
    assert reason is not None and problem in reason
    entry2, built = model_cache.ensure_entry(SRC, build)
    assert built and build.calls == 2 and model_cache.check_entry(entry2, SRC) is None


@pytest.mark.unit
def test_entry_for_another_source_is_not_used() -> None:
    entry, _ = model_cache.ensure_entry(SRC, Builder())
    other = hashlib.sha256(b"other").hexdigest()
    assert model_cache.check_entry(entry, other) == "made from another source file"


@pytest.mark.unit
def test_failed_build_publishes_nothing() -> None:
    def broken(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("conversion crashed")

    with pytest.raises(RuntimeError):
        model_cache.ensure_entry(SRC, broken)
    root = model_cache.converted_path(SRC).parent
    assert not model_cache.converted_path(SRC).exists() and list(root.iterdir()) == []


@pytest.mark.unit
def test_hash_index_survives_corruption_and_tracks_changes(tmp_path: Path, cache: Path) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc")
    assert model_cache.file_sha256(f) == hashlib.sha256(b"abc").hexdigest()
    (cache / "hashes.json").write_text("[garbage")
    assert model_cache.file_sha256(f) == hashlib.sha256(b"abc").hexdigest()
    f.write_bytes(b"abcd")
    assert model_cache.file_sha256(f) == hashlib.sha256(b"abcd").hexdigest()
    assert json.loads((cache / "hashes.json").read_text())[str(f.resolve())]["size"] == 4
    g = tmp_path / "other.bin"
    g.write_bytes(b"x")
    f.unlink()
    model_cache.file_sha256(g)
    assert list(json.loads((cache / "hashes.json").read_text())) == [str(g.resolve())]  # deleted files forgotten
