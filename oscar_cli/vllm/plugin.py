"""The ``vllm.general_plugins`` entry point: registers oscar's INT2 backend as vLLM's ``CUSTOM`` attention backend.

vLLM loads general plugins in every process (API server, engine core, workers) and may call them more than once,
so :func:`register` is idempotent and light: it only records the class path
(``register_backend(AttentionBackendEnum.CUSTOM, "oscar_cli.vllm.backend.OscarInt2Backend")``), so that
``--attention-backend CUSTOM`` selects it (vLLM 0.25 has no other registry for out-of-tree attention backends; a
``CUSTOM`` slot already taken by another plugin is left alone, with a warning). The backend module itself is
imported by vLLM when a layer first resolves the backend (in the worker), and installs its page-size hook then.

It also makes prefix caching default to off for engines that run the INT2 backend (``--attention-backend CUSTOM``
with an ``oscar_artifact``): vLLM turns it on by default, and the backend's BF16 tiers are per request. An explicit
``--enable-prefix-caching`` is kept, and the backend refuses it at engine start.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

BACKEND_PATH = "oscar_cli.vllm.backend.OscarInt2Backend"
_log = logging.getLogger(__name__)


def register() -> None:
    """Register the backend and the page-size hook (no-op on a second call); arms the periodic stack dumps of
    ``OSCAR_VLLM_STACKS_EVERY`` (:mod:`oscar_cli.vllm.debug`) in every vLLM process."""
    from oscar_cli.vllm.debug import arm_stack_dumps

    arm_stack_dumps()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden() and custom.get_path() != BACKEND_PATH:
        _log.warning("oscar: the CUSTOM attention backend is already %s; oscar's INT2 backend is not registered",
                     custom.get_path())
        return
    register_backend(custom, BACKEND_PATH)
    _prefix_caching_off_by_default()


def runs_oscar(engine_args: Any) -> bool:
    """Whether vLLM engine arguments select oscar's backend: ``CUSTOM`` plus an ``oscar_artifact`` setting."""
    backend = getattr(engine_args, "attention_backend", None)
    name = getattr(backend, "name", backend)
    extra = getattr(engine_args, "additional_config", None)
    return str(name).upper() == "CUSTOM" and isinstance(extra, dict) and bool(extra.get("oscar_artifact"))


def with_prefix_caching_off(create_engine_config: Callable[..., Any]) -> Callable[..., Any]:
    """``EngineArgs.create_engine_config`` wrapped: for the INT2 backend, prefix caching left unset becomes off,
    with a note (an explicit setting is kept)."""

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if runs_oscar(self) and getattr(self, "enable_prefix_caching", False) is None:
            self.enable_prefix_caching = False
            _log.warning("oscar: prefix caching is off for the INT2 backend (its BF16 sink and recent tiers are "
                         "per request)")
        return create_engine_config(self, *args, **kwargs)

    wrapped._oscar = True  # type: ignore[attr-defined]
    return wrapped


def _prefix_caching_off_by_default() -> None:
    """Wrap ``EngineArgs.create_engine_config`` once, in the process that builds engine configs: vLLM loads the
    general plugins from ``EngineArgs.__post_init__``, so that module is imported there (other processes skip)."""
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    engine_args = getattr(arg_utils, "EngineArgs", None)
    if engine_args is None or getattr(engine_args.create_engine_config, "_oscar", False):
        return
    engine_args.create_engine_config = with_prefix_caching_off(engine_args.create_engine_config)
