"""``eval-ruler`` builds each (task, length)'s prompts just before its first batch: the same samples and records as
building everything first, nothing built for what is already done, and the first batch runs before the second
(task, length) is built."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.evaldata import prose
from helpers.tiny import tiny_loaded

import oscar_cli.eval.ruler as ruler_mod
from oscar_cli.eval.prepare import build_methods
from oscar_cli.eval.ruler import (
    SAMPLES_FILE,
    LazySamples,
    RulerConfig,
    build_samples,
    read_records,
    run_method_samples,
    run_ruler,
)

pytestmark = pytest.mark.unit

TASKS = ["niah_single_1", "niah_multivalue", "niah_multikey_2"]  # noise, essay and needle haystacks
TIMING = ("batch_seconds",)
SAMPLE_FIELDS = ("answers", "depths", "prompt_tokens")


def _cfg(tmp_path: Path, **kw: Any) -> RulerConfig:
    base: dict[str, Any] = dict(
        lengths=[1024, 1536], tasks=TASKS, methods=["bf16", "naive-int2"], samples=2, out=str(tmp_path / "out"),
        haystack_dir=str(prose(tmp_path / "prose")), max_new_tokens=2, batch_size=3,
    )  # fmt: skip
    base.update(kw)
    return RulerConfig(**base)


def _strip(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def _eager_records(cfg: RulerConfig, loaded: Any, tmp_path: Path) -> list[dict[str, Any]]:
    """What the run did before prompts were built lazily: every sample first, then each (length, method) in turn,
    each task's samples sorted by prompt length."""
    samples = build_samples(cfg, loaded.tokenizer)
    methods, _ = build_methods(cfg.methods, loaded.model.config, None, None, resolved=loaded.identity.resolved)
    out: list[dict[str, Any]] = []
    for length in cfg.lengths:
        for m in cfg.methods:
            pending = [it for t in cfg.tasks for it in sorted(samples[(t, length)], key=lambda it: len(it[1]))]
            assert run_method_samples(loaded, methods[m], pending, cfg, out.extend)
    return out


@pytest.mark.parametrize(
    "batch_size", [1, 3, 16], ids=["one-per-batch", "batches-straddle-tasks", "one-batch-per-length"]
)
def test_lazy_run_writes_the_records_of_the_eager_build(tmp_path: Path, batch_size: int) -> None:
    loaded = tiny_loaded()
    cfg = _cfg(tmp_path, batch_size=batch_size)
    run_ruler(cfg, loaded)
    lazy = read_records(Path(cfg.out) / SAMPLES_FILE)
    assert len(lazy) == 2 * 2 * 3 * 2
    assert _strip(lazy) == _strip(_eager_records(cfg, loaded, tmp_path))


def test_lazy_samples_of_some_indices_are_those_of_the_full_build(tmp_path: Path) -> None:
    loaded = tiny_loaded()
    cfg = _cfg(tmp_path, samples=4)
    full = build_samples(cfg, loaded.tokenizer)
    some = LazySamples(cfg, loaded.tokenizer, {(t, 1024): [1, 3] for t in TASKS})
    for t in TASKS:
        got = some.get(t, 1024)
        assert list(got) == [1, 3]
        assert [got[1], got[3]] == [full[(t, 1024)][1], full[(t, 1024)][3]]  # sample and prompt ids alike
        assert [it[0].index for it in full[(t, 1024)]] == [0, 1, 2, 3]


