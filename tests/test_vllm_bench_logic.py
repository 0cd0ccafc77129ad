"""scripts/gpu_vllm_bench.py's arithmetic, without vLLM or a GPU: the prefill schedule and the decode stage's batch
and output length (plan_decode), --max-num-seqs auto and the CUDA-graph batch, the step-log summary (decode phase,
full batch; a window no step falls in is absent, not zero) and the step driver against a scripted engine."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from helpers.scripts import load_script

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def bench() -> Any:
    return load_script("gpu_vllm_bench")


def test_prefill_schedule_by_hand(bench: Any) -> None:
    # 3 x 10 tokens, budget 8: r0 8 | r0 2 (first), r1 6 | r0 decodes, r1 4 (first), r2 3 | 2 decodes, r2 6 | r2 1
    assert bench.prefill_first_tokens(3, 10, 8) == [2, 3, 5]
    # the chunk divides the prompt: r0 in one step; then its decode leaves 7 of 8 for r1's 8 tokens
    assert bench.prefill_first_tokens(2, 8, 8) == [1, 3]
    assert bench.prefill_first_tokens(6, 32, 16) == [2, 5, 7, 9, 12, 15]
    assert bench.prefill_first_tokens(4, 1, 4) == [1, 1, 1, 1]  # four one-token prompts share one step
    with pytest.raises(ValueError, match="whole 4-token budget"):
        bench.prefill_first_tokens(5, 1, 4)
    with pytest.raises(ValueError, match=">= 1"):
        bench.prefill_first_tokens(0, 10, 8)


@pytest.mark.parametrize(("kv_blocks", "n", "out", "per_request"), [
    (16, 5, 15, 3),  # exact fit: 5 x 3 blocks + the null block
    (15, 4, 12, 3),  # one block short of it
    (24, 5, 15, 3),  # 6 requests need 6 x 4 = 24 usable blocks: one short
    (25, 6, 18, 4),  # exact fit for 6
])
def test_plan_decode_fills_the_pool_and_keeps_a_full_batch_window(bench: Any, kv_blocks: int, n: int, out: int,
                                                                  per_request: int) -> None:
    # ctx 32, budget 16 (does not divide into the decodes' share), pages of 16, a 4-step window; first tokens of 6
    # requests in steps 2, 5, 7, 9, 12, 15 (test above): out = f_last - f_0 + 1 + 4
    p = bench.plan_decode(kv_blocks, 16, 32, 16, 4)
    assert (p.n, p.out_tokens, p.blocks_per_request, p.usable_blocks) == (n, out, per_request, kv_blocks - 1)
    assert p.first_token_steps == (2, [2, 5, 7, 9, 12, 15][n - 1])
    # request 0 is still running in the window's last step, and gets its last token there
    assert p.first_token_steps[0] + p.out_tokens - 1 == p.first_token_steps[1] + p.window


def test_plan_decode_refuses_a_pool_smaller_than_one_request(bench: Any) -> None:
    with pytest.raises(ValueError, match=r"one 200-token request with 9 output tokens needs 14 blocks .* has 9"):
        bench.plan_decode(10, 16, 200, 64, 8)
    with pytest.raises(ValueError, match="window"):
        bench.plan_decode(1000, 16, 200, 64, 0)
    p = bench.plan_decode(10**6, 16, 1, 4, 2)  # a huge pool: the batch stops where decodes would eat the budget
    assert p.n == 4 and p.out_tokens == 3


@pytest.mark.parametrize("cap, n", [(1, 1), (3, 3), (5, 5), (6, 6), (7, 6), (0, 6)])
def test_plan_decode_caps_the_requests_below_what_fits(bench: Any, cap: int, n: int) -> None:
    # the exact fit for 6 above; a cap plans the same way for fewer requests (their own output length)
    p = bench.plan_decode(25, 16, 32, 16, 4, cap)
    q = bench.plan_decode(10**4, 16, 32, 16, 4, n)
    assert p.n == n and (p.out_tokens, p.first_token_steps, p.blocks_per_request) == \
        (q.out_tokens, q.first_token_steps, q.blocks_per_request)
    assert p.first_token_steps[0] + p.out_tokens - 1 == p.first_token_steps[1] + p.window


def test_plan_decode_at_the_measured_qwen3_8b_capacities(bench: Any) -> None:
    oscar = bench.plan_decode(bench.KV_TOKENS_MEASURED["oscar"] // 16, 16, 32768, 8192, 128)
    bf16 = bench.plan_decode(bench.KV_TOKENS_MEASURED["bf16"] // 16, 16, 32768, 8192, 128)
    for p in (oscar, bf16):  # the pool is full: one more request of this length would not fit
        assert p.n * p.blocks_per_request <= p.usable_blocks < (p.n + 1) * p.blocks_per_request
    # the decodes take part of every step's budget: more prefill steps than n x 4 chunks
    assert oscar.first_token_steps[1] > oscar.n * 4 and bf16.first_token_steps[1] > bf16.n * 4
    assert (oscar.n, bf16.n) == (153, 22)


def test_capture_sizes_and_the_decode_graph(bench: Any) -> None:
    assert [bench.capture_size_at_least(n) for n in (1, 2, 3, 4, 5, 8, 147, 248, 249, 256, 257, 512)] == \
        [1, 2, 4, 4, 8, 8, 152, 248, 256, 256, 272, 512]
    with pytest.raises(ValueError, match="1..512"):
        bench.capture_size_at_least(513)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, 305, 16)]  # vLLM's defaults at max_num_seqs 152
    assert bench.decode_graph_batch(147, 152, sizes) == 152
    assert bench.decode_graph_batch(147, 147, sizes) is None  # 152 > max_num_seqs: no full decode graph
    assert bench.decode_graph_batch(144, 147, sizes) == 144
    assert bench.decode_graph_batch(5, 64, []) is None  # eager: nothing captured


def test_max_num_seqs_auto(bench: Any) -> None:
    kv = bench.KV_TOKENS_MEASURED["oscar"]
    r = bench.resolve_max_num_seqs
    assert r("64", ["throughput"], [32768], None, 16, 256, 8192, 128) == 64
    with pytest.raises(ValueError, match="integer or auto"):
        r("many", ["decode"], [32768], kv, 16, 256, 8192, 128)
    with pytest.raises(ValueError, match="needs --kv-tokens-hint"):
        r("auto", ["decode"], [32768], None, 16, 256, 8192, 128)
    with pytest.raises(ValueError, match="neither"):
        r("auto", ["capacity", "tpot"], [32768], kv, 16, 256, 8192, 128)
    # throughput: 5,150,656 // (32768 + 256) = 155; decode: 153; 128K decode: 39 -> capture sizes 160, 160, 40
    assert r("auto", ["throughput"], [32768], kv, 16, 256, 8192, 128) == 160
    assert r("auto", ["capacity", "tpot", "decode"], [32768], kv, 16, 256, 8192, 128) == 160
    assert r("auto", ["decode"], [131072], kv, 16, 256, 8192, 128) == 40
    assert r("auto", ["decode"], [32768, 131072], kv, 16, 256, 8192, 128) == 160  # the largest over --ctx
    # max_model_len's room: the output length of a batch of max_num_seqs bounds the plan's at any pool
    bound = bench.decode_out_bound(160, 32768, 8192, 128)
    assert bound >= bench.plan_decode(kv // 16, 16, 32768, 8192, 128).out_tokens


def test_kv_bytes_per_token(bench: Any) -> None:
    assert bench.kv_bytes_per_token("oscar", 36, 8, 128) == 36 * 8 * 72  # docs/VLLM.md: 72 bytes per token and head
    assert bench.kv_bytes_per_token("bf16", 36, 8, 128) == 36 * 8 * 128 * 2 * 2
    assert bench.kv_bytes_per_token("tq3", 36, 8, 128) is None


def _log(bench: Any, rows: list[tuple[float, int, int, int, int]]) -> Any:
    log = bench.StepLog()
    for r in rows:
        log.append(*r)
    return log


def test_summary_with_prefill_and_decode_overlapping(bench: Any) -> None:
    # 3 requests: (ms, tokens, requests, pending after, finished after)
    log = _log(bench, [(100, 1, 1, 2, 0),  # r0's first token
                       (50, 2, 2, 1, 0),  # r0 decodes while r1 gets its first: prefill and decode in one step
                       (60, 3, 3, 0, 0),  # r2's first token: the prefill phase ends here
                       (20, 3, 3, 0, 0),  # full batch, pure decode
                       (22, 3, 3, 0, 1),  # full batch (r0 finishes in it)
                       (15, 2, 2, 0, 3)])  # decode, no longer the full batch
    s = bench.summarize_steps(3, log, bytes_per_request_step=1000)
    assert s["steps"] == 6 and s["output_tokens"] == 14 and s["wall_s"] == pytest.approx(0.267)
    assert s["output_tok_per_s"] == pytest.approx(14 / 0.267)
    assert s["prefill_steps"] == 3 and s["prefill_s"] == pytest.approx(0.21)
    d, f = s["decode_phase"], s["full_batch"]
    assert (d["steps"], d["first_step"], d["tokens"]) == (3, 4, 8)
    assert d["tok_per_s"] == pytest.approx(8 / 0.057) and d["mean_batch"] == pytest.approx(8 / 3)
    assert d["mean_step_ms"] == pytest.approx(19.0)
    assert (f["steps"], f["first_step"], f["tokens"], f["mean_batch"]) == (2, 4, 6, 3.0)
    assert f["tok_per_s"] == pytest.approx(6 / 0.042) and f["mean_step_ms"] == pytest.approx(21.0)
    assert f["kv_bytes_per_step"] == 3000 and f["kv_tb_per_s"] == pytest.approx(3000 / 0.021 / 1e12)
    assert "kv_bytes_per_step" not in bench.summarize_steps(3, log)["full_batch"]


def test_summary_reports_missing_windows_as_absent(bench: Any) -> None:
    # r0 finishes before r1's first token: a decode-phase step exists (the last), a full batch never does
    log = _log(bench, [(30, 1, 1, 1, 0), (10, 1, 1, 1, 1), (30, 1, 1, 0, 1), (10, 1, 1, 0, 2)])
    s = bench.summarize_steps(2, log)
    assert s["full_batch"] is None and s["decode_phase"]["steps"] == 1 and s["decode_phase"]["first_step"] == 4
    assert s["prefill_steps"] == 3
    # the last prefill ends in the very last step: no decode-phase step either
    s = bench.summarize_steps(2, _log(bench, [(30, 1, 1, 1, 0), (30, 2, 2, 0, 2)]))
    assert s["decode_phase"] is None and s["full_batch"] is None and s["prefill_steps"] == 2
    s = bench.summarize_steps(2, bench.StepLog())  # nothing ran
    assert s["prefill_steps"] is None and s["prefill_s"] is None and s["decode_phase"] is None
    assert s["output_tok_per_s"] is None


def test_step_log_round_trip(bench: Any) -> None:
    log = _log(bench, [(100.123, 1, 1, 2, 0), (5.5, 2, 2, 0, 1)])
    enc = bench.encode_steps(log)
    assert enc == {"ms": "100.12 5.50", "tokens": "1 2", "requests": "1 2", "pending": "2 0", "finished": "0 1"}
    back = bench.decode_steps(enc)
    assert back.ms == [100.12, 5.5] and back.tokens == [1, 2] and back.finished == [0, 1]


class _ScriptedEngine:
    """LLMEngine's add_request / has_unfinished_requests / step, replaying per-step DELTA outputs."""

    def __init__(self, script: list[list[tuple[str, list[int], bool]]]) -> None:
        self.script, self.added = list(script), []

    def add_request(self, request_id: str, prompt: Any, params: Any) -> str:
        self.added.append((request_id, prompt, params))
        return request_id + "-internal"

    def has_unfinished_requests(self) -> bool:
        return bool(self.script)

    def step(self) -> list[Any]:
        return [SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(token_ids=t)], finished=fin)
                for rid, t, fin in self.script.pop(0)]


