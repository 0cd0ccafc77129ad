"""Hub model references against the in-repo fake Hub (tests/fakehub): download, pin, cache, offline, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.fakehub import FakeHub
from helpers.fakehub.fixtures import WRITE_TOKEN
from helpers.tiny import write_tiny_model

from oscar_cli import model as models
from oscar_cli.errors import HubError, ModelResolutionError


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = write_tiny_model(tmp_path_factory.mktemp("hubsrc") / "tiny")  # its own copy: the tests add files
    (d / "README.md").write_text("# tiny\n")
    return d


def _push(hub: FakeHub, folder: Path, message: str) -> str:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.endpoint, token=WRITE_TOKEN)
    api.create_repo("org/tiny", exist_ok=True)
    return api.upload_folder(repo_id="org/tiny", folder_path=str(folder), commit_message=message).oid


@pytest.mark.unit
def test_download_pin_and_offline_reuse(
    fake_hub: FakeHub,
    tiny_src: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path / "oscar-cache"))
    first = _push(fake_hub, tiny_src, "v1")
    # Config only: no weights fetched, same identity.
    ident = models.resolve_model("org/tiny", weights=False)
    assert ident.resolved == f"org/tiny@{first}" and not list(ident.path.glob("*.safetensors"))
    # Full resolution downloads the weights into the same snapshot; the model loads from it.
    ident = models.resolve_model("org/tiny")
    assert ident.kind == "hub" and ident.resolved == f"org/tiny@{first}" and (ident.path / "model.safetensors").is_file()
    assert not (ident.path / "README.md").exists()  # only model files are fetched
    lm = models.load_model("org/tiny")
    assert lm.identity == ident and lm.source == "directory"
    # A new commit moves main; the old sha stays reachable as a pin.
    (tiny_src / "generation_config.json").write_text('{"do_sample": false}')
    second = _push(fake_hub, tiny_src, "v2")
    assert second != first
    assert models.resolve_model("org/tiny").resolved == f"org/tiny@{second}"
    assert models.resolve_model(f"org/tiny@{first}").resolved == f"org/tiny@{first}"
    # Hub unreachable (a port nobody listens on; stopping the server would leave keep-alive connections
    # served): the cache answers for what it holds; anything else is a one-line HubError.
    dead = "http://127.0.0.1:9"
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", dead + "/{repo_id}/resolve/{revision}/{filename}")
    assert models.resolve_model("org/tiny").resolved == f"org/tiny@{second}"
    with pytest.raises(HubError, match="the Hub cannot be reached"):
        models.resolve_model("org/other")
    # Offline: the same, without trying the network; an unknown repo names the other forms.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert models.resolve_model("org/tiny").resolved == f"org/tiny@{second}"
    assert models.resolve_model(f"org/tiny@{first}", weights=False).resolved == f"org/tiny@{first}"
    with pytest.raises(ModelResolutionError, match="offline mode is on"):
        models.resolve_model("org/other")


@pytest.mark.unit
def test_unknown_repo_and_revision(fake_hub: FakeHub, tiny_src: Path) -> None:
    _push(fake_hub, tiny_src, "v1")
    with pytest.raises(ModelResolutionError, match="no model repo org/absent on the Hub"):
        models.resolve_model("org/absent")
    with pytest.raises(ModelResolutionError, match="revision 'nope' not found in org/tiny"):
        models.resolve_model("org/tiny@nope")
