"""Publishing and pulling artifacts against the local fake Hub, through the real huggingface_hub client.

The fake Hub (tests/fakehub) keeps every repo as a real git repository, so commits, tags and revisions
asserted here are git objects, not bookkeeping of the test double.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
from pathlib import Path

import pytest
import yaml
from helpers.fakehub import FakeHub
from helpers.fakehub.artifacts import make_artifact
from helpers.fakehub.fixtures import READ_TOKEN, WRITE_TOKEN

from oscar_cli.artifact.hub import (
    HubRef,
    git_blob_sha1,
    is_hub_ref,
    parse_hub_ref,
    pull_artifact,
    push_artifact,
)
from oscar_cli.errors import ArtifactError, HubError

pytestmark = pytest.mark.unit
REPO = "org/oscar-art"


def _push(hub: FakeHub, art: Path, **kw: object):
    kw.setdefault("token", WRITE_TOKEN)
    return push_artifact(art, kw.pop("repo_id", REPO), endpoint=hub.endpoint, **kw)  # type: ignore[arg-type]


def _tags(hub: FakeHub, repo: str = REPO) -> dict[str, str]:
    return {t.name: t.target for t in hub.store.refs("model", repo)[1]}


def _sha256_tree(path: Path) -> dict[str, str]:
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


# -- references ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ref, expected",
    [
        ("hf://org/name@v0.1.0", HubRef("org/name", "v0.1.0")),
        ("org/name", HubRef("org/name", None)),
        ("hf://my-org/a.b_c@" + "a" * 40, HubRef("my-org/a.b_c", "a" * 40)),
    ],
    ids=["tag", "unpinned", "sha"],
)
def test_parse_hub_ref(ref: str, expected: HubRef) -> None:
    parsed = parse_hub_ref(ref)
    assert parsed == expected
    assert parsed.pinned == (expected.revision == "a" * 40)
    assert str(parsed).startswith("hf://") and is_hub_ref(str(parsed)) and not is_hub_ref("artifacts/x")


@pytest.mark.parametrize("ref", ["hf://org", "org/name@", "a/b/c", "org/-bad", "org/na--me", "org/name@ x", ""])
def test_parse_hub_ref_rejects(ref: str) -> None:
    with pytest.raises(HubError):
        parse_hub_ref(ref)


# -- publishing ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pipelined", [False, True], ids=["single-commit", "pipelined-upload"])
def test_first_push_creates_repo_commit_and_tag(
    fake_hub: FakeHub, tmp_path: Path, pipelined: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", not pipelined)
    art = make_artifact(tmp_path, 0)
    before = _sha256_tree(art)
    res = _push(fake_hub, art, tag="v0.1.0")
    assert res.created_repo and res.created_commit and res.created_tag
    assert res.ref == f"{REPO}@{res.commit}" and len(res.commit or "") == 40
    log = fake_hub.store.log("model", REPO)
    assert [sha for sha, _ in log][0] == res.commit and len(log) == 2  # initial commit + ours
    assert _tags(fake_hub) == {"v0.1.0": res.commit}
    tree = {e.path: e.oid for e in fake_hub.store.tree("model", REPO, res.commit)}  # type: ignore[arg-type]
    assert set(tree) == {".gitattributes", "README.md", "manifest.json", "recipe.yaml", "rotations.safetensors"}
    assert tree["rotations.safetensors"] == git_blob_sha1(art / "rotations.safetensors")
    card = fake_hub.store.read_blob("model", REPO, tree["README.md"]).decode()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "oscar-kv" and meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "int2" in meta["tags"] and meta["oscar"]["bits_per_element"]["128k"] > 2
    assert meta["model-index"][0]["results"][0]["metrics"][0]["value"] == 0.96
    assert _sha256_tree(art) == before  # the artifact directory itself is never modified


def test_identical_repush_makes_no_commit(fake_hub: FakeHub, tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 0)
    first = _push(fake_hub, art, tag="v0.1.0")
    count = fake_hub.store.commit_count("model", REPO)
    fake_hub.requests.clear()
    again = _push(fake_hub, art)  # same files, no tag
    same_tag = _push(fake_hub, art, tag="v0.1.0")  # CI re-run: the tag already names this content
    assert again.commit == same_tag.commit == first.commit
    assert not again.created_commit and not same_tag.created_commit and not same_tag.created_tag
    assert fake_hub.store.commit_count("model", REPO) == count
    assert "commit" not in fake_hub.routes_called()


def test_new_version_gets_new_commit_and_tag(fake_hub: FakeHub, tmp_path: Path) -> None:
    v1 = _push(fake_hub, make_artifact(tmp_path, 0), tag="v0.1.0")
    # a stray file on main must not survive into the next release: the repo mirrors the artifact
    fake_hub.store.commit("model", REPO, "main", adds={"stale.txt": b"old"}, summary="manual edit")
    v2 = _push(fake_hub, make_artifact(tmp_path, 1), tag="v0.2.0")
    assert v2.commit != v1.commit and v2.created_commit
    assert _tags(fake_hub) == {"v0.1.0": v1.commit, "v0.2.0": v2.commit}
    paths = {e.path for e in fake_hub.store.tree("model", REPO, v2.commit)}  # type: ignore[arg-type]
    assert "stale.txt" not in paths and ".gitattributes" in paths


def test_pull_by_tag_and_sha_give_identical_files(fake_hub: FakeHub, tmp_path: Path, hf_isolated: Path) -> None:
    art = make_artifact(tmp_path, 0)
    res = _push(fake_hub, art, tag="v0.1.0")
    _push(fake_hub, make_artifact(tmp_path, 1), tag="v0.2.0")  # main moves on; the tag must not
    by_tag = pull_artifact(f"hf://{REPO}@v0.1.0")
    by_sha = pull_artifact(f"{REPO}@{res.commit}", endpoint=fake_hub.endpoint)
    assert by_tag.name == by_sha.name == res.commit
    assert str(by_tag).startswith(str(hf_isolated))  # downloaded into the HF cache
    pulled = _sha256_tree(by_sha)
    assert pulled == _sha256_tree(by_tag)
    local = _sha256_tree(art)
    for name in ("manifest.json", "recipe.yaml", "rotations.safetensors"):
        assert pulled[name] == local[name]


def test_pull_offline_uses_the_cache(fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    res = _push(fake_hub, make_artifact(tmp_path, 0), tag="v0.1.0")
    online = pull_artifact(f"hf://{REPO}@v0.1.0")
    with socket.socket() as s:  # the Hub unreachable (nothing listens there): a pulled tag still resolves
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert pull_artifact(f"hf://{REPO}@v0.1.0", endpoint=dead) == online
    fake_hub.requests.clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert pull_artifact(f"hf://{REPO}@v0.1.0") == online
    assert pull_artifact(f"hf://{REPO}@{res.commit}") == online
    assert fake_hub.requests == []
    with pytest.raises(HubError, match="not in the local Hugging Face cache and offline mode is on"):
        pull_artifact(f"hf://{REPO}@v9.9.9")


# -- failures: one-line HubError, nothing half-published ----------------------------------------------------
def test_bad_token_is_401_and_creates_nothing(fake_hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(HubError, match="401") as exc:
        _push(fake_hub, make_artifact(tmp_path, 0), tag="v0.1.0", token="hf_not_a_valid_token")
    assert "\n" not in str(exc.value) and "hf_not_a_valid_token" not in str(exc.value) + str(exc.value.hint)
    assert not fake_hub.store.exists("model", REPO)


def test_read_token_cannot_publish(fake_hub: FakeHub, tmp_path: Path) -> None:
    _push(fake_hub, make_artifact(tmp_path, 0))
    with pytest.raises(HubError, match="403"):
        _push(fake_hub, make_artifact(tmp_path, 1), tag="v0.2.0", token=READ_TOKEN)
    assert _tags(fake_hub) == {}


def test_missing_repo_and_revision_are_404(fake_hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(HubError, match="org/missing not found"):
        pull_artifact("hf://org/missing@v0.1.0")
    _push(fake_hub, make_artifact(tmp_path, 0), tag="v0.1.0")
    with pytest.raises(HubError, match="revision 'v0.9.0' not found"):
        pull_artifact(f"hf://{REPO}@v0.9.0")


def test_server_error_mid_upload_leaves_no_tag(fake_hub: FakeHub, tmp_path: Path) -> None:
    v1 = _push(fake_hub, make_artifact(tmp_path, 0), tag="v0.1.0")
    count = fake_hub.store.commit_count("model", REPO)
    fake_hub.fail("commit", 500)
    art = make_artifact(tmp_path, 1)
    with pytest.raises(HubError, match="HTTP 500") as exc:
        _push(fake_hub, art, tag="v0.2.0")
    assert "\n" not in str(exc.value) and "preupload" in fake_hub.routes_called()  # failed mid-upload
    assert _tags(fake_hub) == {"v0.1.0": v1.commit}
    assert fake_hub.store.commit_count("model", REPO) == count
    retry = _push(fake_hub, art, tag="v0.2.0")  # the same command succeeds once the Hub recovers
    assert _tags(fake_hub) == {"v0.1.0": v1.commit, "v0.2.0": retry.commit}


def test_server_error_on_tag_names_the_commit_and_rerun_tags_it(fake_hub: FakeHub, tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 0)
    fake_hub.fail("tag", 503)
    with pytest.raises(HubError, match="but tagging it v0.1.0 failed") as exc:
        _push(fake_hub, art, tag="v0.1.0")
    sha = fake_hub.store.resolve("model", REPO, "main")
    assert sha in str(exc.value) and _tags(fake_hub) == {}
    count = fake_hub.store.commit_count("model", REPO)
    res = _push(fake_hub, art, tag="v0.1.0")
    assert res.commit == sha and res.created_tag and not res.created_commit
    assert fake_hub.store.commit_count("model", REPO) == count


def test_existing_tag_with_other_content_is_refused_before_upload(fake_hub: FakeHub, tmp_path: Path) -> None:
    v1 = _push(fake_hub, make_artifact(tmp_path, 0), tag="v0.1.0")
    count = fake_hub.store.commit_count("model", REPO)
    fake_hub.requests.clear()
    with pytest.raises(HubError, match="tag v0.1.0 already exists"):
        _push(fake_hub, make_artifact(tmp_path, 1), tag="v0.1.0")
    assert "commit" not in fake_hub.routes_called() and "preupload" not in fake_hub.routes_called()
    assert fake_hub.store.commit_count("model", REPO) == count and _tags(fake_hub) == {"v0.1.0": v1.commit}


def test_network_down_is_one_line(tmp_path: Path, hf_isolated: Path) -> None:
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(HubError, match="cannot reach the Hub") as exc:
        push_artifact(make_artifact(tmp_path, 0), REPO, token=WRITE_TOKEN, endpoint=dead, tag="v0.1.0")
    assert "\n" not in str(exc.value)
    with pytest.raises(HubError, match="cannot be reached"):
        pull_artifact(f"{REPO}@v0.1.0", endpoint=dead)


def test_export_while_offline_is_refused(
    fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubError, match="offline mode is on"):
        _push(fake_hub, make_artifact(tmp_path, 0), tag="v0.1.0")
    assert fake_hub.requests == []


def test_invalid_inputs_fail_before_any_request(fake_hub: FakeHub, tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 0)
    with pytest.raises(HubError, match="invalid Hub repo id"):
        _push(fake_hub, art, repo_id="not a repo")
    with pytest.raises(HubError, match="invalid tag"):
        _push(fake_hub, art, tag="main")
    (art / "rotations.safetensors").write_bytes(b"corrupted")
    with pytest.raises(ArtifactError):
        _push(fake_hub, art, tag="v0.1.0")
    with pytest.raises(HubError, match="needs a Hugging Face token"):
        _push(fake_hub, make_artifact(tmp_path, 1), token=None)
    assert fake_hub.requests == []


def test_dry_run_touches_nothing(fake_hub: FakeHub, tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 0)
    before = _sha256_tree(art)
    res = _push(fake_hub, art, tag="v0.1.0", dry_run=True, token=None)
    assert res.dry_run and res.commit is None
    assert [f["path"] for f in res.files] == ["README.md", "manifest.json", "recipe.yaml", "rotations.safetensors"]
    assert fake_hub.requests == [] and not fake_hub.store.exists("model", REPO)
    assert _sha256_tree(art) == before


def test_private_repo_needs_a_token_to_pull(fake_hub: FakeHub, tmp_path: Path) -> None:
    res = _push(fake_hub, make_artifact(tmp_path, 0), tag="v0.1.0", private=True)
    assert fake_hub.store.is_private("model", REPO)
    with pytest.raises(HubError, match="not found"):
        pull_artifact(f"hf://{REPO}@v0.1.0")
    assert pull_artifact(f"hf://{REPO}@v0.1.0", token=READ_TOKEN).name == res.commit


def test_open_artifact_accepts_hf_refs(fake_hub: FakeHub, tmp_path: Path) -> None:
    import torch

    from oscar_cli.artifact import load_artifact, open_artifact

    art = make_artifact(tmp_path, 0)
    res = _push(fake_hub, art, tag="v0.1.0")
    local = load_artifact(art)
    for ref in (f"hf://{REPO}@v0.1.0", f"hf://{REPO}@{res.commit}"):
        remote = open_artifact(ref)
        assert remote.path.name == res.commit and remote.manifest.files == local.manifest.files
        for a, b in zip(remote.layers, local.layers, strict=True):
            assert torch.equal(a.k_rotation, b.k_rotation) and torch.equal(a.v_rotation, b.v_rotation)
    with pytest.raises(HubError, match="not found"):
        open_artifact("hf://org/missing@v0.1.0")


def test_concurrent_push_is_refused_not_interleaved(fake_hub: FakeHub, tmp_path: Path) -> None:
    v1 = _push(fake_hub, make_artifact(tmp_path, 0), tag="v0.1.0")
    racer = lambda: fake_hub.store.commit("model", REPO, "main", adds={"other.txt": b"x"}, summary="racing push")  # noqa: E731
    fake_hub.before("commit", racer)  # main moves between our refs lookup and our commit
    with pytest.raises(HubError, match="changed while uploading"):
        _push(fake_hub, make_artifact(tmp_path, 1), tag="v0.2.0")
    assert _tags(fake_hub) == {"v0.1.0": v1.commit}
    assert fake_hub.store.log("model", REPO)[0][1] == "racing push"  # their commit stands, ours was refused


# -- model card ---------------------------------------------------------------------------------------------
def test_model_card_metadata_and_determinism() -> None:
    from helpers.fakehub.artifacts import make_manifest

    from oscar_cli.artifact.card import render_model_card

    m = make_manifest(0).to_dict()
    assert render_model_card(m, "org/x") == render_model_card(dict(m), "org/x")  # pure function
    m["model"] = {"reference": "Qwen/Qwen3-8B", "resolved": "Qwen/Qwen3-8B@" + "1" * 40}
    m["evaluation"] = {"results": [
        {"task": "niah_single_1", "ctx": 1024, "metric": "string_match_all", "value": 100.0, "method": "bf16"},
        {"task": "niah_single_1", "ctx": 1024, "metric": "string_match_all", "value": 98.0, "method": "oscar"},
    ]}
    card = render_model_card(m, "org/x")
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["base_model"] == "Qwen/Qwen3-8B" and meta["library_name"] == "oscar-kv"
    metrics = [r["metrics"][0]["value"] for r in meta["model-index"][0]["results"]]
    assert metrics == [98.0]  # baselines are shown in the table, never claimed as this model's results
    assert "| bf16 | niah_single_1 @ 1024 | string_match_all | 100.0000 |  |" in card and "Partial run" not in card
    m["evaluation"]["complete"] = False
    assert "Partial run" in render_model_card(m, "org/x")
    del m["evaluation"]
    meta = yaml.safe_load(render_model_card(m, "org/x").split("---")[1])
    assert "model-index" not in meta and meta["oscar"]["quant"]["group_size"] == 16
    m["model"] = {"reference": "./local-model", "resolved": "sha256:" + "0" * 64}
    assert "base_model" not in yaml.safe_load(render_model_card(m, "org/x").split("---")[1])


@pytest.mark.parametrize(("sink", "flag"), [(64, True), (128, True), (32, False), (96, False)])
def test_model_card_serve_line_asks_for_64_token_pages_only_when_the_sink_fits(sink: int, flag: bool) -> None:
    """The vLLM backend refuses pages that split the sink, so the card's `vllm serve` line names --block-size 64
    (its faster page size) only for a sink of whole 64-token blocks; otherwise vLLM's default 16 serves it."""
    from helpers.fakehub.artifacts import make_manifest

    from oscar_cli.artifact.card import render_model_card

    m = make_manifest(0).to_dict()
    m["quant"]["sink"] = sink
    serve = [ln for ln in render_model_card(m, "org/x").splitlines() if ln.startswith("vllm serve")]
    assert len(serve) == 1 and ("--block-size 64" in serve[0]) == flag


