"""Memory the cache and ``attach`` take beyond the KV formula, measured with the profiler's allocation events.

:class:`oscar_cli.bench.allocations.AllocationTrace` replays every CPU allocation and free of a block; the tests
bound the transient peak of one ``Int2Layer.update`` (a prefill chunk over stored history, a reference-path decode
step) and check that ``attach`` keeps nothing but the host copy of the weights it folds into.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers.calib import random_transform
from helpers.tiny import tiny_causal_lm, tiny_loaded

from oscar_cli.bench.allocations import AllocationTrace, phase_hooks
from oscar_cli.quant import attach, oscar_method
from oscar_cli.quant.generation import cache_kwarg
from oscar_cli.quant.int2_layer import Int2Layer

pytestmark = pytest.mark.unit
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def test_allocation_trace_replays_live_bytes_of_known_tensors() -> None:
    x = torch.ones(100, 100)
    with AllocationTrace() as trace:
        with trace.phase("a"):
            a = torch.empty(250_000)  # 1 MB
            b = x @ x  # 40 kB
            del a
        with trace.phase("b"):
            c = torch.empty(750_000)  # 3 MB
            del c
        del b
    (pa,), (pb,) = trace.phases("a"), trace.phases("b")
    assert (pa.start, pa.peak, pa.end) == (0, 1_040_000, 40_000)
    assert (pb.transient, pb.retained) == (3_000_000, 0)
    assert trace.peak() == 3_040_000 and trace.phases("missing") == []


def test_phase_hooks_mark_every_forward_of_a_module() -> None:
    lin = torch.nn.Linear(64, 64)
    with AllocationTrace() as trace, torch.no_grad():
        with phase_hooks(lin, "lin"):
            a = lin(torch.ones(8, 64))
            b = lin(torch.ones(16, 64))
        c = lin(torch.ones(2, 64))  # the hooks are gone: not an occurrence
    assert [p.retained for p in trace.phases("lin")] == [a.nbytes, b.nbytes] and c.nbytes == 512


@pytest.mark.parametrize("prev,new,bound", [(12_000, 3_000, 2.0), (12_000, 1, 2.0), (0, 6_000, 3.0)],
                         ids=["chunk-over-history", "reference-decode", "first-chunk"])
def test_update_transient_peak_is_bounded_by_the_kv_it_returns(prev: int, new: int, bound: float) -> None:
    """Peak of one update <= ``bound`` x the dense K and V it returns (Qwen2.5-Coder-1.5B's KV geometry, 2 KV heads
    x 128, bf16, rotated keys and values). Measured 1.65x, 1.39x, 2.56x; 4.43x, 4.89x, 6.96x before pages were
    read and rows written in pieces. A first chunk is bound by its float32 rotation, which runs whole."""
    b, h, d = 1, 2, 128
    t = random_transform(0, h, clip=0.9, d=d)
    layer = Int2Layer(oscar_method([t], sink=64, recent=256), t, rotate_values=True)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(b, h, prev + new, d, generator=g).bfloat16() for _ in range(2))
    if prev:
        layer.final_chunk = new == 1  # a decode step follows a final chunk, another chunk a non-final one
        layer.update(k[..., :prev, :], v[..., :prev, :])
    layer.final_chunk = True
    with AllocationTrace() as trace:
        with trace.phase("update"):
            out_k, out_v = layer.update(k[..., prev:, :], v[..., prev:, :])
    dense = out_k.nbytes + out_v.nbytes
    assert out_k.shape[-2] == prev + new
    (p,) = trace.phases("update")
    assert p.transient <= bound * dense, (p.transient, dense, p.transient / dense)


def test_attach_keeps_only_the_host_copy_of_the_folded_weights() -> None:
    """No per-query-head R_K, no second copy of the transforms: the runtime, the cache and the method share one."""
    model = tiny_causal_lm("qwen2", seed=3, heads=8, kv_heads=2, head_dim=16, layers=2)
    meth = oscar_method([random_transform(i, 2, d=16) for i in range(2)], sink=8, recent=16)
    with AllocationTrace() as trace:
        with trace.phase("attach"):
            session = attach(model, meth, backend="reference")
    try:
        attns = [layer.self_attn for layer in model.model.layers]
        backup = sum(a.v_proj.weight.nbytes + a.v_proj.bias.nbytes + a.o_proj.weight.nbytes for a in attns)
        assert trace.phases("attach")[0].retained == backup
        cache = session.new_cache()
        ids = torch.arange(1, 41)[None, :]
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
        for i, a in enumerate(attns):
            r_k = session.method.layers[i].k_rotation
            assert a._oscar_runtime.q_rotation.data_ptr() == r_k.data_ptr()
            assert cache.layers[i].k_rot.data_ptr() == r_k.data_ptr()
    finally:
        session.close()


@pytest.fixture(scope="module")
def cache_check():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import gpu_cache_check

        yield gpu_cache_check
    finally:
        sys.path.remove(str(SCRIPTS))


def test_gpu_cache_check_splits_prefill_and_decode_peaks(cache_check) -> None:
    model = tiny_causal_lm(seed=1)
    calls = {"peak": 0, "reset": 0}

    def peak() -> int:
        calls["peak"] += 1
        return 1000 * calls["peak"]

    def reset() -> None:
        calls["reset"] += 1

    ids = torch.arange(1, 21)[None, :]
    with cache_check.PhasePeaks(model, peak=peak, reset=reset) as peaks:
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                       do_sample=False, pad_token_id=0)
    assert (peaks.forwards, peaks.prefill, peaks.decode, calls["reset"]) == (5, 1000, 2000, 2)


def test_gpu_cache_check_byte_counts(cache_check) -> None:
    from oscar_cli.method_registry import build_method
    from oscar_cli.model.geometry import ModelGeometry

    model = tiny_causal_lm("qwen2", seed=2)
    geo = ModelGeometry.of(model.config)
    bf16 = build_method("bf16", model.config)
    assert cache_check.kv_formula_bytes(bf16, geo, 1000) == 2 * 2 * 2 * 1000 * 16 * 2  # K+V, layers, heads, D, 2 B
    x = torch.zeros(10, 10)
    assert cache_check.tensor_bytes([x, x[1:], torch.zeros(3)]) == 400 + 12  # views counted once
    meth = oscar_method([random_transform(0, 2, d=16)], sink=8, recent=16)
    assert cache_check.method_tensor_bytes(meth, torch.device("cpu")) == 2 * 2 * 16 * 16 * 4 + 2 * 2 * 16 * 4


class CountingMeter:
    """A stand-in for gpu_cache_check.CudaMeter on CPU: peaks climb by 1000 per read, nothing is allocated."""

    def __init__(self) -> None:
        self.reads = 0

    def allocated(self) -> int:
        return 0

    def peak(self) -> int:
        self.reads += 1
        return 1000 * self.reads

    def reset(self) -> None:
        pass

    def settle(self) -> None:
        pass


def test_gpu_cache_check_memory_stage_runs_and_reports_both_caches(cache_check, tmp_path) -> None:
    from helpers.fakehub.artifacts import make_artifact

    from oscar_cli.model.geometry import ModelGeometry
    from oscar_cli.quant import build_method

    loaded = tiny_loaded(seed=2)
    loaded.model.to(torch.bfloat16)  # the formula counts the BF16 tiers at 2 bytes
    art = str(make_artifact(tmp_path))
    res = cache_check.memory(loaded, art, long=600, new=8, meter=CountingMeter())
    b, o = res["bf16"], res["oscar"]
    assert (res["prompt_tokens"], b["path"], o["path"]) == (592, "dense", "reference")
    assert (b["prefill_peak_bytes"], b["decode_peak_bytes"], o["prefill_peak_bytes"]) == (1000, 2000, 3000)
    bf16 = build_method("bf16", loaded.model.config)
    assert b["kv_formula_bytes"]["at_600"] == 2 * 2 * 2 * 600 * 16 * 2 == cache_check.kv_formula_bytes(
        bf16, ModelGeometry.of(loaded.model.config), 600)
    assert b["kv_allocated_bytes"] == 2 * 2 * 2 * 599 * 16 * 2  # the last generated token is never fed
    assert 0.95 < o["kv_allocated_over_formula"] < 1.1, o
    assert o["method_tensor_device_bytes"] > 0 == b["method_tensor_device_bytes"]
    assert res["saved_bytes"]["prefill"] == -2000 and res["pass"] is False  # reference path: never a pass
    assert not hasattr(loaded.model, "_oscar_session")  # detached at the end
