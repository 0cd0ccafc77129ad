"""scripts/qsweep.py: the #18 item-4 sweep's plan, resume across calls (carried samples file) and budget."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
from helpers.scripts import load_script

pytestmark = pytest.mark.unit

SRC = "/tmp/q/art (oscar, rotations 925c288abf3b)"


def _q() -> Any:
    return load_script("qsweep")


def _rec(method: str, task: str, length: int, index: int, rope: str = "", source: str = "none",
         score: float = 100.0) -> dict[str, Any]:
    return {"method": method, "method_source": source, "rope": rope, "task": task, "length": length,
            "index": index, "score": score}


def _write(path: Path, recs: list[dict[str, Any]], tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + tail)


def _manifest(folder: Path, sha: str = "925c288abf3b" + "0" * 52) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps({"method": "oscar", "files": {"rotations.safetensors": sha,
                                                                                   "recipe.yaml": "f" * 64}}))
    return folder


def test_plan_order_and_sizes() -> None:
    q = _q()
    steps = q.plan(25)
    assert [s.name for s in steps[:4]] == ["a-bf16-oscar", "b-kivi", "c-int2", "d-yarn"]
    assert steps[0].methods == ("bf16", "oscar") and steps[0].lengths == (4096, 8192, 16384, 32768)
    assert [s.total() for s in steps[:4]] == [8 * 25 * 4 * 2, 8 * 25 * 4, 8 * 25 * 4 * 2, 8 * 25 * 2 * 3]
    assert steps[3].rope == "yarn x4" and steps[3].lengths == (65536, 131072)
    assert [s.lengths[0] for s in steps[4:]] == [4096, 8192, 16384, 32704]  # 32,704 + 64 scored = 32,768
    assert all(s.kind == "kl" for s in steps[4:])


@pytest.mark.parametrize(("names", "want"), [
    ("", ["a-bf16-oscar", "b-kivi", "c-int2", "d-yarn", "e-kl-4096", "e-kl-8192", "e-kl-16384", "e-kl-32704"]),
    ("b-kivi,e-kl,d", ["b-kivi", "e-kl-4096", "e-kl-8192", "e-kl-16384", "e-kl-32704", "d-yarn"]),
    ("e-kl-32704, e-kl", ["e-kl-32704", "e-kl-4096", "e-kl-8192", "e-kl-16384"]),
])
def test_select_keeps_the_order_asked(names: str, want: list[str]) -> None:
    q = _q()
    assert [s.name for s in q.select(q.plan(25), names)] == want


def test_select_names_the_steps_when_one_is_unknown() -> None:
    q = _q()
    with pytest.raises(SystemExit, match="no step 'f-x'.*a-bf16-oscar"):
        q.select(q.plan(25), "b-kivi,f-x")


def test_tasks_and_rope_match_eval_ruler() -> None:
    from oscar_cli.eval.niah import TASK_NAMES
    from oscar_cli.eval.ruler import RulerConfig, rope_tag

    q = _q()
    assert q.TASKS == TASK_NAMES
    cfg = RulerConfig(lengths=[65536], tasks=[], methods=[], samples=1, rope_scaling="yarn", rope_factor=4.0)
    assert q.plan()[3].rope == rope_tag(cfg)


def test_artifact_source_matches_the_method(tmp_path: Path) -> None:
    from oscar_cli.quant.methods import _short_hash

    q = _q()
    art = _manifest(tmp_path / "art")
    files = json.loads((art / "manifest.json").read_text())["files"]
    assert q.artifact_source(str(art)) == f"{art} (oscar, rotations {_short_hash(files)})"
    assert q.artifact_source(str(tmp_path / "none")) is None


def test_done_count_keys_rope_source_and_range() -> None:
    q = _q()
    a, d = q.plan(2)[0], q.plan(2)[3]
    recs = [_rec("bf16", "niah_single_1", 4096, 0), _rec("bf16", "niah_single_1", 4096, 1),
            _rec("bf16", "niah_single_1", 4096, 2),  # beyond 2 samples: not this step's
            _rec("bf16", "niah_single_1", 4096, 0),  # a duplicate counts once
            _rec("oscar", "niah_single_1", 4096, 0, source=SRC),
            _rec("oscar", "niah_single_1", 4096, 1, source="/tmp/q/art (oscar, rotations 000000000000)"),
            _rec("bf16", "niah_single_1", 65536, 0),  # native RoPE at 64K: not step d's
            _rec("bf16", "niah_single_1", 65536, 1, rope="yarn x4")]
    assert q.done_count(recs, a, SRC) == 3
    assert q.done_count(recs, a, None) == 2
    assert q.done_count(recs, d, SRC) == 1


def test_merge_unions_by_key_and_drops_truncated(tmp_path: Path) -> None:
    q = _q()
    dst, src = tmp_path / "state" / "samples.jsonl", tmp_path / "carried" / "samples.jsonl"
    _write(dst, [_rec("bf16", "niah_single_1", 4096, 0, score=100.0)], tail='{"method": "bf1')
    _write(src, [_rec("bf16", "niah_single_1", 4096, 0, score=0.0), _rec("bf16", "niah_single_1", 4096, 1)])
    assert q.merge_records(dst, src) == (1, 2)
    recs = q.read_records(dst)
    assert [(r["index"], r["score"]) for r in recs] == [(0, 100.0), (1, 100.0)]  # the state's copy wins
    assert dst.read_text().count("\n") == 2  # the truncated line is gone, so appends start on a fresh line
    assert q.merge_records(dst, src) == (0, 2)
    fresh = tmp_path / "fresh" / "samples.jsonl"
    fresh.parent.mkdir()
    assert q.merge_records(fresh, src) == (2, 2) and len(q.read_records(fresh)) == 2


def test_merge_carried_brings_kl_once(tmp_path: Path) -> None:
    q = _q()
    carried, state = tmp_path / "carried", tmp_path / "state"
    _write(carried / "samples.jsonl", [_rec("kivi-2", "niah_single_2", 8192, 0)])
    (carried / "kl-4096.json").write_text('{"metrics": {}}')
    (carried / "b-kivi.log").write_text("log")
    line = q.merge_carried(state, carried)
    assert "1 new records" in line and "kl-4096.json" in line
    assert (state / "kl-4096.json").is_file() and not (state / "b-kivi.log").exists()
    assert "nothing" in q.merge_carried(state, None)


class FakeOscar:
    """Stands in for the oscar subprocess: appends a ruler step's missing rows to --out/samples.jsonl as eval-ruler
    would (skipping what is there, no new row once --time-budget is spent), advancing a fake clock by a load time
    and a cost per sample."""

    def __init__(self, source: str, per_sample: float, clock: list[float]) -> None:
        self.source, self.per_sample, self.clock = source, per_sample, clock
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], timeout: float, log: Path) -> int:
        self.calls.append(argv)
        q = _q()
        self.clock[0] += 10.0  # model load
        if argv[1] == "eval-kl":
            log.with_suffix(".json").write_text('{"metrics": {"oscar": {}}}')
            return 0
        opt = {a: b for a, b in zip(argv, argv[1:] + [""], strict=True) if a.startswith("--")}
        methods, n = opt["--methods"].split(","), int(opt["--samples"])
        lengths = [int(x[:-1]) * 1024 for x in opt["--ctx"].split(",")]
        rope = f"yarn x{opt['--rope-factor']}" if "--rope-factor" in opt else ""
        budget = float(opt["--time-budget"])
        path = Path(opt["--out"]) / "samples.jsonl"
        have = {q.resume_key(r) for r in q.read_records(path)}
        spent = 0.0
        with open(path, "a") as f:
            for L in lengths:
                for m in methods:
                    for t in q.TASKS:
                        for i in range(n):
                            r = _rec(m, t, L, i, rope, self.source if m == "oscar" else "none")
                            if q.resume_key(r) in have:
                                continue
                            if spent > budget:
                                return 0
                            f.write(json.dumps(r) + "\n")
                            spent += self.per_sample
                            self.clock[0] += self.per_sample
        return 0


def test_sweep_resumes_across_calls_and_stops_at_budget(tmp_path: Path) -> None:
    q = _q()
    art = _manifest(tmp_path / "art")
    source = q.artifact_source(str(art))
    clock = [0.0]
    lines: list[str] = []
    carried = tmp_path / "carried"  # what the lead carries in: last call's res/qsweep.tar, unpacked
    outcomes = []
    for call in range(6):
        state, res = tmp_path / f"state{call}", tmp_path / f"res{call}"  # a fresh machine every call
        q.merge_carried(state, carried if call else None)
        fake = FakeOscar(source, per_sample=1.0, clock=clock)
        sweep = q.Sweep(q.plan(2), state, "G.gguf", str(art), "held.txt", budget=200.0, res=res,
                        runner=fake, clock=lambda: clock[0], log=lines.append)
        outcomes.append(sweep.run())
        assert [p.name for p in res.iterdir()] == ["qsweep.tar"]  # one file: a device call returns at most 8
        carried = tmp_path / f"carried{call}"
        with tarfile.open(res / "qsweep.tar") as tar:
            tar.extractall(carried, filter="data")
        assert (carried / "art" / "manifest.json").is_file()  # the artifact travels with the samples
    steps = q.plan(2)
    recs = q.read_records(carried / "samples.jsonl")
    assert all(q.done_count(recs, s, source) == s.total() for s in steps if s.kind == "ruler")
    assert len({q.resume_key(r) for r in recs}) == len(recs) == sum(s.total() for s in steps if s.kind == "ruler")
    assert all((carried / f"kl-{L}.json").is_file() for L in (4096, 8192, 16384, 32704))
    # the first call stopped starting steps once less than min_start was left, and said so
    first = dict((name, outcome) for name, outcome, _ in outcomes[0])
    assert first["a-bf16-oscar"].startswith("rc=0, ") and "not started" in first["e-kl-32704"]
    assert any("not started" in line for line in lines)
    assert lines[0].startswith("plan: a-bf16-oscar 0/128; b-kivi 0/64")
    # the second call resumed: step a was done, b's last sample ran
    second = dict((name, outcome) for name, outcome, _ in outcomes[1])
    assert second["a-bf16-oscar"] == "done before" and second["b-kivi"] == "rc=0, 64/64 samples"
    # the last call found everything done and ran nothing
    assert all(outcome == "done before" for _, outcome, _ in outcomes[-1])


def test_command_lines(tmp_path: Path) -> None:
    q = _q()
    d, kl = q.plan(25)[3], q.plan(25, kl_windows=8)[-1]
    cmd = q.command(d, "G", "/tmp/q/art", tmp_path, "held.txt", 321.7)
    assert cmd[:3] == ["--json", "eval-ruler", "G"]
    assert " ".join(cmd).endswith(f"--out {tmp_path} --time-budget 321 --rope-factor 4")
    assert "--ctx 64k,128k" in " ".join(cmd) and "--methods bf16,oscar,kivi-2" in " ".join(cmd)
    k = " ".join(q.command(kl, "G", "/tmp/q/art", tmp_path, "held.txt", 100))
    assert k.startswith("--json eval-kl G --text held.txt") and "--ctx 32704 --tokens 64 --windows 8" in k


def test_counts_and_resume_on_real_eval_ruler_records(tmp_path: Path) -> None:
    """The rows eval-ruler writes are the ones qsweep counts, and eval-ruler resumes from a merged state file."""
    from helpers.evaldata import prose
    from helpers.tiny import tiny_loaded

    from oscar_cli.eval.ruler import RulerConfig, run_ruler

    q = _q()
    tasks = ["niah_single_1", "niah_multikey_2"]

    def cfg(out: Path) -> RulerConfig:
        return RulerConfig(lengths=[1024], tasks=tasks, methods=["bf16"], samples=2, out=str(out),
                           haystack_dir=str(prose(tmp_path / "prose")), max_new_tokens=2, batch_size=3)

    run_ruler(cfg(tmp_path / "call1"), tiny_loaded())  # the first call's eval-ruler
    step = q.Step("x", "ruler", ("bf16",), (1024,), 2)
    state = tmp_path / "state"
    q.merge_carried(state, tmp_path / "call1")  # the next call: what came back, carried in
    assert q.done_count(q.read_records(state / "samples.jsonl"), step, None) == 2 * len(tasks)
    lines = (state / "samples.jsonl").read_text().splitlines()
    (state / "samples.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])  # one lost, one truncated
    q.merge_carried(state, None)  # a call with nothing carried still drops the truncated line
    again = run_ruler(cfg(state), tiny_loaded())
    assert again.evaluated == 1 and again.complete
    recs = q.read_records(state / "samples.jsonl")
    assert len(recs) == 2 * len(tasks) and q.done_count(recs, step, None) == 2 * len(tasks)
