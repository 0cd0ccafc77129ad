"""A local Hub-compatible HTTP server for tests (see ``server.py``); repositories are real git repos."""

from .gitstore import GitStore, GitStoreError
from .server import FakeHub

__all__ = ["FakeHub", "GitStore", "GitStoreError"]
