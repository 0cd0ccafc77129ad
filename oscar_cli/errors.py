"""The one error funnel of oscar.

Every failure a user can cause raises a subclass of :class:`OscarError`. The CLI prints it as one line
(``error: <message>``) plus a hint line, and exits 1; ``OSCAR_DEBUG=1`` prints the traceback instead.
Messages name the fix ("Run: pip install ..."), never a tensor's data or a token.
"""

from __future__ import annotations


class OscarError(Exception):
    """Base class of every user-facing oscar error.

    Args:
        message: one line saying what is wrong.
        hint: one line saying what to do about it (optional).
    """

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class ModelResolutionError(OscarError):
    """A model reference cannot be resolved to files on this machine."""


class MissingDependencyError(OscarError):
    """An optional package that this action needs is not installed."""


class UnsupportedModelError(OscarError):
    """The model's architecture is outside what oscar supports (no RoPE, sliding window, MLA, ...)."""


class RecipeError(OscarError):
    """A recipe file is malformed, has unknown keys or invalid values."""


class ArtifactError(OscarError):
    """An artifact is missing, corrupt, or made for another model."""


class ArtifactVersionError(ArtifactError):
    """An artifact's format_version is not one this oscar can read."""


class CalibrationError(OscarError):
    """Calibration cannot proceed (too few tokens, bad data, ...)."""


class EvalError(OscarError):
    """An evaluation cannot run as asked (length beyond context, unknown task, ...)."""


class KernelUnavailableError(OscarError):
    """A GPU kernel path was asked for where it cannot run (no CUDA, no Triton)."""


class HubError(OscarError):
    """A Hugging Face Hub operation failed (auth, missing repo, network, server error)."""
