"""pytest fixtures around :class:`FakeHub` (registered for every test by tests/conftest.py).

``hf_isolated``: every ``huggingface_hub`` constant that was read at import (cache, token file, offline, Xet,
endpoint) is pointed at ``tmp_path`` / safe values, and token variables are removed from the environment, so
no test can see (or leak) the developer's real token or cache. ``fake_hub``: a running server on 127.0.0.1
(random port, one thread) whose URL is also ``constants.ENDPOINT``; stopped after the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from .server import FakeHub

WRITE_TOKEN = "hf_fakehubWRITE0123456789abcdefXYZ"
READ_TOKEN = "hf_fakehubREAD0123456789abcdefXYZ"


class LocalOnlyTransport(httpx2.HTTPTransport):
    """The real transport, refusing any host but 127.0.0.1 (a misrouted request fails the test at once,
    instead of retrying against huggingface.co for half a minute)."""

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        if request.url.host not in ("127.0.0.1", "localhost"):
            raise AssertionError(f"test guard: request to {request.url.host} (only 127.0.0.1 is allowed)")
        return super().handle_request(request)


def _local_only_client() -> httpx2.Client:
    from huggingface_hub.utils._http import hf_request_event_hook

    # the same client as huggingface_hub's default_client_factory, with the guarded transport
    return httpx2.Client(event_hooks={"request": [hf_request_event_hook]}, follow_redirects=True, timeout=None,
                         transport=LocalOnlyTransport())


@pytest.fixture
def hf_isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Point huggingface_hub at a private cache under tmp_path, offline off, Xet off, HTTP only to 127.0.0.1;
    yield the cache dir."""
    from huggingface_hub import constants, set_client_factory
    from huggingface_hub.utils import _http

    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf-home" / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # upload_folder then takes the single create_commit path.
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    previous = _http._GLOBAL_CLIENT_FACTORY
    set_client_factory(_local_only_client)
    try:
        yield cache
    finally:
        set_client_factory(previous)


@pytest.fixture
def fake_hub(tmp_path: Path, hf_isolated: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A started FakeHub (tokens: WRITE_TOKEN → write, READ_TOKEN → read); ``constants.ENDPOINT`` is its URL."""
    from huggingface_hub import constants

    hub = FakeHub(tmp_path / "fakehub", tokens={WRITE_TOKEN: "write", READ_TOKEN: "read"}).start()
    # Both are read at import; hf_hub_url() swaps in an explicit endpoint only where the template starts with
    # ENDPOINT, so patching one without the other sends downloads to huggingface.co.
    monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
    )
    try:
        yield hub
    finally:
        hub.stop()
