"""Shared fixtures for the whole test suite.

Helpers live in ``tests/helpers`` (importable as ``helpers``: this rootdir conftest puts ``tests/`` on
``sys.path``). Fixtures here:

- ``tiny_model_dir`` (session): a tiny random Llama + word-level tokenizer saved as a model directory
  (:func:`helpers.tiny.write_tiny_model`); treat it as read-only, copy it to modify it.
- ``tiny_loaded``: a fresh tiny :class:`~oscar_cli.model.LoadedModel` (char tokenizer) on CPU.
- ``oscar_cache``: a private ``OSCAR_CACHE_DIR`` under ``tmp_path`` for this test.
- ``hf_isolated`` / ``fake_hub``: huggingface_hub pointed at a private cache / an in-process fake Hub
  (:mod:`helpers.fakehub.fixtures`).

The Triton interpreter. On a machine without CUDA the kernel tests run in Triton's interpreter, which
``TRITON_INTERPRET=1`` selects. Triton reads it when a ``@triton.jit`` function is *defined*: our kernel modules
(imported lazily by ``oscar_kernels.ops``) but also ``triton.language.standard`` (``tl.sort``, ``tl.max``...),
defined when ``triton`` itself is first imported, which torch and transformers may do in any earlier test. A
per-test fixture therefore cannot switch it on reliably; instead :func:`pytest_configure` sets it for the test
session (never at import of a test module), only when no CUDA device is present and the variable is unset, and
:func:`pytest_unconfigure` restores the environment. With CUDA nothing changes. oscar's CPU guards
(``quant/kernel_path.py``, ``eval/prepare.py``) read the variable at call time, so a test of the behaviour without
the interpreter does ``monkeypatch.delenv("TRITON_INTERPRET")``. Subprocesses started by tests inherit it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

# hf_isolated, fake_hub: the fake Hub speaks huggingface_hub's own HTTP client (httpx2 from huggingface_hub 2);
# a GPU machine with an older huggingface_hub still runs the gpu-marked tests, which need no Hub.
pytest_plugins = ["helpers.fakehub.fixtures"] if importlib.util.find_spec("httpx2") else []


_INTERPRET_KEY = pytest.StashKey[bool]()


def pytest_configure(config: pytest.Config) -> None:
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
        config.stash[_INTERPRET_KEY] = True


def pytest_unconfigure(config: pytest.Config) -> None:
    if config.stash.get(_INTERPRET_KEY, False):
        os.environ.pop("TRITON_INTERPRET", None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (2 layers, GQA 4/2, head_dim 16, 256 positions) saved as a model directory."""
    from helpers.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny-llama")


@pytest.fixture
def tiny_loaded() -> Any:
    """A tiny Llama with a character tokenizer, as ``load_model`` returns it (4096 positions, CPU, float32)."""
    from helpers.tiny import tiny_loaded

    return tiny_loaded()


@pytest.fixture
def oscar_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private oscar cache directory (``OSCAR_CACHE_DIR``: hash index, conversion entries) for this test."""
    from oscar_cli.model import cache as model_cache

    d = tmp_path / "oscar-cache"
    monkeypatch.setenv(model_cache.CACHE_ENV, str(d))
    return d


@pytest.fixture
def one_torch_thread() -> Any:
    """Tiny matmuls: on a busy 2-core machine a second OpenMP thread makes them many times slower (a module opts in
    with ``pytestmark = [..., pytest.mark.usefixtures("one_torch_thread")]``)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
