"""What the INT2 backend does step after step in a vLLM engine, without vLLM or a GPU: the decode launch arguments
that Triton compiles for (constexprs, and the integers it specializes on: ``== 1``, ``% 16 == 0``) depend on the batch
size only, never on the growing lengths of a step (else every step would compile a kernel); the sequence vLLM's V2
model runner drives at engine start (graph-capture batches, a 64-request warm-up prefill and decode) followed by the
smoke run's chunked prefills and decodes goes through the metadata and the layer's forward and terminates; the
opt-in step log."""

from __future__ import annotations

import faulthandler
import inspect

import pytest
import torch

from oscar_cli.vllm import debug, layout
from oscar_cli.vllm.core import PagedInt2Layer, TorchTiers, TritonKernels, build_step, masked_attend
from oscar_kernels import ops
from oscar_kernels.launch_checks import triton_modules

# the smoke engine of scripts/gpu_vllm_bench.py: Qwen3-shaped, 8 query / 2 KV heads, head_dim 128, pages of 16,
# max_model_len 2048 (128 block-table columns), S0 = 64, W = 256, 64 sequences
HQ, HKV, D, P, COLS, S0, W, ROWS = 8, 2, 128, 16, 128, 64, 256, 64
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
SETTINGS = layout.Int2Settings(sink=S0, recent=W)


def _layer(kernels: object) -> PagedInt2Layer:
    eye = torch.eye(D)
    t = layout.LayerTensors(eye, eye, torch.zeros(HKV, D), torch.zeros(HKV, D), 0.0, 0.0)
    return PagedInt2Layer(t, SETTINGS, ROWS, HQ, HKV, D, P, torch.float16, "cpu",
                          kernels=kernels)  # type: ignore[arg-type]


def _pages(num_blocks: int) -> tuple[ops.QuantizedRows, ops.QuantizedRows]:
    from oscar_cli.vllm.spec import slot_bytes

    kv = torch.zeros(num_blocks, P, HKV, slot_bytes(D), dtype=torch.uint8)
    return layout.carve_pages(kv, D)