class Spy:
    """Records, in order, each (task, length) built and each batch written."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, ...]] = []
        make, append = ruler_mod.make_samples, ruler_mod._append

        def make_samples(task: str, length: int, indices: list[int], *a: Any, **k: Any) -> Any:
            self.events.append(("build", task, str(length), ",".join(map(str, indices))))
            return make(task, length, indices, *a, **k)

        def _append(path: Path, records: list[dict[str, Any]]) -> None:
            self.events.append(("batch", *(f"{r['method']}:{r['task']}" for r in records)))
            append(path, records)

        monkeypatch.setattr(ruler_mod, "make_samples", make_samples)
        monkeypatch.setattr(ruler_mod, "_append", _append)
        fit = ruler_mod.fit_haystack

        def fit_haystack(*a: Any, **k: Any) -> Any:
            self.events.append(("fit",))
            return fit(*a, **k)

        monkeypatch.setattr(ruler_mod, "fit_haystack", fit_haystack)

    def builds(self) -> list[tuple[str, ...]]:
        return [e for e in self.events if e[0] == "build"]


@pytest.mark.parametrize(
    ("batch_size", "expected"),
    [
        (2, [("build", "niah_single_1", "1024", "0,1"), ("batch", "bf16:niah_single_1", "bf16:niah_single_1"),
             ("build", "niah_multikey_2", "1024", "0,1"), ("batch", "bf16:niah_multikey_2", "bf16:niah_multikey_2"),
             ("batch", "naive-int2:niah_single_1", "naive-int2:niah_single_1"),
             ("batch", "naive-int2:niah_multikey_2", "naive-int2:niah_multikey_2")]),
        (3, [("build", "niah_single_1", "1024", "0,1"), ("build", "niah_multikey_2", "1024", "0,1"),
             ("batch", "bf16:niah_single_1", "bf16:niah_single_1", "bf16:niah_multikey_2"),
             ("batch", "bf16:niah_multikey_2"),
             ("batch", "naive-int2:niah_single_1", "naive-int2:niah_single_1", "naive-int2:niah_multikey_2"),
             ("batch", "naive-int2:niah_multikey_2")]),
    ],
    ids=["first-batch-before-second-build", "a-straddling-batch-builds-the-next-task"],
)  # fmt: skip
def test_each_task_is_built_when_its_first_batch_needs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch_size: int, expected: list[tuple[str, ...]]
) -> None:
    spy = Spy(monkeypatch)
    cfg = _cfg(tmp_path, lengths=[1024], tasks=["niah_single_1", "niah_multikey_2"], batch_size=batch_size)
    run_ruler(cfg, tiny_loaded())
    assert [e for e in spy.events if e[0] != "fit"] == expected  # batches name each record's method and task


@pytest.mark.parametrize(
    ("drop", "builds"),
    [
        (lambda r: False, []),
        (lambda r: r["task"] == "niah_multivalue" and r["length"] == 1536 and r["index"] == 1,
         [("build", "niah_multivalue", "1536", "1")]),
        (lambda r: r["method"] == "naive-int2" and r["length"] == 1024 and r["task"] != "niah_single_1",
         [("build", "niah_multivalue", "1024", "0,1"), ("build", "niah_multikey_2", "1024", "0,1")]),
    ],
    ids=["nothing-pending-builds-nothing", "one-sample-missing", "one-method-missing-two-tasks"],
)  # fmt: skip
def test_resume_builds_only_what_is_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, drop: Any, builds: list[tuple[str, ...]]
) -> None:
    cfg = _cfg(tmp_path)
    first = run_ruler(cfg, tiny_loaded())
    path = Path(cfg.out) / SAMPLES_FILE
    records = read_records(path)
    kept = [r for r in records if not drop(r)]
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept), encoding="utf-8")
    spy = Spy(monkeypatch)
    again = run_ruler(_cfg(tmp_path), tiny_loaded())
    assert spy.builds() == builds
    assert sum(e == ("fit",) for e in spy.events) == len(builds)
    assert again.evaluated == len(records) - len(kept) and again.complete and first.complete
    redone = {(r["method"], r["task"], r["length"], r["index"]): r for r in read_records(path)[len(kept) :]}
    for r in records:  # the rebuilt samples are the ones first built
        if drop(r):
            new = redone[(r["method"], r["task"], r["length"], r["index"])]
            assert [new[k] for k in SAMPLE_FIELDS] == [r[k] for k in SAMPLE_FIELDS]


def test_on_a_terminal_the_bar_counts_builds_and_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import oscar_cli._output as output

    bars: list[Any] = []

    class Bar(output.Progress):  # type: ignore[misc]
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            bars.append(self)

    monkeypatch.setattr(output, "progress_enabled", lambda: True)
    monkeypatch.setattr(output, "Progress", Bar)
    run_ruler(_cfg(tmp_path, lengths=[1024], tasks=["niah_single_1", "niah_multikey_2"]), tiny_loaded())
    (bar,) = bars
    got = {t.description.split(" ")[0] + (" prompts" if "prompts" in t.description else ""): (t.completed, t.total)
           for t in bar.tasks}  # fmt: skip
    assert got == {"building prompts": (2, 2), "eval-ruler": (8, 8)}
    assert "building prompts:" not in capsys.readouterr().err  # the bar, not log lines


def _batch_sizes(records: list[dict[str, Any]]) -> list[int]:
    return [r["batch_size"] for r in records]


@pytest.mark.parametrize(
    ("samples", "sizes", "expected"),
    [
        (2, ([1, 3, 3, 3, 4, 4, 4, 4], [4] * 8), [("build", "niah_single_1", "1024", "0,1"), ("batch", "bf16:niah_single_1"),
             ("build", "niah_multikey_2", "1024", "0,1"),
             ("batch", "bf16:niah_single_1", "bf16:niah_multikey_2", "bf16:niah_multikey_2"),
             ("batch", "naive-int2:niah_single_1", "naive-int2:niah_single_1", "naive-int2:niah_multikey_2",
              "naive-int2:niah_multikey_2")]),
        (1, ([1, 2, 2, 3, 3, 3], [3] * 6), [("build", "niah_single_1", "1024", "0"), ("batch", "bf16:niah_single_1"),
             ("build", "niah_multivalue", "1024", "0"), ("build", "niah_multikey_2", "1024", "0"),
             ("batch", "bf16:niah_multivalue", "bf16:niah_multikey_2"),
             ("batch", "naive-int2:niah_single_1", "naive-int2:niah_multivalue", "naive-int2:niah_multikey_2")]),
    ],
    ids=["rest-of-the-first-batch-next", "one-sample-per-task"],
)  # fmt: skip
def test_default_batch_size_runs_the_first_sample_alone(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    samples: int,
    sizes: tuple[list[int], list[int]],
    expected: list[tuple[str, ...]],
) -> None:
    """No --batch-size (4 on CPU): the run's first sample is a batch of its own, built alone (only its (task,
    length)), the rest of its batch runs next and every later batch is as without the cut; the records are those
    of --batch-size 4 but for the split batch's size and time."""
    tasks = ["niah_single_1", "niah_multikey_2"] if samples == 2 else TASKS
    spy = Spy(monkeypatch)
    cfg = _cfg(tmp_path, lengths=[1024], tasks=tasks, samples=samples, batch_size=None)
    assert run_ruler(cfg, tiny_loaded()).complete
    assert [e for e in spy.events if e[0] != "fit"] == expected
    got = read_records(Path(cfg.out) / SAMPLES_FILE)
    assert _batch_sizes(got) == sizes[0]
    ref_cfg = _cfg(tmp_path, lengths=[1024], tasks=tasks, samples=samples, batch_size=4, out=str(tmp_path / "ref"))
    run_ruler(ref_cfg, tiny_loaded())
    ref = read_records(Path(ref_cfg.out) / SAMPLES_FILE)
    assert _batch_sizes(ref) == sizes[1]
    cut = sizes[1][0]  # the records of the lone sample and of the rest of its batch
    assert [{k: v for k, v in r.items() if k != "batch_size"} for r in _strip(got)[:cut]] == [
        {k: v for k, v in r.items() if k != "batch_size"} for r in _strip(ref)[:cut]
    ]
    assert _strip(got)[cut:] == _strip(ref)[cut:]  # the batches after the split one are the uncut run's