def test_run_steps_counts_first_tokens_and_finishes(bench: Any) -> None:
    eng = _ScriptedEngine([
        [("0", [7], False)],
        [("0", [8], False), ("1", [9], False)],
        [("0", [], False), ("1", [10], False), ("2", [11], False)],  # an output without a new token
        [("0", [12], True), ("1", [13, 14], True), ("2", [15], True)],
    ])
    run = bench.run_steps(eng, iter(["a", "b", "c"]), "params")
    assert [a[0] for a in eng.added] == ["0", "1", "2"] and eng.added[0][1:] == ("a", "params")
    assert run.tokens == [[7, 8, 12], [9, 10, 13, 14], [11, 15]]
    assert run.log.tokens == [1, 2, 2, 4] and run.log.requests == [1, 2, 2, 3]
    assert run.log.pending == [2, 1, 0, 0] and run.log.finished == [0, 0, 0, 3]
    assert sum(run.log.ms) / 1e3 == pytest.approx(run.wall_s) and 0 <= run.add_s <= run.wall_s
    s = bench.summarize_steps(3, run.log)
    assert s["prefill_steps"] == 3 and s["full_batch"]["steps"] == 1 and s["full_batch"]["tokens"] == 4


def _simulated_generate(bench: Any, chunk: int) -> Any:
    """generate_steps as the front end sees a run that follows prefill_first_tokens: one token per running request
    and step; a step without any token is not reported (its time goes into the next reported step)."""

    def generate(llm: Any, ps: list[list[int]], tokens: int, on_step: Any = None) -> Any:
        n, ctx = len(ps), len(ps[0])
        first = bench.prefill_first_tokens(n, ctx, chunk)
        toks: list[list[int]] = [[] for _ in range(n)]
        log, step, carry = bench.StepLog(), 0, 0.0
        while any(len(t) < tokens for t in toks):
            step += 1
            ms = carry + (50.0 if step <= first[-1] else 10.0)
            got = [i for i in range(n) if first[i] <= step and len(toks[i]) < tokens]
            if not got:
                carry = ms
                continue
            carry = 0.0
            for i in got:
                toks[i].append(step)
            log.append(ms, len(got), len(got), sum(f > step for f in first), sum(len(t) == tokens for t in toks))
            if on_step is not None:
                on_step(len(log.ms), log.pending[-1])
        return bench.StepRun(sum(log.ms) / 1e3, 0.0, log, toks)

    return generate


