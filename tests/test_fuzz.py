"""Property-based fuzzing (hypothesis) of the artifact loader and the recipe parser.

Each case mutates a valid tiny artifact (a manifest value replaced, deleted or added; manifest bytes flipped,
cut or inserted; a byte of a listed file changed; with or without resealing the content digest, as a hostile
supplier would) and runs what serving runs: ``open_artifact`` + ``oscar_from_artifact``. Properties:

- only :class:`~oscar_cli.errors.OscarError` is ever raised (no other exception type);
- no case takes more than 5 s;
- no mutation of what the digest covers (manifest content, listed files) is accepted unless it was resealed.

The CI run takes ``OSCAR_FUZZ_CI_EXAMPLES`` cases (default 200, about 10 s each test); the long run
(``pytest -m slow -k fuzz -s``) takes ``OSCAR_FUZZ_EXAMPLES`` (default 10,000, about 4 min for the loader on one
core) and prints its counts. CI (``pytest -m "not gpu"``) skips the long run: it runs only when ``-m`` selects
``slow`` explicitly or ``OSCAR_FUZZ_EXAMPLES`` is set.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from helpers.fakehub.artifacts import make_artifact
from helpers.tiny import tiny_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oscar_cli.artifact.manifest import canonical_json, content_digest
from oscar_cli.errors import OscarError, RecipeError
from oscar_cli.quant.methods import oscar_from_artifact
from oscar_cli.recipe import default_recipe_dict, read_recipe_yaml, recipe_from_dict

CI_EXAMPLES = int(os.environ.get("OSCAR_FUZZ_CI_EXAMPLES", "200"))
LONG_EXAMPLES = int(os.environ.get("OSCAR_FUZZ_EXAMPLES", "10000"))
MAX_SECONDS = 5.0
LISTED = ("rotations.safetensors", "recipe.yaml")
COUNTS: Counter[str] = Counter()

json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
    st.sampled_from([0, 1, 7, 8, 12, 16, 64, 1023, 1024, 1025, 50_000_000, 10**12, -1, "64", "sixty-four",
                     "../../x", "/etc/hostname", "layer", "head", "oscar", "identity", "float32", ""]),
)
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    art = make_artifact(tmp_path_factory.mktemp("fuzz-base"), 0)
    oscar_from_artifact(str(art), tiny_config())  # the unmutated artifact is served
    return art


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _apply(obj: Any, path: tuple[Any, ...], op: str, value: Any, key: str) -> None:
    parent = obj
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    if op == "delete":
        del parent[last]
    elif op == "add" and isinstance(parent[last], dict):
        parent[last][key] = value
    else:
        parent[last] = value


@st.composite
def mutations(draw: st.DrawFn, manifest: dict[str, Any]) -> dict[str, Any]:
    kind = draw(st.sampled_from(["value", "value", "value", "manifest-bytes", "file-bytes"]))
    case: dict[str, Any] = {"kind": kind, "reseal": draw(st.booleans())}
    if kind == "value":
        paths = _paths(manifest)
        case.update(path=draw(st.sampled_from(paths)), op=draw(st.sampled_from(["replace", "delete", "add"])),
                    value=draw(json_value), key=draw(st.text(max_size=8)))
    elif kind == "manifest-bytes":
        case.update(op=draw(st.sampled_from(["flip", "cut", "insert"])), at=draw(st.floats(0, 1)),
                    data=draw(st.binary(min_size=1, max_size=8)))
    else:
        case.update(file=draw(st.sampled_from(LISTED)), at=draw(st.floats(0, 1)),
                    data=draw(st.binary(min_size=1, max_size=4)))
    return case


def _mutate(art: Path, case: dict[str, Any]) -> None:
    mpath = art / "manifest.json"
    if case["kind"] == "value":
        data = json.loads(mpath.read_text())
        _apply(data, case["path"], case["op"], case["value"], case["key"])
        if case["reseal"]:
            data["digest"] = content_digest(data)
        mpath.write_text(json.dumps(data))
    elif case["kind"] == "manifest-bytes":
        raw = bytearray(mpath.read_bytes())
        i = int(case["at"] * (len(raw) - 1))
        if case["op"] == "flip":
            raw[i : i + len(case["data"])] = case["data"]
        elif case["op"] == "cut":
            del raw[i:]
        else:
            raw[i:i] = case["data"]
        mpath.write_bytes(bytes(raw))
    else:
        f = art / case["file"]
        raw = bytearray(f.read_bytes())
        i = int(case["at"] * (len(raw) - 1))
        raw[i : i + len(case["data"])] = case["data"]
        f.write_bytes(bytes(raw))
        if case["reseal"]:
            data = json.loads(mpath.read_text())
            data["files"][case["file"]] = hashlib.sha256(bytes(raw)).hexdigest()
            data["digest"] = content_digest(data)
            mpath.write_text(json.dumps(data))


def _covered(art: Path) -> tuple[bytes, ...]:
    """What the digest covers, as comparable bytes: the manifest's canonical content and each listed file."""
    try:
        manifest = canonical_json(json.loads((art / "manifest.json").read_text()))
    except (ValueError, RecursionError):
        manifest = (art / "manifest.json").read_bytes()
    return (manifest, *((art / n).read_bytes() if (art / n).exists() else b"" for n in LISTED))


