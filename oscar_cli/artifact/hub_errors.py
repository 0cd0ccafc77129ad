"""Hub and network failures → one-line :class:`~oscar_cli.errors.HubError` (with a hint), and quiet Hub logs.

``hub_errors(action, repo_id, endpoint)`` wraps every ``huggingface_hub`` call of ``oscar export`` / ``pull``:
401 (token rejected), 403 (no write access), 404 (repo or revision), 412 (a racing push), 5xx, offline mode,
a revision missing from the cache while offline, a server answer the client refuses (``ValueError``: e.g. a
file name with ``../``), and transport errors (``httpx2`` under huggingface_hub 2.x,
``httpx`` under 1.x) each get their own message. Messages never contain the token: only the action, the repo,
the endpoint and the server's first line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from oscar_cli.errors import HubError

logger = logging.getLogger(__name__)

TOKEN_HINT = "pass --token, set HF_TOKEN, or run: hf auth login"


def _first_line(exc: BaseException) -> str:
    server = getattr(exc, "server_message", None)
    text = str(server or exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


@contextmanager
def quiet_hub_logs() -> Iterator[None]:
    """Hide ``huggingface_hub``'s INFO/WARNING chatter (oscar reports the outcome itself) unless -v is on."""
    hub_logger = logging.getLogger("huggingface_hub")
    before = hub_logger.level
    if not logger.isEnabledFor(logging.INFO):
        hub_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hub_logger.setLevel(before)


def _network_errors() -> tuple[type[Exception], ...]:
    """Network failures: the HTTP library's transport errors (``httpx2`` under huggingface_hub 2.x, ``httpx``
    under 1.x) and the builtin connection/timeout errors."""
    try:
        import httpx2

        transport: type[Exception] = httpx2.TransportError
    except ImportError:  # huggingface_hub 1.x
        import httpx

        transport = httpx.TransportError
    return (transport, ConnectionError, TimeoutError)


@contextmanager
def hub_errors(action: str, repo_id: str, endpoint: str, revision: str | None = None) -> Iterator[None]:
    """Translate ``huggingface_hub`` / network exceptions raised while ``action`` runs into one-line HubErrors."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except HubError:
        raise
    except GatedRepoError:
        raise HubError(f"{repo_id} is gated: accept its conditions on the Hub first", hint=TOKEN_HINT) from None
    except RepositoryNotFoundError:
        raise HubError(
            f"{action}: repo {repo_id} not found on {endpoint} (or it is private and the token cannot see it)",
            hint="check the repo id; private repos need a token with access: " + TOKEN_HINT,
        ) from None
    except RevisionNotFoundError:
        raise HubError(
            f"{action}: revision {revision!r} not found in {repo_id}",
            hint="check the spelling: pin a tag that exists in the repo, or a 40-hex commit sha",
        ) from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else 0
        if status == 401:
            raise HubError(f"{action}: the Hub rejected the token (401 Unauthorized)", hint=TOKEN_HINT) from None
        if status == 403:
            raise HubError(
                f"{action}: the token may not write to {repo_id} (403 Forbidden)",
                hint="use a token with write access to that namespace",
            ) from None
        if status == 412:
            raise HubError(
                f"{action}: {repo_id} changed while uploading (another push landed first); nothing was tagged",
                hint="re-run the same command: it uploads on top of the new head",
            ) from None
        if status >= 500:
            raise HubError(
                f"{action}: the Hub failed with HTTP {status} ({_first_line(exc)})",
                hint="a transient server error: re-run the same command"
                + (" (nothing was tagged)" if action.startswith("export") else ""),
            ) from None
        raise HubError(f"{action}: HTTP {status} from the Hub: {_first_line(exc)}") from None
    except OfflineModeIsEnabled:
        raise HubError(f"{action}: offline mode is on (HF_HUB_OFFLINE=1), the Hub cannot be used",
                       hint="unset HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE) to talk to the Hub") from None
    except LocalEntryNotFoundError:
        from huggingface_hub import constants

        why = "offline mode is on (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else f"{endpoint} cannot be reached"
        raise HubError(
            f"{action}: {repo_id}{'@' + revision if revision else ''} is not in the local Hugging Face cache "
            f"and {why}",
            hint="pull it once online; offline, only revisions already in the cache resolve",
        ) from None
    except _network_errors() as exc:
        raise HubError(
            f"{action}: cannot reach the Hub at {endpoint} ({type(exc).__name__})",
            hint="check the network or --endpoint / HF_ENDPOINT",
        ) from None
    except ValueError as exc:  # huggingface_hub refusing what the server sent, e.g. a file name with ../
        raise HubError(
            f"{action}: huggingface_hub refused the answer of {endpoint} for {repo_id} ({_first_line(exc)[:120]})",
            hint="the repo holds file names or metadata no artifact has; pull only from hosts and repos you trust",
        ) from None