def test_decode_stage_plans_runs_guards_and_records(bench: Any, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import json
    from argparse import Namespace

    monkeypatch.setattr(bench, "prompts", lambda n, length, vocab, seed: [[5] * length for _ in range(n)])
    monkeypatch.setattr(bench, "generate_steps", _simulated_generate(bench, 16))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=[1, 2, 4, 8, 16]))))
    out = tmp_path / "v.json"
    args = Namespace(chunk=16, decode_window=4, max_num_seqs=8, decode_max_prefill_s=0.0, decode_max_requests=0,
                     vocab=100, out=out, decode_profile_steps=0)
    facts = {"kv_blocks": 25, "block_size": 16, "kv_tokens": 400, "max_model_len": 64}
    bench.decode(args, llm, facts, [32], "m/b", 10, {})
    rec = json.loads(out.read_text())["m/b/decode/32"]
    # plan_decode(25, 16, 32, 16, 4): 6 requests x 18 tokens, first tokens in steps 2..15 (the test above)
    assert (rec["batch"], rec["out_tokens"], rec["planned_first_token_steps"]) == (6, 18, [2, 15])
    assert rec["decode_graph_batch"] == 8 and rec["output_tokens"] == 6 * 18 and rec["estimated_prefill_s"] is None
    assert rec["prefill_steps"] == 14  # engine steps 2..15: step 1 (a chunk, no token) is folded into step 2
    fb, dp = rec["full_batch"], rec["decode_phase"]
    assert (fb["steps"], fb["mean_batch"], fb["mean_step_ms"]) == (4, 6.0, 10.0)
    assert fb["tok_per_s"] == pytest.approx(600.0) and fb["kv_bytes_per_step"] == 6 * 32 * 10
    assert dp["steps"] > fb["steps"] and dp["mean_batch"] < 6  # then the batch drains
    assert bench.decode_steps(rec["step_log"]).tokens[:4] == [1, 1, 1, 2]  # r1's first token in step 5
    assert rec["prefill_s"] == pytest.approx(15 * 0.05) and rec["requests_that_fit"] == 6

    # a cap on the requests: 4 of the 6 that fit, planned for 4 (first tokens in steps 2..9), both counts recorded
    args.decode_max_requests = 4
    bench.decode(args, llm, facts, [32], "m/b", 10, {})
    rec = json.loads(out.read_text())["m/b/decode/32"]
    assert (rec["batch"], rec["requests_that_fit"], rec["planned_first_token_steps"]) == (4, 6, [2, 9])
    args.decode_max_requests = 0

    # the time guard: 6 requests x a 1.0 s TTFT > 5 s -> skipped, nothing recorded
    out.unlink()
    args.decode_max_prefill_s = 5.0
    bench.decode(args, llm, facts, [32], "m/b", 10, {32: 1.0})
    assert not out.exists()
    args.decode_max_prefill_s = 6.5
    bench.decode(args, llm, facts, [32], "m/b", None, {32: 1.0})
    rec = json.loads(out.read_text())["m/b/decode/32"]
    assert rec["estimated_prefill_s"] == 6.0 and "kv_bytes_per_step" not in rec["full_batch"]

    args.max_num_seqs = 5
    with pytest.raises(SystemExit, match=r"holds 6 requests .* --max-num-seqs is 5: pass --max-num-seqs 8"):
        bench.decode(args, llm, facts, [32], "m/b", 10, {})
    args.max_num_seqs = 8
    with pytest.raises(SystemExit, match=r"32 \+ 18 output tokens exceed max_model_len 40"):
        bench.decode(args, llm, facts | {"max_model_len": 40}, [32], "m/b", 10, {})
    with pytest.raises(SystemExit, match="one 32-token request"):
        bench.decode(args, llm, facts | {"kv_blocks": 3}, [32], "m/b", 10, {})


