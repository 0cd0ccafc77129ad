"""Issue #18 item 4 on one GPU, in priority order, resumable across device calls and sessions.

``bash scripts/gpu_session.sh qsweep S`` runs this after ``setup``; every step is one ``oscar eval-ruler`` (or
``oscar eval-kl``) invocation, and all eval-ruler steps write into one ``samples.jsonl`` so a rerun skips what is
there (the resume key is method, method source, RoPE tag, task, length and index; an oscar row's source is
``ARTIFACT_PATH (oscar, rotations HASH)``, so the artifact path and its rotations must stay the same from call to
call and session to session: the sweep's artifact travels with the samples file).

Steps, in order (``plan``):

a. bf16, oscar at 4K-32K (native RoPE)
b. kivi-2 at 4K-32K
c. naive-int2, quarot-int2 at 4K-32K (eval-ruler has no early stop for degenerate output: a batch decodes until
   every row emitted EOS or 128 tokens, and these methods rarely emit EOS)
d. bf16, oscar, kivi-2 at 64K, 128K under YaRN x4 (``--rope-factor 4``: one factor for both lengths, Qwen's
   documented 128K setting; rows carry ``rope = "yarn x4"``)
e. eval-kl at 4K, 8K, 16K and 32,704 (32K less the 64 scored tokens: the model has 32,768 positions), one
   invocation per length (eval-kl does not resume; a finished length is its ``kl-L.json``)

State (``--state``, on the device ``/tmp/q/qsweep``): ``samples.jsonl`` and ``kl-*.json``. ``--carried`` (the
folder the lead carries in, ``.stage/qsweep``) is merged into it first: records are unioned by resume key, KL
files copied when absent. After every step the state and the artifact are written to ``--res`` as one tar,
``qsweep.tar`` (which comes back in ``$OUT``; here: ``mkdir -p .stage/qsweep && tar -C .stage/qsweep -xf
FILES_AT/res/qsweep.tar``).

``python3 scripts/qsweep.py plan --state DIR`` prints the plan and what the samples file already holds (CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oscar_cli.eval.ruler import read_records, resume_key

TASKS = (
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
    "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery",
)  # fmt: skip
NATIVE = (4096, 8192, 16384, 32768)
LONG = (65536, 131072)
KL_LENGTHS = (4096, 8192, 16384, 32704)
YARN_FACTOR = 4
SAMPLES_FILE = "samples.jsonl"
TAR_NAME = "qsweep.tar"  # what a call returns: the state and the artifact in one file (copy_back)
OSCAR_CALL = [sys.executable, "-c", "from oscar_cli.main import main; main()"]


@dataclass(frozen=True)
class Step:
    """One eval-ruler or eval-kl invocation of the sweep."""

    name: str
    kind: str  # "ruler" | "kl"
    methods: tuple[str, ...]
    lengths: tuple[int, ...]
    samples: int = 0  # per task and length (ruler)
    rope_factor: int | None = None  # YaRN factor (ruler), None: native RoPE

    @property
    def rope(self) -> str:
        """The ``rope`` field eval-ruler writes for this step's rows (``rope_tag``)."""
        return f"yarn x{self.rope_factor:g}" if self.rope_factor else ""

    def total(self) -> int:
        """Samples (ruler) or lengths (kl) the step asks for."""
        if self.kind == "kl":
            return len(self.lengths)
        return len(TASKS) * self.samples * len(self.lengths) * len(self.methods)


def plan(samples: int = 25, long_samples: int | None = None, kl_windows: int = 8) -> list[Step]:
    """The sweep's steps in priority order (module docstring)."""
    n_long = samples if long_samples is None else long_samples
    steps = [
        Step("a-bf16-oscar", "ruler", ("bf16", "oscar"), NATIVE, samples),
        Step("b-kivi", "ruler", ("kivi-2",), NATIVE, samples),
        Step("c-int2", "ruler", ("naive-int2", "quarot-int2"), NATIVE, samples),
        Step("d-yarn", "ruler", ("bf16", "oscar", "kivi-2"), LONG, n_long, YARN_FACTOR),
    ]
    steps += [Step(f"e-kl-{L}", "kl", ("naive-int2", "quarot-int2", "kivi-2", "oscar"), (L,), kl_windows)
              for L in KL_LENGTHS]
    return steps


def merge_records(dst: Path, src: Path) -> tuple[int, int]:
    """Union ``src``'s records into ``dst`` by resume key (``dst``'s copy wins); returns (added, total).

    ``dst`` is rewritten without unreadable lines: a call killed mid-write leaves a truncated last line, and
    eval-ruler's next append would join its first record to it (and lose that record)."""
    have = read_records(dst)
    seen = {resume_key(r) for r in have}
    new = []
    for r in read_records(src):
        if resume_key(r) not in seen:
            seen.add(resume_key(r))
            new.append(r)
    if new or (src.is_file() and not dst.is_file()) or len(have) != _lines(dst):
        tmp = dst.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in have + new:
                f.write(json.dumps(r, sort_keys=True) + "\n")
        os.replace(tmp, dst)
    return len(new), len(have) + len(new)


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines()) if path.is_file() else 0


