"""A small Hub-compatible HTTP server for tests (stdlib ``http.server``), backed by :class:`GitStore`.

It answers the endpoints the real ``huggingface_hub`` client calls for ``oscar export`` / ``oscar pull``
(huggingface_hub 2.4): repo create, ``validate-yaml``, preupload (always ``"regular"``, with the current blob
oid so unchanged files are skipped), the NDJSON commit, tag, branch, refs, repo/revision info, tree listing,
and ``HEAD``/``GET`` on ``resolve`` with ``X-Repo-Commit``, ``ETag`` and ``Content-Length``.

Test hooks: ``tokens`` (token → "read" | "write"), ``fail(route, status, times)`` for fault injection,
``requests`` (a log of ``(method, route, path)``), ``store`` (the git repositories); a hostile server:
``extra_siblings`` (file names such as ``../x`` added to every listing), ``resolve_headers`` (e.g. a crafted
``ETag`` / ``X-Repo-Commit`` on every download).
"""

from __future__ import annotations

import base64
import json
import re
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from .gitstore import GitStore, GitStoreError

_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
Json = dict[str, Any] | list[Any]


class HubHTTPError(Exception):
    """An error answer: HTTP status, message, optional ``X-Error-Code``."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class FakeHub:
    """The server object: ``start()`` on 127.0.0.1 (port 0 → random), ``stop()``; ``endpoint`` is its URL."""

    def __init__(self, root: Path, tokens: dict[str, str] | None = None) -> None:
        self.store = GitStore(Path(root) / "repos")
        self.tokens: dict[str, str] = dict(tokens or {})
        self.requests: list[tuple[str, str, str]] = []
        self._faults: dict[str, list[int]] = {}
        self._hooks: dict[str, list[Callable[[], None]]] = {}
        self._lock = threading.Lock()
        # hostile-server hooks: names added to every repo's file listing, headers forced on every download
        self.extra_siblings: list[str] = []
        self.resolve_headers: dict[str, str] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.endpoint = ""

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fakehub = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        host, port = self._server.server_address[:2]
        self.endpoint = f"http://{host}:{port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fakehub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- test hooks -----------------------------------------------------------------------------
    def fail(self, route: str, status: int = 500, times: int = 1) -> None:
        """Answer the next ``times`` requests of ``route`` (e.g. "commit", "tag", "preupload") with ``status``."""
        with self._lock:
            self._faults.setdefault(route, []).extend([status] * times)

    def before(self, route: str, action: Callable[[], None]) -> None:
        """Run ``action()`` once, just before the next request of ``route`` is handled (e.g. a racing push)."""
        with self._lock:
            self._hooks.setdefault(route, []).append(action)

    def _take_hook(self, route: str) -> Callable[[], None] | None:
        with self._lock:
            queue = self._hooks.get(route)
            return queue.pop(0) if queue else None

    def routes_called(self) -> list[str]:
        """Route names of every request so far, in order."""
        return [r for _, r, _ in self.requests]

    def _take_fault(self, route: str) -> int | None:
        with self._lock:
            queue = self._faults.get(route)
            return queue.pop(0) if queue else None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fakehub: FakeHub

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # tests stay quiet; `FakeHub.requests` is the log

    # -- plumbing -------------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Json, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def _error(self, err: HubHTTPError | GitStoreError) -> None:
        headers = {"X-Error-Message": err.message}
        if err.code:
            headers["X-Error-Code"] = err.code
        self._json(err.status, {"error": err.message}, headers)

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        segs = [unquote(s) for s in url.path.split("/")[1:]]
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        body = self._body() if method in ("POST", "DELETE") else b""
        route, handler = self._route(method, segs)
        self.fakehub.requests.append((method, route, url.path))
        try:
            hook = self.fakehub._take_hook(route)
            if hook is not None:
                hook()
            status = self.fakehub._take_fault(route)
            if status is not None:
                raise HubHTTPError(status, f"injected failure on {route}")
            if handler is None:
                raise HubHTTPError(404, f"no route for {method} {url.path}")
            handler(segs, query, body)
        except (HubHTTPError, GitStoreError) as err:
            self._error(err)

    def _route(self, method: str, s: list[str]) -> tuple[str, Callable[..., None] | None]:
        """Map a request to ``(route name, handler)``; the name is what ``FakeHub.fail`` keys on."""
        if s[:1] == ["api"]:
            if s[1:3] == ["repos", "create"] and method == "POST":
                return "create", self.h_create
            if s[1:] == ["validate-yaml"] and method == "POST":
                return "validate-yaml", self.h_validate_yaml
            if s[1:] == ["whoami-v2"] and method == "GET":
                return "whoami", self.h_whoami
            if len(s) >= 5 and s[1] in _TYPES:
                action = s[4] if len(s) > 4 else ""
                table: dict[tuple[str, str], tuple[str, Callable[..., None]]] = {
                    ("GET", ""): ("info", self.h_info),
                    ("GET", "revision"): ("info", self.h_info),
                    ("GET", "refs"): ("refs", self.h_refs),
                    ("GET", "tree"): ("tree", self.h_tree),
                    ("POST", "preupload"): ("preupload", self.h_preupload),
                    ("POST", "commit"): ("commit", self.h_commit),
                    ("POST", "tag"): ("tag", self.h_tag),
                    ("DELETE", "tag"): ("delete-tag", self.h_delete_tag),
                    ("POST", "branch"): ("branch", self.h_branch),
                }
                if (method, action) in table:
                    return table[(method, action)]
            if len(s) == 4 and s[1] in _TYPES and method == "GET":
                return "info", self.h_info
        elif method in ("GET", "HEAD"):
            if len(s) >= 5 and s[0] in ("datasets", "spaces") and s[3] == "resolve":
                return "resolve", self.h_resolve
            if len(s) >= 4 and s[2] == "resolve":
                return "resolve", self.h_resolve
        return "unknown", None

    # -- auth -----------------------------------------------------------------------------------
    def _token_role(self) -> str | None:
        """``None`` when no token was sent; raise 401 when the token is unknown."""
        auth = self.headers.get("Authorization", "")
        if not auth:
            return None
        token = auth.removeprefix("Bearer ").strip()
        role = self.fakehub.tokens.get(token)
        if role is None:
            raise HubHTTPError(401, "Invalid credentials in Authorization header")
        return role

    def _need_write(self) -> None:
        role = self._token_role()
        if role is None:
            raise HubHTTPError(401, "You must be authenticated to access this resource (no token sent)")
        if role != "write":
            raise HubHTTPError(403, "You don't have the rights to write to this repository (read token)")

    def _repo(self, s: list[str], write: bool = False) -> tuple[str, str]:
        """``(repo_type, "org/name")`` from ``/api/{t}/{org}/{name}/...``; 404 RepoNotFound if absent."""
        repo_type, repo_id = _TYPES[s[1]], f"{s[2]}/{s[3]}"
        if write:
            self._need_write()
        else:
            role = self._token_role()
            if self.fakehub.store.exists(repo_type, repo_id) and self.fakehub.store.is_private(
                repo_type, repo_id
            ) and role is None:
                raise HubHTTPError(404, "Repository not found", "RepoNotFound")
        if not self.fakehub.store.exists(repo_type, repo_id):
            raise HubHTTPError(404, f"Repository not found: {repo_id}", "RepoNotFound")
        return repo_type, repo_id

    def _resolve(self, repo_type: str, repo_id: str, rev: str) -> str:
        sha = self.fakehub.store.resolve(repo_type, repo_id, rev)
        if sha is None:
            raise HubHTTPError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return sha

    # -- write endpoints ------------------------------------------------------------------------
    def h_create(self, s: list[str], q: dict[str, str], body: bytes) -> None:
        self._need_write()
        payload = json.loads(body or b"{}")
        org, name = payload.get("organization") or "user", payload["name"]
        repo_type = payload.get("type") or "model"
        repo_id = f"{org}/{name}"
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        url = f"{self.fakehub.endpoint}/{prefix}{repo_id}"
        if self.fakehub.store.exists(repo_type, repo_id):
            self._json(409, {"error": "You already created this model repo", "url": url})
            return
        private = bool(payload.get("private")) or payload.get("visibility") == "private"
        self.fakehub.store.create(repo_type, repo_id, private=private)
        self._json(200, {"url": url, "name": repo_id, "id": repo_id})

    def h_validate_yaml(self, s: list[str], q: dict[str, str], body: bytes) -> None:
        content = json.loads(body or b"{}").get("content", "")
        errors = []
        if content.startswith("---"):
            import yaml

            try:
                front = content.split("---", 2)[1]
                if not isinstance(yaml.safe_load(front) or {}, dict):
                    errors.append({"message": "metadata is not a mapping"})
            except (IndexError, yaml.YAMLError) as exc:
                errors.append({"message": f"invalid YAML: {exc}"})
        self._json(400 if errors else 200, {"errors": errors, "warnings": []})

    def h_preupload(self, s: list[str], q: dict[str, str], body: bytes) -> None:
        repo_type, repo_id = self._repo(s, write=True)
        sha = self._resolve(repo_type, repo_id, s[5])
        current = {e.path: e.oid for e in self.fakehub.store.tree(repo_type, repo_id, sha)}
        files = json.loads(body)["files"]
        answer = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                   "oid": current.get(f["path"])} for f in files]
        self._json(200, {"files": answer, "commitOid": sha})

    def h_commit(self, s: list[str], q: dict[str, str], body: bytes) -> None:
        repo_type, repo_id = self._repo(s, write=True)
        branch = s[5]
        if q.get("create_pr") in ("1", "true"):
            raise HubHTTPError(400, "fakehub does not implement pull requests")
        if branch not in {b.name for b in self.fakehub.store.refs(repo_type, repo_id)[0]}:
            raise HubHTTPError(400 if self.fakehub.store.resolve(repo_type, repo_id, branch) else 404,
                               f"Invalid rev id: {branch} (commits go to a branch)", "RevisionNotFound")
        header: dict[str, Any] = {}
        adds: dict[str, bytes] = {}
        deletes: list[str] = []
        folders: list[str] = []
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                header = value
            elif key == "file":
                if value.get("encoding") != "base64":
                    raise HubHTTPError(400, f"unsupported encoding {value.get('encoding')!r}")
                adds[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                deletes.append(value["path"])
            elif key == "deletedFolder":
                folders.append(value["path"])
            else:
                raise HubHTTPError(400, f"fakehub answered 'regular' for every file; got a {key!r} operation")
        if "summary" not in header:
            raise HubHTTPError(400, "commit header missing")
        sha = self.fakehub.store.commit(
            repo_type, repo_id, branch, adds=adds, deletes=deletes, deleted_folders=folders,
            summary=header["summary"], description=header.get("description") or "",
            parent=header.get("parentCommit"),
        )
        self._json(200, {"commitUrl": f"{self.fakehub.endpoint}/{repo_id}/commit/{sha}", "commitOid": sha,
                         "success": True})

    def h_tag(self, s: list[str], q: dict[str, str], body: bytes) -> None:
        repo_type, repo_id = self._repo(s, write=True)
        sha = self._resolve(repo_type, repo_id, s[5])
        payload = json.loads(body or b"{}")
        if not payload.get("tag"):
            raise HubHTTPError(400, "tag name missing")
        self.fakehub.store.create_tag(repo_type, repo_id, payload["tag"], sha, payload.get("message"))
        self._json(200, {})

    def h_delete_tag(self, s: list[str], q: dict[str, str], body: bytes) -> None:
        repo_type, repo_id = self._repo(s, write=True)
        self.fakehub.store.delete_tag(repo_type, repo_id, s[5])
        self._json(200, {})

    def h_branch(self, s: list[str], q: dict[str, str], body: bytes) -> None:
        repo_type, repo_id = self._repo(s, write=True)
        payload = json.loads(body or b"{}")
        sha = self._resolve(repo_type, repo_id, payload.get("startingPoint") or "main")
        self.fakehub.store.create_branch(repo_type, repo_id, s[5], sha)
        self._json(200, {})

    # -- read endpoints -------------------------------------------------------------------------
    def h_whoami(self, s: list[str], q: dict[str, str], body: bytes) -> None:
        if self._token_role() is None:
            raise HubHTTPError(401, "Invalid user token.")
        self._json(200, {"type": "user", "name": "user", "auth": {"accessToken": {"role": "write"}}})

    def h_info(self, s: list[str], q: dict[str, str], body: bytes) -> None:
        repo_type, repo_id = self._repo(s)
        rev = s[5] if len(s) > 5 and s[4] == "revision" else "main"
        sha = self._resolve(repo_type, repo_id, rev)
        files = self.fakehub.store.tree(repo_type, repo_id, sha)
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")
        self._json(200, {
            "id": repo_id, "modelId": repo_id, "sha": sha, "private": self.fakehub.store.is_private(
                repo_type, repo_id), "disabled": False, "gated": False, "downloads": 0, "likes": 0,
            "tags": [], "lastModified": now, "createdAt": now,
            "siblings": [{"rfilename": e.path} for e in files] + [{"rfilename": n} for n in self.fakehub.extra_siblings],
        })

    def h_refs(self, s: list[str], q: dict[str, str], body: bytes) -> None:
        repo_type, repo_id = self._repo(s)
        branches, tags = self.fakehub.store.refs(repo_type, repo_id)
        out: dict[str, Any] = {
            "branches": [{"name": r.name, "ref": r.ref, "targetCommit": r.target} for r in branches],
            "tags": [{"name": r.name, "ref": r.ref, "targetCommit": r.target} for r in tags],
            "converts": [],
        }
        if q.get("include_prs") in ("1", "true", "True"):
            out["pullRequests"] = []
        self._json(200, out)

    def h_tree(self, s: list[str], q: dict[str, str], body: bytes) -> None:
        repo_type, repo_id = self._repo(s)
        sha = self._resolve(repo_type, repo_id, s[5])
        prefix = "/".join(s[6:]).strip("/")
        recursive = q.get("recursive", "false").lower() in ("1", "true")
        entries: list[dict[str, Any]] = []
        dirs: set[str] = set()
        for e in self.fakehub.store.tree(repo_type, repo_id, sha):
            if prefix and not e.path.startswith(prefix + "/"):
                continue
            rel = e.path[len(prefix) + 1:] if prefix else e.path
            parts = rel.split("/")
            for i in range(1, len(parts)):
                if recursive or i == 1:
                    dirs.add("/".join(([prefix] if prefix else []) + parts[:i]))
            if recursive or len(parts) == 1:
                entries.append({"type": "file", "path": e.path, "size": e.size, "oid": e.oid})
        if prefix and not entries and not dirs:
            raise HubHTTPError(404, f"Entry not found: {prefix}", "EntryNotFound")
        entries += [{"type": "directory", "path": d, "oid": "0" * 40} for d in sorted(dirs)]
        self._json(200, sorted(entries, key=lambda x: x["path"]))

    def h_resolve(self, s: list[str], q: dict[str, str], body: bytes) -> None:
        if s[0] in ("datasets", "spaces"):
            repo_type, repo_id, rev, path = _TYPES[s[0]], f"{s[1]}/{s[2]}", s[4], "/".join(s[5:])
        else:
            repo_type, repo_id, rev, path = "model", f"{s[0]}/{s[1]}", s[3], "/".join(s[4:])
        self._repo(["api", f"{repo_type}s", *repo_id.split("/")])
        sha = self._resolve(repo_type, repo_id, rev)
        entry = next((e for e in self.fakehub.store.tree(repo_type, repo_id, sha) if e.path == path), None)
        if entry is None:
            raise HubHTTPError(404, f"Entry not found: {path}", "EntryNotFound")
        data = self.fakehub.store.read_blob(repo_type, repo_id, entry.oid)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{entry.oid}"', "Accept-Ranges": "bytes",
                   **self.fakehub.resolve_headers}
        rng = re.match(r"bytes=(\d+)-(\d*)$", self.headers.get("Range", ""))
        if rng and self.command == "GET":
            start = int(rng.group(1))
            end = int(rng.group(2)) if rng.group(2) else len(data) - 1
            part = data[start:end + 1]
            headers["Content-Range"] = f"bytes {start}-{start + len(part) - 1}/{len(data)}"
            self._send(206, part, headers, "application/octet-stream")
            return
        headers["Content-Length"] = str(len(data))
        self._send(200, data, headers, "application/octet-stream")
