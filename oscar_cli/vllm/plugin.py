"""The ``vllm.general_plugins`` entry point: registers oscar's INT2 backend as vLLM's ``CUSTOM`` attention backend.

vLLM loads general plugins in every process (API server, engine core, workers) and may call them more than once,
so :func:`register` is idempotent and light: it only records the class path
(``register_backend(AttentionBackendEnum.CUSTOM, "oscar_cli.vllm.backend.OscarInt2Backend")``), so that
``--attention-backend CUSTOM`` selects it (vLLM 0.25 has no other registry for out-of-tree attention backends; a
``CUSTOM`` slot already taken by another plugin is left alone, with a warning). The backend module itself is
imported by vLLM when a layer first resolves the backend (in the worker), and installs its page-size hook then.
"""

from __future__ import annotations

import logging

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