def sources_of(records: Iterable[dict[str, Any]]) -> dict[str, set[str]]:
    """The method sources present per method (an oscar source names the artifact path and its rotations)."""
    out: dict[str, set[str]] = {}
    for r in records:
        out.setdefault(r["method"], set()).add(r.get("method_source", ""))
    return out


def done_count(records: list[dict[str, Any]], step: Step, oscar_source: str | None) -> int:
    """How many of a ruler ``step``'s samples the records hold. ``oscar_source``: the ``method_source`` the oscar
    rows must carry (``artifact_source``); None counts no oscar row as done. Other methods' source is ``none``
    or ``hadamard``, whatever the artifact."""
    want = {
        (m, t, L, i)
        for m in step.methods
        for t in TASKS
        for L in step.lengths
        for i in range(step.samples)
    }
    got = set()
    for r in records:
        if r.get("rope", "") != step.rope:
            continue
        if r["method"] == "oscar" and r.get("method_source") != oscar_source:
            continue
        k = (r["method"], r["task"], int(r["length"]), int(r["index"]))
        if k in want:
            got.add(k)
    return len(got)


def artifact_source(artifact: str | Path) -> str | None:
    """The ``method_source`` eval-ruler gives oscar rows for ``artifact`` (as passed on the command line), from
    its manifest (``oscar_cli.quant.methods.oscar_from_artifact``); None without a manifest."""
    try:
        manifest = json.loads((Path(artifact) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    files = manifest.get("files", {})
    sha = files.get("rotations.safetensors") or next(iter(sorted(files.values())), "")
    return f"{artifact} ({manifest.get('method', 'oscar')}, rotations {sha[:12] or 'unhashed'})"


def kl_file(state: Path, length: int) -> Path:
    return state / f"kl-{length}.json"


def command(step: Step, gguf: str, artifact: str, out: Path, text: str, budget: float) -> list[str]:
    """The oscar command line of ``step`` (without the interpreter prefix)."""
    ctx = ",".join(f"{L // 1024}k" if L % 1024 == 0 else str(L) for L in step.lengths)
    if step.kind == "kl":
        return ["--json", "eval-kl", gguf, "--text", text, "--artifact", artifact, "--methods", ",".join(step.methods),
                "--ctx", ctx, "--tokens", "64", "--windows", str(step.samples), "--backend", "auto"]
    cmd = ["--json", "eval-ruler", gguf, "--artifact", artifact, "--ctx", ctx, "--methods", ",".join(step.methods),
           "--samples", str(step.samples), "--tasks", "all", "--backend", "auto", "--out", str(out),
           "--time-budget", str(max(1, int(budget)))]
    if step.rope_factor:
        cmd += ["--rope-factor", str(step.rope_factor)]
    return cmd


def describe(steps: list[Step], records: list[dict[str, Any]], oscar_source: str | None, state: Path) -> str:
    """The one-line plan: each step's size and how much of it is done."""
    parts = []
    for s in steps:
        if s.kind == "kl":
            parts.append(f"{s.name} {'done' if kl_file(state, s.lengths[0]).is_file() else 'todo'}")
        else:
            parts.append(f"{s.name} {done_count(records, s, oscar_source)}/{s.total()}")
    todo = sum(s.total() - done_count(records, s, oscar_source) for s in steps if s.kind == "ruler")
    return f"plan: {'; '.join(parts)} ({todo} RULER samples to go)"


@dataclass
class Sweep:
    """One call's run of the plan within ``budget`` seconds."""

    steps: list[Step]
    state: Path
    gguf: str
    artifact: str
    text: str
    budget: float
    res: Path | None = None
    min_start: float = 45.0  # no step starts with less than this left (a model load alone takes ~10 s)
    grace: float = 150.0  # a step is killed this long after the budget (its running batch is lost, not the file)
    runner: Callable[[list[str], float, Path], int] | None = None  # (argv, timeout, log path) -> return code
    clock: Callable[[], float] = time.monotonic
    log: Callable[[str], None] = field(default=lambda s: print(s, flush=True))

    def run(self) -> list[tuple[str, str, float]]:
        """Run the steps not done, in order, until the budget; returns ``(step, outcome, seconds)`` rows."""
        t0 = self.clock()
        samples = self.state / SAMPLES_FILE
        source = artifact_source(self.artifact)
        self.log(describe(self.steps, read_records(samples), source, self.state))
        rows = []
        for step in self.steps:
            done = (kl_file(self.state, step.lengths[0]).is_file() if step.kind == "kl"
                    else done_count(read_records(samples), step, source) >= step.total())
            if done:
                rows.append((step.name, "done before", 0.0))
                continue
            left = self.budget - (self.clock() - t0)
            if left < self.min_start:
                self.log(f"[{step.name}] not started: {left:.0f} s of the {self.budget:.0f} s budget left")
                rows.append((step.name, "not started", 0.0))
                continue
            t1 = self.clock()
            rc = self._run_step(step, left)
            dt = self.clock() - t1
            if step.kind == "ruler":
                n = done_count(read_records(samples), step, source)
                outcome = f"rc={rc}, {n}/{step.total()} samples"
            else:
                outcome = f"rc={rc}, {'done' if kl_file(self.state, step.lengths[0]).is_file() else 'no result'}"
            self.log(f"[{step.name}] {dt:.0f} s ({self.clock() - t0:.0f} s into the call): {outcome}")
            rows.append((step.name, outcome, dt))
            self.copy_back()
        self.log(describe(self.steps, read_records(samples), source, self.state))
        self.copy_back()  # also when nothing ran: what was carried in goes back out
        return rows

    def _run_step(self, step: Step, left: float) -> int:
        log = self.state / f"{step.name}.log"
        # every eval-ruler step's --out is the state folder: one samples.jsonl (summary.json and heatmap.png are
        # the last step's)
        argv = command(step, self.gguf, self.artifact, self.state, self.text, left)
        self.log(f"[{step.name}] oscar {' '.join(argv)}")
        runner = self.runner or _subprocess_runner
        rc = runner(argv, left + self.grace, log)
        result = log.with_suffix(".json")
        if step.kind == "kl" and rc == 0 and result.is_file():
            shutil.copyfile(result, kl_file(self.state, step.lengths[0]))
        return rc

    def copy_back(self) -> None:
        """The state (samples file, KL results, logs, step summaries, the last step's heatmap) and the artifact, as
        one tar ``res/qsweep.tar`` (written whole, then renamed): the device returns at most 8 files, none more
        than two folders under ``$OUT``, so a folder of files and an artifact directory would not come back."""
        if self.res is None:
            return
        self.res.mkdir(parents=True, exist_ok=True)
        tmp = self.res / (TAR_NAME + ".tmp")
        with tarfile.open(tmp, "w") as tar:
            for p in sorted(self.state.iterdir()):
                if p.is_file() and p.suffix in (".jsonl", ".json", ".log"):
                    tar.add(p, arcname=p.name)
            heat = self.state / "heatmap.png"
            if heat.is_file():
                tar.add(heat, arcname="last-step-heatmap.png")
            art = Path(self.artifact)
            if (art / "manifest.json").is_file():
                tar.add(art, arcname="art")
        os.replace(tmp, self.res / TAR_NAME)


def _subprocess_runner(argv: list[str], timeout: float, log: Path) -> int:
    """``oscar ARGV`` from ``/tmp`` (the installed copy, not ./oscar_cli), stdout to LOG.json, stderr to LOG."""
    with open(log.with_suffix(".json"), "w") as out, open(log, "w") as err:
        try:
            return subprocess.run(OSCAR_CALL + argv, stdout=out, stderr=err, cwd="/tmp", timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


def merge_carried(state: Path, carried: Path | None) -> str:
    """Bring a carried folder's samples and KL results into ``state``; one line saying what came in."""
    state.mkdir(parents=True, exist_ok=True)
    if carried is None or not carried.is_dir():
        merge_records(state / SAMPLES_FILE, state / "none")  # still drop a truncated last line (a killed call)
        return "carried: nothing"
    added, total = merge_records(state / SAMPLES_FILE, carried / SAMPLES_FILE)
    kl = []
    for p in sorted(carried.glob("kl-*.json")):
        if not (state / p.name).is_file():
            shutil.copyfile(p, state / p.name)
            kl.append(p.name)
    return f"carried: {added} new records ({total} in {state / SAMPLES_FILE}), KL files {kl or 'none new'}"


def select(steps: list[Step], names: str) -> list[Step]:
    """The steps ``names`` asks for (comma-separated names or prefixes), in that order; all when empty."""
    if not names.strip():
        return steps
    chosen: list[Step] = []
    for want in (n.strip() for n in names.split(",") if n.strip()):
        hits = [s for s in steps if s.name.startswith(want) and s not in chosen]
        if not hits:
            raise SystemExit(f"qsweep: no step {want!r} (steps: {', '.join(s.name for s in steps)})")
        chosen += hits
    return chosen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["run", "plan"])
    ap.add_argument("--state", required=True, type=Path)
    ap.add_argument("--carried", type=Path)
    ap.add_argument("--res", type=Path)
    ap.add_argument("--gguf", default="")
    ap.add_argument("--artifact", default="/tmp/q/art")
    ap.add_argument("--text", default="", help="held-out prose for eval-kl")
    ap.add_argument("--budget", type=float, default=420.0)
    ap.add_argument("--samples", type=int, default=25)
    ap.add_argument("--long-samples", type=int)
    ap.add_argument("--kl-windows", type=int, default=8)
    ap.add_argument("--steps", default="", help="comma-separated step names or prefixes (e-kl: all KL lengths), "
                    "run in this order; default: all, in priority order")
    a = ap.parse_args(argv)
    steps = select(plan(a.samples, a.long_samples, a.kl_windows), a.steps)
    print(merge_carried(a.state, a.carried), flush=True)
    if a.what == "plan":
        print(describe(steps, read_records(a.state / SAMPLES_FILE), artifact_source(a.artifact), a.state))
        return 0
    sweep = Sweep(steps, a.state, a.gguf, a.artifact, a.text, a.budget, a.res)
    sweep.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