def test_profile_window_traces_full_batch_steps(bench: Any) -> None:
    """The trace starts ``skip`` steps after the first step with no request waiting for its first token and covers
    ``steps`` steps; a run that ends inside the trace stops it in finish()."""
    calls: list[tuple[str, int]] = []
    done = [0]
    w = bench.ProfileWindow(3, lambda: calls.append(("start", done[0])), lambda: calls.append(("stop", done[0])),
                            skip=2)
    waiting = [4, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]  # after steps 1..12; prefill over after step 4
    for i, p in enumerate(waiting, 1):
        done[0] = i
        w(i, p)
    assert calls == [("start", 6), ("stop", 9)]  # steps 7, 8, 9 (1-based) traced
    assert w.traced == frozenset({6, 7, 8})  # 0-based, as summarize_steps' exclude
    short = bench.ProfileWindow(5, lambda: calls.append(("start2", 0)), lambda: calls.append(("stop2", 0)), skip=0)
    for i, p in enumerate([1, 0, 0], 1):
        short(i, p)
    assert calls[-1] == ("start2", 0) and short.stopped_after is None
    short.finish()
    assert calls[-1] == ("stop2", 0) and short.traced == frozenset(range(2, 7))
    idle = bench.ProfileWindow(2, lambda: calls.append(("x", 0)), lambda: calls.append(("y", 0)))
    for i in range(1, 5):
        idle(i, 1)  # never out of prefill: nothing traced
    idle.finish()
    assert idle.traced == frozenset() and calls[-1] == ("stop2", 0)