def test_a_resumed_run_runs_its_first_sample_alone_and_a_given_batch_size_is_kept(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, lengths=[1024], tasks=["niah_single_1", "niah_multikey_2"], batch_size=None)
    path = Path(cfg.out) / SAMPLES_FILE
    run_ruler(cfg, tiny_loaded())
    records = read_records(path)
    kept = [r for r in records if r["method"] != "naive-int2"]
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept), encoding="utf-8")
    again = run_ruler(_cfg(tmp_path, lengths=[1024], tasks=["niah_single_1", "niah_multikey_2"], batch_size=None),
                      tiny_loaded())  # fmt: skip
    assert again.evaluated == 4 and again.complete
    assert _batch_sizes(read_records(path)[len(kept) :]) == [1, 3, 3, 3]  # this process's first batch: one sample
    given = _cfg(tmp_path, lengths=[1024], tasks=["niah_single_1", "niah_multikey_2"], batch_size=4,
                 out=str(tmp_path / "given"))  # fmt: skip
    run_ruler(given, tiny_loaded())
    assert _batch_sizes(read_records(Path(given.out) / SAMPLES_FILE)) == [4] * 8


def test_a_run_of_one_sample(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, lengths=[1024], tasks=["niah_single_1"], methods=["bf16"], samples=1, batch_size=None)
    res = run_ruler(cfg, tiny_loaded())
    assert res.complete and res.evaluated == 1
    assert _batch_sizes(read_records(Path(cfg.out) / SAMPLES_FILE)) == [1]