def _step(lens: list[tuple[int, int]], blocks: list[list[int]], rows: list[int], state: torch.Tensor, pad: int = 0):
    """vLLM metadata of one step: per request (tokens this step, sequence length after it), its blocks; ``pad``
    padding requests (zero blocks, no tokens) as in a FULL CUDA graph."""
    qsl = [0]
    for n, _ in lens:
        qsl.append(qsl[-1] + n)
    qsl += [qsl[-1]] * pad
    seq = [s for _, s in lens] + [0] * pad
    table = torch.zeros(len(seq), COLS, dtype=torch.int32)
    slots = []
    for i, ((n, s), bl) in enumerate(zip(lens, blocks, strict=True)):
        table[i, : len(bl)] = torch.tensor(bl, dtype=torch.int32)
        slots += [bl[p // P] * P + p % P for p in range(s - n, s)]
    num_tokens = qsl[-1] + pad
    slot_t = torch.tensor(slots + [-1] * pad, dtype=torch.int64)
    return build_step(torch.tensor(qsl, dtype=torch.int32), qsl, torch.tensor(seq, dtype=torch.int32), seq, table,
                      slot_t, num_tokens, rows + [ROWS] * pad, state, SETTINGS)


# positional arguments a kernel declares ``do_not_specialize`` (not part of the JIT key): the rotation's ``n_seq``
UNSPECIALIZED = {"rotate": {9}}


def _signature(plan: ops.DecodePlan) -> tuple:
    """What Triton's JIT cache keys a launch on (tensor dtypes; ints by ``== 1`` and ``% 16 == 0`` unless declared
    ``do_not_specialize``; constexprs)."""
    out = []
    for name, (_, args, kw) in (("rotate", plan._rot), ("stage1", plan._stage1), ("merge", plan._merge)):
        skip = UNSPECIALIZED.get(name, set())
        spec = tuple(("int",) if i in skip else
                     ("int", a == 1, a % 16 == 0) if isinstance(a, int) and not isinstance(a, bool) else
                     ("float",) if isinstance(a, float) else ("tensor", a.dtype) for i, a in enumerate(args))
        out.append((name, spec, tuple(sorted((k, str(v)) for k, v in kw.items()))))
    return tuple(out)


@pytest.mark.unit
def test_decode_launch_specialization_depends_on_the_batch_size_only(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple] = []
    monkeypatch.setattr(ops.DecodePlan, "run", lambda self: seen.append(_signature(self)) or self.out)
    # the tier gather in torch: its launch in the Triton interpreter costs minutes over these 154 steps (its
    # integer arguments are static shapes: the number of sink / ring slots, strides)
    monkeypatch.setattr(TritonKernels, "tier_gather", TorchTiers.tier_gather)
    layer = _layer(TritonKernels())  # the engine's configs (ops.default_config); nothing is launched
    kp, vp = _pages(COLS * 2 + 1)
    per_batch: dict[int, set[tuple]] = {}
    for b in CAPTURE_SIZES:
        state = torch.zeros(ROWS + 1, 2, dtype=torch.int32)
        start = [3 + 37 * i % 1900 for i in range(b)]  # below the sink, in the recent window, deep in INT2
        blocks = [[1 + COLS * (i % 2) + j for j in range(COLS)] for i in range(b)]
        seen.clear()
        for k in range(0, 40, 3):  # 14 steps of growing lengths (demotions of the recent window included)
            lens = [(1, min(s + k, 2047)) for s in start]
            st = _step(lens, blocks, list(range(b)), state)
            q = torch.randn(b, HQ, D).half()
            layer.decode(q, kp, vp, st, out=torch.empty(b, HQ, D, dtype=torch.float16))
        per_batch[b] = set(seen)
        assert len(per_batch[b]) == 1, f"batch {b}: the decode kernels would compile again within one batch size"
    # across the captured sizes the config (batch >= 16) and the split count (ops.default_num_splits: 16 up to
    # batch 32, then 13, 11, 10, 8) differ: 5 compiled variants of stage 1 and the merge, all made at graph capture
    rot = triton_modules()[1]._rotate_q_kernel  # the index UNSPECIALIZED names is its n_seq
    assert [list(inspect.signature(rot.fn).parameters)[i] for i in UNSPECIALIZED["rotate"]] == ["n_seq"]
    distinct = {next(iter(s)) for s in per_batch.values()}
    assert len(distinct) == 5, len(distinct)


class _Recorder(TorchTiers):
    """Kernel calls of the layer, recorded (shapes and lengths), nothing computed but the tier copies (torch): the
    metadata path under test."""

    def __init__(self) -> None:
        self.writes: list[int] = []
        self.v_exclusive: list[bool] = []  # per step: the V write's exclusive_words
        self.decodes: list[tuple[int, list[int], list[int], list[int]]] = []

    def quantize_write(self, x, cache, slots, mean, clip, layout_name, exclusive_words=False) -> None:
        self.writes.append(int(x.shape[0]))
        if layout_name == "token_quads":
            self.v_exclusive.append(exclusive_words)
        else:
            assert not exclusive_words

    def decode(self, q, kp, vp, table, hist_len, sink, sink_len, recent, recent_len, t, scale, out, rope=None,
               low=None):
        self.decodes.append((int(q.shape[0]), hist_len.tolist(), sink_len.tolist(), recent_len.tolist()))
        return out.zero_()


@pytest.mark.unit
def test_engine_start_warmup_then_the_smoke_run_terminate_with_the_right_lengths() -> None:
    rec = _Recorder()
    layer = _layer(rec)
    kp, vp = _pages(200)
    rows, state = layout.SequenceRows(ROWS), torch.zeros(ROWS + 1, 2, dtype=torch.int32)

    def forward(lens, blocks, pad: int = 0, capture: bool = False):
        firsts = [bl[0] for bl in blocks] + [0] * pad
        new = [s == n for n, s in lens] + [True] * pad
        r = [ROWS] * (len(lens) + pad) if capture else rows.assign(firsts, new)
        st = _step(lens, blocks, r[: len(lens)], state, pad)
        n = st.num_tokens
        q, k, v = torch.randn(n, HQ, D).half(), torch.randn(n, HKV, D).half(), torch.randn(n, HKV, D).half()
        out = torch.full((n, HQ, D), float("nan"), dtype=torch.float16)
        layer.forward(q, k, v, kp, vp, st, out, attend=masked_attend)
        assert torch.isfinite(out[: sum(x for x, _ in lens)]).all()
        return st

    for b in CAPTURE_SIZES:  # FULL graph capture: dummy one-token requests on the scratch row
        forward([(1, 1)] * b, [[0]] * b, capture=True)
    assert rec.v_exclusive == [True] * len(CAPTURE_SIZES)  # captured decode graphs: V written without atomics
    # the V2 runner's warm-up (vllm/v1/worker/gpu/warmup.py): 64 requests of 2 prompt tokens, then one decode each
    warm = [[1 + i] for i in range(64)]
    forward([(2, 2)] * 64, warm)
    forward([(1, 3)] * 64, warm)
    assert rec.v_exclusive[-2:] == [False, True]
    assert rec.decodes[-1][0] == 64 and rec.decodes[-1][1] == [0] * 64 and rec.decodes[-1][2] == [3] * 64
    # the smoke run: 700- and 100-token prompts in chunks of 256 tokens, then 8 decodes each (blocks reuse the
    # warm-up's ids, as vLLM's block pool hands out the lowest free ids first)
    a, b_ = list(range(1, 46)), list(range(46, 53))
    forward([(256, 256)], [a])
    forward([(256, 512)], [a])
    forward([(188, 700), (68, 68)], [a, b_])
    forward([(1, 701), (32, 100)], [a, b_])
    assert rec.v_exclusive[-4:] == [False] * 4  # prefill chunks, alone or with a decode: shared-word atomics
    for i in range(1, 8):
        st = forward([(1, 701 + i), (1, 100 + i)], [a, b_], pad=2)  # padded to a captured batch of 4
        assert rec.v_exclusive[-1] and st.slot_mapping[2:].tolist() == [-1, -1]
    assert st.rows_host[:2] != [ROWS, ROWS] and st.rows_host[0] != st.rows_host[1]
    bsz, hist, sink, recent = rec.decodes[-1]
    assert bsz == 2 and sink == [S0, S0]  # the padding requests carry no token (the captured graph covers them)
    # the reference placement: a final chunk keeps its own tokens past the sink in BF16 (A: 188, B: 32; earlier
    # chunks are INT2), each decode adds one (A: 8, B: 7); the rest past the sink is INT2 history
    assert recent == [196, 39] and hist == [708 - S0 - 196, 107 - S0 - 39]


@pytest.mark.unit
def test_step_log_and_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    off = debug.StepLog(enabled=False)
    off.build(0.0, 1, 1, 0, 1, 5, False)
    assert off.forward(lambda: 7, 1, 0, torch.device("cpu")) == 7 and off.lines == []
    on = debug.StepLog(enabled=True)
    on.build(0.0, 3, 2, 1, 40, 700, False)
    assert on.forward(lambda: 7, 2, 1, torch.device("cpu")) == 7
    assert len(on.lines) == 2 and "3 requests (2 decodes, 1 prefill chunks), 40 tokens, longest 700" in on.lines[0]
    assert "layer 0 forward: 2 decodes, 1 prefill chunks" in on.lines[1]
    assert debug.pdl_override() is None
    monkeypatch.setenv(debug.PDL_ENV, "0")
    assert debug.pdl_override() is False
    monkeypatch.setenv(debug.PDL_ENV, "off")
    with pytest.raises(ValueError, match="expected 0 or 1"):
        debug.pdl_override()
    monkeypatch.setenv(debug.STACKS_ENV, "soon")
    with pytest.raises(ValueError, match="expected seconds"):
        debug.arm_stack_dumps()
    monkeypatch.setenv(debug.STACKS_ENV, "0")
    assert debug.arm_stack_dumps() is None
    monkeypatch.setenv(debug.STACKS_ENV, "3600")
    try:
        assert debug.arm_stack_dumps() == 3600.0
    finally:
        faulthandler.cancel_dump_traceback_later()
        monkeypatch.setattr(debug, "_stacks_armed", False)
