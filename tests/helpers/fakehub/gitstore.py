"""Real git repositories on disk behind the fake Hub, driven through the ``git`` CLI.

Every Hub repository is a bare repository ``<root>/<type>s/<org>/<name>.git``; branches are ``refs/heads/*``,
tags ``refs/tags/*`` (annotated when a message is given), commits are real commit objects built with git
plumbing (``hash-object``, a temporary index, ``write-tree``, ``commit-tree``, a compare-and-swap
``update-ref``). A file's ``oid`` is its git blob SHA-1, exactly as on the Hub.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

_SHA_RE = re.compile(r"^[0-9a-f]{40}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"


class GitStoreError(Exception):
    """A request the store refuses; ``status`` and ``code`` become the HTTP answer."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


@dataclass(frozen=True)
class TreeEntry:
    """One file of a commit's tree: path, size in bytes, git blob SHA-1."""

    path: str
    size: int
    oid: str


@dataclass(frozen=True)
class Ref:
    """A branch or tag and the commit it points at (tags peeled)."""

    name: str
    ref: str
    target: str


class GitStore:
    """Bare git repositories keyed by ``(repo_type, "org/name")``; thread-safe (one lock for writes)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self._private: dict[tuple[str, str], bool] = {}
        self._env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.root),
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull,
            "GIT_AUTHOR_NAME": "fakehub",
            "GIT_AUTHOR_EMAIL": "fakehub@127.0.0.1",
            "GIT_COMMITTER_NAME": "fakehub",
            "GIT_COMMITTER_EMAIL": "fakehub@127.0.0.1",
            "LC_ALL": "C",
        }

    # -- plumbing -------------------------------------------------------------------------------
    def path(self, repo_type: str, repo_id: str) -> Path:
        """The bare repository directory of a repo (it may not exist)."""
        org, name = repo_id.split("/", 1)
        return self.root / f"{repo_type}s" / org / f"{name}.git"

    def git(
        self, repo: Path, *args: str, input: bytes | None = None, env: dict[str, str] | None = None
    ) -> bytes:
        """Run ``git --git-dir=repo args...`` and return stdout; raise ``GitStoreError(500)`` on failure."""
        full_env = dict(self._env, **(env or {}))
        proc = subprocess.run(
            ["git", f"--git-dir={repo}", *args], input=input, capture_output=True, env=full_env, check=False
        )
        if proc.returncode != 0:
            raise GitStoreError(500, f"git {args[0]} failed: {proc.stderr.decode(errors='replace').strip()}")
        return proc.stdout

    # -- repositories ---------------------------------------------------------------------------
    def exists(self, repo_type: str, repo_id: str) -> bool:
        return self.path(repo_type, repo_id).is_dir()

    def is_private(self, repo_type: str, repo_id: str) -> bool:
        return self._private.get((repo_type, repo_id), False)

    def create(self, repo_type: str, repo_id: str, private: bool = False) -> None:
        """Create a bare repo whose ``main`` holds one "initial commit" with ``.gitattributes`` (as the Hub)."""
        org, _, name = repo_id.partition("/")
        if not (_NAME_RE.match(org) and _NAME_RE.match(name)):
            raise GitStoreError(400, f"invalid repo id {repo_id!r}")
        with self.lock:
            repo = self.path(repo_type, repo_id)
            if repo.exists():
                raise GitStoreError(409, "You already created this repo")
            repo.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                ["git", "init", "-q", "--bare", "-b", "main", str(repo)], check=True, env=self._env
            )
            self._private[(repo_type, repo_id)] = private
            self.commit(repo_type, repo_id, "main", adds={".gitattributes": GITATTRIBUTES},
                        summary="initial commit", allow_root=True)

    # -- reading --------------------------------------------------------------------------------
    def resolve(self, repo_type: str, repo_id: str, revision: str) -> str | None:
        """A branch, tag or full commit sha → commit sha; None if it does not resolve."""
        repo = self.path(repo_type, repo_id)
        if _SHA_RE.match(revision):
            candidates = [revision]
        elif revision.startswith("-") or not revision:
            return None
        else:
            candidates = [f"refs/heads/{revision}", f"refs/tags/{revision}"]
        for cand in candidates:
            try:
                return self.git(repo, "rev-parse", "--verify", "-q", f"{cand}^{{commit}}").decode().strip()
            except GitStoreError:
                continue
        return None

    def tree(self, repo_type: str, repo_id: str, sha: str) -> list[TreeEntry]:
        """Every file of commit ``sha`` (recursive), sorted by path."""
        out = self.git(self.path(repo_type, repo_id), "ls-tree", "-r", "-l", "-z", sha)
        entries = []
        for rec in out.split(b"\0"):
            if not rec:
                continue
            meta, path = rec.split(b"\t", 1)
            _mode, kind, oid, size = meta.split()
            if kind == b"blob":
                entries.append(TreeEntry(path.decode(), int(size), oid.decode()))
        return entries

    def read_blob(self, repo_type: str, repo_id: str, oid: str) -> bytes:
        return self.git(self.path(repo_type, repo_id), "cat-file", "blob", oid)

    def refs(self, repo_type: str, repo_id: str) -> tuple[list[Ref], list[Ref]]:
        """``(branches, tags)``, each target peeled to a commit."""
        out = self.git(
            self.path(repo_type, repo_id),
            "for-each-ref", "--format=%(refname) %(objectname) %(*objectname)", "refs/heads", "refs/tags",
        ).decode()
        branches, tags = [], []
        for line in out.splitlines():
            parts = line.split()
            refname, target = parts[0], parts[-1]  # `*objectname` (peeled) is present for annotated tags
            if refname.startswith("refs/heads/"):
                branches.append(Ref(refname[len("refs/heads/"):], refname, target))
            else:
                tags.append(Ref(refname[len("refs/tags/"):], refname, target))
        return branches, tags

    def commit_count(self, repo_type: str, repo_id: str, revision: str = "main") -> int:
        """Number of commits reachable from ``revision`` (tests use it to prove a push made no commit)."""
        out = self.git(self.path(repo_type, repo_id), "rev-list", "--count", revision)
        return int(out.decode().strip())

    def log(self, repo_type: str, repo_id: str, revision: str = "main") -> list[tuple[str, str]]:
        """``[(sha, summary), ...]`` newest first."""
        out = self.git(self.path(repo_type, repo_id), "log", "--format=%H %s", revision).decode()
        return [tuple(line.split(" ", 1)) for line in out.splitlines()]  # type: ignore[misc]

    # -- writing --------------------------------------------------------------------------------
    def _check_ref_name(self, kind: str, name: str) -> None:
        ok = subprocess.run(["git", "check-ref-format", f"refs/{kind}/{name}"], env=self._env, check=False)
        if ok.returncode != 0 or name.startswith("-") or _SHA_RE.match(name):
            raise GitStoreError(400, f"invalid {kind[:-1] if kind.endswith('s') else kind} name {name!r}")

    def commit(
        self,
        repo_type: str,
        repo_id: str,
        branch: str,
        *,
        adds: dict[str, bytes],
        deletes: list[str] | None = None,
        deleted_folders: list[str] | None = None,
        summary: str,
        description: str = "",
        parent: str | None = None,
        allow_root: bool = False,
    ) -> str:
        """Build and record one commit on ``branch``; returns its sha.

        The commit is created even when the tree does not change (the server never hides an empty commit,
        so a test that counts commits checks the client). ``parent`` is the optimistic-concurrency check.
        """
        repo = self.path(repo_type, repo_id)
        with self.lock:
            head = self.resolve(repo_type, repo_id, branch) if not allow_root else None
            if head is None and not allow_root:
                raise GitStoreError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
            if parent is not None and parent != head:
                raise GitStoreError(412, f"A commit has happened since. Please refresh and try again. ({parent})")
            files = {e.path: e.oid for e in self.tree(repo_type, repo_id, head)} if head else {}
            for path in deletes or []:
                if path not in files:
                    raise GitStoreError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                del files[path]
            for folder in deleted_folders or []:
                prefix = folder.rstrip("/") + "/"
                files = {p: o for p, o in files.items() if not p.startswith(prefix)}
            for path, data in adds.items():
                if not path or path.startswith("/") or ".." in path.split("/") or path.split("/")[0] == ".git":
                    raise GitStoreError(400, f"invalid path {path!r}")
                files[path] = self.git(repo, "hash-object", "-w", "--stdin", input=data).decode().strip()
            with tempfile.TemporaryDirectory(dir=self.root) as tmp:  # a throw-away index: no work tree needed
                env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
                listing = "".join(f"100644 {oid}\t{path}\n" for path, oid in sorted(files.items()))
                self.git(repo, "update-index", "--add", "--index-info", input=listing.encode(), env=env)
                tree = self.git(repo, "write-tree", env=env).decode().strip()
            message = summary if not description else f"{summary}\n\n{description}"
            args = ["commit-tree", tree, "-m", message] + (["-p", head] if head else [])
            sha = self.git(repo, *args).decode().strip()
            self.git(repo, "update-ref", f"refs/heads/{branch}", sha, *([head] if head else []))
            return sha

    def create_tag(self, repo_type: str, repo_id: str, tag: str, sha: str, message: str | None) -> None:
        """Tag commit ``sha`` (annotated if ``message``); 409 if the tag exists."""
        repo = self.path(repo_type, repo_id)
        self._check_ref_name("tags", tag)
        with self.lock:
            if self.resolve(repo_type, repo_id, tag) is not None and tag in {
                t.name for t in self.refs(repo_type, repo_id)[1]
            }:
                raise GitStoreError(409, f"Tag {tag} already exists")
            if message:
                self.git(repo, "tag", "-a", "-m", message, "--", tag, sha)
            else:
                self.git(repo, "update-ref", f"refs/tags/{tag}", sha, "0" * 40)

    def delete_tag(self, repo_type: str, repo_id: str, tag: str) -> None:
        with self.lock:
            if tag not in {t.name for t in self.refs(repo_type, repo_id)[1]}:
                raise GitStoreError(404, f"Tag {tag} not found", "RevisionNotFound")
            self.git(self.path(repo_type, repo_id), "update-ref", "-d", f"refs/tags/{tag}")

    def create_branch(self, repo_type: str, repo_id: str, branch: str, sha: str) -> None:
        """Create ``branch`` at ``sha``; 409 if it exists."""
        self._check_ref_name("heads", branch)
        with self.lock:
            if branch in {b.name for b in self.refs(repo_type, repo_id)[0]}:
                raise GitStoreError(409, f"Branch {branch} already exists")
            self.git(self.path(repo_type, repo_id), "update-ref", f"refs/heads/{branch}", sha, "0" * 40)