def test_summary_leaves_excluded_steps_out_of_the_windows(bench: Any) -> None:
    log = _log(bench, [(100, 2, 2, 0, 0), (20, 2, 2, 0, 0), (90, 2, 2, 0, 0), (20, 2, 2, 0, 0)])
    s = bench.summarize_steps(2, log, exclude=frozenset({2}))
    assert s["wall_s"] == pytest.approx(0.23) and s["full_batch"]["steps"] == 2  # steps 2 and 4
    assert s["full_batch"]["mean_step_ms"] == pytest.approx(20.0)


def test_decode_stage_profiles_and_excludes(bench: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import json
    from argparse import Namespace

    monkeypatch.setattr(bench, "prompts", lambda n, length, vocab, seed: [[5] * length for _ in range(n)])
    monkeypatch.setattr(bench, "generate_steps", _simulated_generate(bench, 16))
    calls: list[str] = []
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=[1, 2, 4, 8, 16]))),
        start_profile=lambda: calls.append("start"), stop_profile=lambda: calls.append("stop"))
    out = tmp_path / "v.json"
    args = Namespace(chunk=16, decode_window=12, max_num_seqs=8, decode_max_prefill_s=0.0, decode_max_requests=0,
                     vocab=100, out=out, decode_profile_steps=3, profile_dir=tmp_path / "prof")
    facts = {"kv_blocks": 40, "block_size": 16, "kv_tokens": 640, "max_model_len": 64}
    bench.decode(args, llm, facts, [32], "m/b", 10, {})
    rec = json.loads(out.read_text())["m/b/decode/32"]
    assert calls == ["start", "stop"]
    a, b = rec["profiled_steps"]
    assert b - a == 2 and a == rec["prefill_steps"] + 1 + 8  # 8 steps after the last prefill step
    assert rec["full_batch"]["steps"] == 12 - 3 and rec["full_batch"]["mean_step_ms"] == pytest.approx(10.0)


