"""The lm-evaluation-harness model type ``oscar`` offline: a tiny model, local tasks from jsonl files."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers.tiny import tiny_loaded

import oscar_cli.model as models_mod
from oscar_cli.errors import EvalError

lm_eval = pytest.importorskip("lm_eval")
adapter = pytest.importorskip("oscar_cli.eval.lm_eval_adapter")

pytestmark = pytest.mark.unit


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> Any:
    loaded = tiny_loaded(max_positions=4096)
    monkeypatch.setattr(models_mod, "load_model", lambda *a, **k: loaded)
    return loaded


def _req(*args: Any) -> Any:
    return SimpleNamespace(args=args)


def test_the_model_type_is_registered_beside_lm_evals_own() -> None:
    from lm_eval.api.registry import get_model

    assert get_model("oscar") is adapter.OscarLM
    assert get_model("hf").__name__ == "HFLM"  # registering oscar did not hide lm-eval's own types


@pytest.mark.parametrize("chunk_size", [16, 4096])
def test_bf16_loglikelihood_matches_a_plain_forward(tiny: Any, chunk_size: int) -> None:
    lm = adapter.OscarLM(pretrained="tiny", method="bf16", batch_size=2, chunk_size=chunk_size)
    reqs = [_req("The river was quiet and", " the garden waited."), _req("One", " two three four five six."),
            _req("", "An empty context.")]  # fmt: skip
    got = lm.loglikelihood(reqs)
    tok = tiny.tokenizer
    for req, (lp, greedy) in zip(reqs, got, strict=True):
        ctx = [lm.prefix_token_id] if not req.args[0] else tok(req.args[0])["input_ids"]
        cont = tok(req.args[1])["input_ids"]
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            ref = torch.log_softmax(tiny.model(ids).logits[0, len(ctx) - 1 : -1].float(), -1)
        want = float(ref.gather(-1, torch.tensor(cont)[:, None]).sum())
        assert lp == pytest.approx(want, rel=2e-3, abs=2e-2)
        assert greedy == bool((ref.argmax(-1) == torch.tensor(cont)).all())


def test_rolling_loglikelihood_sums_the_windows(tiny: Any) -> None:
    lm = adapter.OscarLM(pretrained="tiny", method="kivi-2")
    text = "a b c d e f g " * 40
    (total,) = lm.loglikelihood_rolling([_req(text)])
    (whole, _), = lm.loglikelihood([_req("", text)])  # fmt: skip  # one window: the same tokens scored once
    assert total == pytest.approx(whole, rel=1e-5)


def test_generation_stops_at_until_and_refuses_sampling(tiny: Any) -> None:
    lm = adapter.OscarLM(pretrained="tiny", method="naive-int2")
    (text,) = lm.generate_until([_req("Count: 1 2 3", {"until": ["\n"], "max_gen_toks": 12, "do_sample": False})])
    assert isinstance(text, str) and "\n" not in text and len(text) <= 12
    with pytest.raises(EvalError, match="decodes greedily"):
        lm.generate_until([_req("x", {"do_sample": True, "temperature": 0.7})])


def test_oscar_method_without_artifact_is_one_line(tiny: Any) -> None:
    with pytest.raises(EvalError, match="method oscar needs --artifact"):
        adapter.OscarLM(pretrained="tiny", method="oscar")


def _tasks(root: Path) -> Path:
    items = [{"question": f"Is {i} even?", "choices": ["yes", "no"], "answer": i % 2, "target": str(i)}
             for i in range(4)]  # fmt: skip
    data = root / "items.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in items))
    common = f"""
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {data}
        test_split: test
        doc_to_text: "{{{{question}}}}"
    """
    (root / "choice.yaml").write_text(textwrap.dedent(f"""
        task: oscar_local_choice
        {textwrap.dedent(common).strip().replace(chr(10), chr(10) + "        ")}
        output_type: multiple_choice
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: answer
        metric_list:
          - metric: acc
    """))
    (root / "gen.yaml").write_text(textwrap.dedent(f"""
        task: oscar_local_gen
        {textwrap.dedent(common).strip().replace(chr(10), chr(10) + "        ")}
        output_type: generate_until
        doc_to_target: "{{{{target}}}}"
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: 4
          do_sample: false
        metric_list:
          - metric: exact_match
    """))
    return root


def test_simple_evaluate_runs_local_tasks_on_the_int2_cache(tiny: Any, tmp_path: Path) -> None:
    from lm_eval.tasks import TaskManager

    tasks = _tasks(tmp_path)
    res = lm_eval.simple_evaluate(
        model="oscar",
        model_args="pretrained=tiny,method=kivi-2,chunk_size=64",
        tasks=["oscar_local_choice", "oscar_local_gen"],
        task_manager=TaskManager(include_path=str(tasks)),
        batch_size=2,
    )
    acc = res["results"]["oscar_local_choice"]["acc,none"]
    em = res["results"]["oscar_local_gen"]["exact_match,none"]
    assert 0.0 <= acc <= 1.0 and 0.0 <= em <= 1.0
    assert res["configs"]["oscar_local_choice"]["output_type"] == "multiple_choice"
    assert res["n-samples"]["oscar_local_choice"]["effective"] == 4 and res["n-samples"]["oscar_local_gen"]["effective"] == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without CUDA")
def test_lm_evals_default_cuda_device_runs_on_the_cpu_with_a_warning(
    tiny: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="oscar_cli.eval.lm_eval_adapter"):
        lm = adapter.OscarLM(pretrained="tiny", method="bf16", device="cuda:0")
    assert lm.loaded.device.type == "cpu"
    assert any("CUDA is not available here: running on cpu" in r.getMessage() for r in caplog.records)