def _run_case(base: Path, scratch: Path, case: dict[str, Any]) -> None:
    art = scratch / "art"
    if art.exists():
        shutil.rmtree(art)
    shutil.copytree(base, art)
    before = _covered(art)
    _mutate(art, case)
    changed = _covered(art) != before
    t0 = time.perf_counter()
    try:
        oscar_from_artifact(str(art), tiny_config())
        outcome = "accepted"
    except OscarError:
        outcome = "refused"
    except Exception as exc:  # the property: anything else is a bug
        COUNTS["other-exception"] += 1
        raise AssertionError(f"{type(exc).__name__} for {case}: {exc}") from exc
    elapsed = time.perf_counter() - t0
    COUNTS[outcome] += 1
    COUNTS["cases"] += 1
    COUNTS["max_ms"] = max(COUNTS["max_ms"], int(elapsed * 1000))
    assert elapsed <= MAX_SECONDS, f"{elapsed:.1f} s for {case}"
    if outcome == "accepted" and changed:
        COUNTS["accepted-resealed" if case["reseal"] else "accepted-unsealed"] += 1
        assert case["reseal"], f"a mutation of digest-covered content was accepted without resealing: {case}"


def _loader_property(base: Path, scratch: Path, examples: int, derandomize: bool) -> None:
    manifest = json.loads((base / "manifest.json").read_text())

    @settings(max_examples=examples, deadline=None, derandomize=derandomize, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=mutations(manifest))
    def prop(case: dict[str, Any]) -> None:
        _run_case(base, scratch, case)

    prop()


recipe_texts = st.one_of(
    st.binary(max_size=64),
    st.text(max_size=64),
    st.sampled_from(["a: [", "!!python/object/apply:os.system ['echo']", "- a\n- b\n", "[" * 5000, "{" * 5000,
                     "quant: {sink: 7}", "quant:\n  group_size: 7\n", "data: 5", "name: a b"]),
)


def _recipe_property(examples: int, derandomize: bool) -> None:
    defaults = default_recipe_dict()

    @settings(max_examples=examples, deadline=None, derandomize=derandomize, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(text=recipe_texts, path=st.sampled_from(_paths(defaults)), value=json_value,
           delete=st.booleans())
    def prop(text: Any, path: tuple[Any, ...], value: Any, delete: bool) -> None:
        t0 = time.perf_counter()
        for attempt in ("yaml", "dict"):
            try:
                if attempt == "yaml":
                    recipe_from_dict(read_recipe_yaml(text, "fuzz.yaml"))
                else:
                    data = json.loads(json.dumps(defaults))
                    _apply(data, path, "delete" if delete else "replace", value, "")
                    recipe_from_dict(data)
            except RecipeError:
                pass
        assert time.perf_counter() - t0 <= MAX_SECONDS

    prop()


@pytest.mark.unit
def test_fuzz_artifact_loader_ci(base: Path, tmp_path: Path) -> None:
    _loader_property(base, tmp_path, CI_EXAMPLES, derandomize=True)


@pytest.mark.unit
def test_fuzz_recipe_parser_ci() -> None:
    _recipe_property(CI_EXAMPLES, derandomize=True)


@pytest.fixture
def long_run(request: pytest.FixtureRequest) -> None:
    expr = str(request.config.getoption("-m") or "")
    if "OSCAR_FUZZ_EXAMPLES" not in os.environ and ("slow" not in expr or "not slow" in expr):
        pytest.skip("the long fuzz run: pytest -m slow -k fuzz (or set OSCAR_FUZZ_EXAMPLES)")


@pytest.mark.slow
def test_fuzz_artifact_loader_long(base: Path, tmp_path: Path, long_run: None) -> None:
    COUNTS.clear()
    t0 = time.perf_counter()
    _loader_property(base, tmp_path, LONG_EXAMPLES, derandomize=False)
    print(f"\nartifact loader fuzz: {dict(COUNTS)} in {time.perf_counter() - t0:.0f} s")
    assert COUNTS["cases"] >= LONG_EXAMPLES * 0.9 and COUNTS["other-exception"] == 0


@pytest.mark.slow
def test_fuzz_recipe_parser_long(long_run: None) -> None:
    _recipe_property(LONG_EXAMPLES, derandomize=False)