def test_token_from_the_hf_login_file(fake_hub: FakeHub, tmp_path: Path) -> None:
    from huggingface_hub import constants

    token_file = Path(constants.HF_TOKEN_PATH)  # under tmp_path (hf_isolated), as `hf auth login` writes it
    token_file.parent.mkdir(parents=True, exist_ok=True)
    token_file.write_text(WRITE_TOKEN)
    res = _push(fake_hub, make_artifact(tmp_path, 0), tag="v0.1.0", token=None)
    assert _tags(fake_hub) == {"v0.1.0": res.commit}


def test_unpinned_pull_fetches_main_and_warns(
    fake_hub: FakeHub, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _push(fake_hub, make_artifact(tmp_path, 0), tag="v0.1.0")
    v2 = _push(fake_hub, make_artifact(tmp_path, 1))
    hub_logger = logging.getLogger("oscar_cli.artifact.hub")
    hub_logger.addHandler(caplog.handler)  # direct: the CLI may have turned off propagation of "oscar_cli"
    try:
        path = pull_artifact(f"hf://{REPO}")
    finally:
        hub_logger.removeHandler(caplog.handler)
    assert path.name == v2.commit
    assert any("not pinned" in r.getMessage() for r in caplog.records)


def test_republish_from_an_hf_ref(fake_hub: FakeHub, tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 0)
    src = _push(fake_hub, art, tag="v0.1.0")
    dst = _push(fake_hub, f"hf://{REPO}@{src.commit}", repo_id="other-org/mirror", tag="v0.1.0")  # type: ignore[arg-type]
    a = {e.path: e.oid for e in fake_hub.store.tree("model", REPO, src.commit)}  # type: ignore[arg-type]
    b = {e.path: e.oid for e in fake_hub.store.tree("model", "other-org/mirror", dst.commit)}  # type: ignore[arg-type]
    assert a.keys() == b.keys()
    assert all(a[k] == b[k] for k in a if k != "README.md")  # same artifact; the card names the new repo


# -- what is published and pulled ---------------------------------------------------------------------------
def test_export_publishes_exactly_the_listed_files_and_the_digest(fake_hub: FakeHub, tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 0)
    (art / "credentials.json").write_text('{"token": "hf_x"}\n')
    with pytest.raises(ArtifactError, match="credentials.json is not part of the artifact"):
        _push(fake_hub, art, tag="v1")
    assert not fake_hub.requests  # refused before any request
    res = _push(fake_hub, art, tag="v1", skip_extra=True)
    sha = _tags(fake_hub)["v1"]
    names = {e.path for e in fake_hub.store.tree("model", REPO, sha)} - {".gitattributes"}  # made by create_repo
    assert names == {"manifest.json", "rotations.safetensors", "recipe.yaml", "README.md"}
    digest = json.loads((art / "manifest.json").read_text())["digest"]
    assert res.digest == digest
    repo = fake_hub.store.path("model", REPO)
    tag_message = fake_hub.store.git(repo, "tag", "-l", "--format=%(contents)", "v1").decode()
    assert f"content digest: {digest}" in tag_message
    assert digest in fake_hub.store.read_blob("model", REPO, next(
        e.oid for e in fake_hub.store.tree("model", REPO, sha) if e.path == "README.md")).decode()


def test_pull_fetches_only_listed_files_and_checks_the_digest(fake_hub: FakeHub, tmp_path: Path) -> None:
    art = make_artifact(tmp_path, 0)
    res = _push(fake_hub, art, tag="v1")
    fake_hub.extra_siblings = ["../../evil.txt", "/etc/evil", "notes.txt"]
    path = pull_artifact(f"hf://{REPO}@v1", endpoint=fake_hub.endpoint, expect_digest=res.digest)
    assert sorted(p.name for p in path.iterdir()) == ["README.md", "manifest.json", "recipe.yaml",
                                                      "rotations.safetensors"]
    assert not list(tmp_path.rglob("*evil*"))
    with pytest.raises(ArtifactError, match="is not the expected"):
        pull_artifact(f"hf://{REPO}@v1", endpoint=fake_hub.endpoint, expect_digest="sha256:" + "1" * 64)