@pytest.mark.parametrize(("int4", "meta", "key_mean"), [(0, 16, "constant"), (2, 8, "rope")],
                         ids=["plain", "recipe-format"])
def test_dummy_hadamard_artifact_formats(bench: Any, tiny_model_dir: Any, tmp_path: Any, int4: int, meta: int,
                                         key_mean: str) -> None:
    """The random-weight model's data-free artifact in the recipes' formats (INT4 key layers, one-byte metadata, keys
    centred by position) loads as an artifact of that format."""
    from oscar_cli.artifact.io import load_artifact, rope_key_mean

    art = load_artifact(bench.write_hadamard_artifact(tiny_model_dir, tmp_path / "art", int4, meta, key_mean))
    m = art.manifest
    assert rope_key_mean(m) is (key_mean == "rope")
    assert all((layer.k_mean_pre is not None) is (key_mean == "rope") for layer in art.layers)
    assert len(m.quant.get("int4_keys", [])) == int4
    assert m.quant["meta_dtype"] == ("uint8" if meta == 8 else "bfloat16")


@pytest.mark.parametrize("rows, ttft_s, tpot_ms, later", [
    # one chunk: the first step gives the first token, then one token a step
    ([(120.0, 1), (7.0, 1), (7.5, 1), (6.5, 1)], 0.120, 7.0, 3),
    # three prefill chunks without a token, then the first; a later step without a token still costs its time
    ([(400.0, 0), (400.0, 0), (300.0, 1), (8.0, 1), (2.0, 0), (8.0, 1)], 1.100, 9.0, 2),
])
def test_tpot_of_one_run(bench: Any, rows: list[tuple[float, int]], ttft_s: float, tpot_ms: float,
                         later: int) -> None:
    log = bench.StepLog()
    for ms, tok in rows:
        log.append(ms, tok, tok, 0, 0)
    t1, ms, n = bench.tpot_of(log)
    assert t1 == pytest.approx(ttft_s) and ms == pytest.approx(tpot_ms) and n == later


@pytest.mark.parametrize("rows, match", [([(5.0, 0), (5.0, 0)], "no token"), ([(5.0, 0), (5.0, 1)], "after its first")])
def test_tpot_of_refuses_runs_without_a_tpot(bench: Any, rows: list[tuple[float, int]], match: str) -> None:
    log = bench.StepLog()
    for ms, tok in rows:
        log.append(ms, tok, tok, 0, 0)
    with pytest.raises(ValueError, match=match):
        bench.tpot_of(log)


def test_tpot_stage_times_one_run_and_keeps_the_cold_first_request_apart(bench: Any, monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Any) -> None:
    """The 2026-12-08 failure: a length's first request compiles (2 s); TPOT must not depend on it."""
    import json
    from argparse import Namespace

    calls: list[tuple[int, int]] = []

    def generate(llm: Any, ps: list[Any], tokens: int) -> tuple[float, list[list[int]]]:
        calls.append((len(ps[0]), tokens))
        cold = len(ps[0]) == 4096 and sum(1 for c in calls if c[0] == 4096) == 1
        return (2.0 if cold else 0.1), [[1] * tokens]

    def generate_steps(llm: Any, ps: list[Any], tokens: int) -> Any:
        log = bench.StepLog()
        log.append(100.0, 1, 1, 0, 0)
        for _ in range(tokens - 1):
            log.append(6.0, 1, 1, 0, 0)
        return bench.StepRun(sum(log.ms) / 1e3, 0.0, log, [[1] * tokens])

    monkeypatch.setattr(bench, "prompts", lambda n, length, vocab, seed: [[5] * length for _ in range(n)])
    monkeypatch.setattr(bench, "generate", generate)
    monkeypatch.setattr(bench, "generate_steps", generate_steps)
    out = tmp_path / "t.json"
    args = Namespace(chunk=8192, vocab=100, out_tokens=256, out=out)
    ttft = bench.tpot(args, None, {"backend": "x"}, [4096, 32768], "m/x")
    assert calls[:2] == [(64, 8), (2 * 8192 + 64, 2)]  # the warm-ups, then per length one token, cold
    rec = json.loads(out.read_text())["m/x/tpot/4096"]
    assert rec["tpot_ms"] == pytest.approx(6.0) and rec["tpot_tokens"] == 256 and rec["output_tokens"] == 257
    assert rec["ttft_first_s"] == 2.0 and rec["ttft_s"] == pytest.approx(0.1) == ttft[4096]
