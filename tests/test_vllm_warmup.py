"""The backend's engine-start warm-up (``oscar_cli.vllm.warmup``): every scripted step runs through a two-row copy of
the layer on scratch pages, the served layer's state is untouched, and it runs once per process and format (on CUDA
only, never inside a graph capture, off with ``OSCAR_VLLM_WARMUP=0``). That it removes the first-request compile on
a GPU is checked by the bench's ``ttft_first_s`` against ``ttft_s`` (docs/VLLM.md)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from helpers.calib import random_orthogonal
from helpers.vllm_twin import HKV, HQ, D, TorchKernels

from oscar_cli.quant.methods import LayerTransform, oscar_method
from oscar_cli.vllm import layout, warmup
from oscar_cli.vllm.core import PagedInt2Layer, TritonKernels, masked_attend
from oscar_kernels import ops

ACT = torch.float16  # interpreter: fp16 operands
CFG = ops.DecodeConfig(block_n=16, block_nb=16, num_warps=4, num_stages=1)
# the Triton path in the interpreter: one step of each kind, a history and INT2 decodes (the whole script takes
# 4-7 min there; the torch twin runs it whole)
SHORT: warmup.Script = ((("A", 80),), (("A", 17),), (("A", 1), ("B", 33)), (("A", 1), ("B", 1)))


def _factory(page: int, sink: int, int4: bool, kernels: Any) -> Any:
    g = torch.Generator().manual_seed(0)
    t = LayerTransform(k_rotation=random_orthogonal(HKV, D, 5), v_rotation=random_orthogonal(1, D, 6),
                       k_mean=0.2 * torch.randn(HKV, D, generator=g), v_mean=0.1 * torch.randn(1, D, generator=g),
                       k_clip=0.92, v_clip=0.9)
    md = torch.uint8 if int4 else torch.bfloat16
    s = layout.Int2Settings(sink=sink, recent=64, meta_dtype=md, int4_layers=(0,) if int4 else ())
    tensors = layout.layer_tensors(oscar_method([t], sink=sink, recent=64), 1, HKV, D)[0]

    def make(rows: int) -> PagedInt2Layer:
        return PagedInt2Layer(tensors, s, rows, HQ, HKV, D, page, ACT, "cpu", kernels=kernels, key_bits=s.key_bits(0))

    return make


def _interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs the interpreter (TRITON_INTERPRET=1)")


def _run(make: Any, steps: warmup.Script, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[Any]]:
    served = make(4)
    before = [x.clone() for x in served.tiers]
    seen: list[tuple[int, int, list[int]]] = []
    forward = PagedInt2Layer.forward

    def spy(self: PagedInt2Layer, q: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
        st = a[4]
        out = forward(self, q, *a, **kw)
        assert self is not served and int(self.sink_k.shape[0]) == 3  # two rows and the scratch row
        assert torch.isfinite(out.float()).all()
        seen.append((st.num_tokens, st.num_decodes, [e - s for _, s, e, _ in st.prefills]))
        return out

    monkeypatch.setattr(PagedInt2Layer, "forward", spy)
    rep = warmup.warm_up(make, masked_attend, steps)
    assert all(torch.equal(a, b) for a, b in zip(before, served.tiers, strict=True))  # the served layer untouched
    want = [sum(n for _, n in step) for step in steps]
    assert rep.steps == len(steps) and rep.token_counts == want == [n for n, _, _ in seen]
    assert [nd for _, nd, _ in seen] == [sum(n == 1 for _, n in step) for step in steps]
    return rep, seen


@pytest.mark.parametrize("page, sink, int4", [(16, 32, False), (64, 64, True)], ids=["pages-16", "pages-64-int4"])
def test_warm_up_runs_every_step_through_a_copy_of_the_layer(page: int, sink: int, int4: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _, seen = _run(_factory(page, sink, int4, TorchKernels()), warmup.WARM_STEPS, monkeypatch)
    assert seen[1] == (97, 0, [97]) and seen[3] == (501, 1, [500]) and seen[8] == (4100, 0, [4100])


@pytest.mark.slow
def test_warm_up_through_the_triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipes' format (64-token pages, INT4 keys on the layer, 8-bit metadata) in the interpreter: 12 s."""
    _interpreter()
    _, seen = _run(_factory(64, 64, True, TritonKernels(CFG)), SHORT, monkeypatch)
    assert seen == [(80, 0, [80]), (17, 0, [17]), (34, 1, [33]), (2, 2, [])]


def test_the_script_covers_both_tile_sizes_the_torch_rotation_and_both_classes_of_n() -> None:
    from oscar_cli.vllm.core import ROTATE_TRITON_MAX_ROWS

    counts = [sum(n for _, n in step) for step in warmup.WARM_STEPS]
    pure = [n for n, step in zip(counts, warmup.WARM_STEPS, strict=True) if all(k > 1 for _, k in step)]
    mixed = [n for n, step in zip(counts, warmup.WARM_STEPS, strict=True)
             if any(k == 1 for _, k in step) and any(k > 1 for _, k in step)]
    for ns in (pure, mixed):
        assert any(n <= 64 for n in ns) and any(64 < n <= ROTATE_TRITON_MAX_ROWS for n in ns)
        assert any(n % 16 for n in ns) and any(n % 16 == 0 for n in ns)
    assert any(n > ROTATE_TRITON_MAX_ROWS for n in pure)
    tiles = {-(-n // 32) % 16 == 0 for n in pure if 64 < n <= ROTATE_TRITON_MAX_ROWS}
    assert tiles == {True, False}
    # every sequence's prompt is the sum of its chunks, and decodes only come after it
    assert warmup.prompts(warmup.WARM_STEPS) == {"A": 657, "B": 596, "C": 4713}
    for name in ("A", "B"):
        steps = [i for i, step in enumerate(warmup.WARM_STEPS) for s, n in step if s == name]
        chunks = [i for i, step in enumerate(warmup.WARM_STEPS) for s, n in step if s == name and n > 1]
        assert max(chunks) < min(set(steps) - set(chunks), default=len(warmup.WARM_STEPS))
    # C takes A's row only after A's last step
    last_a = max(i for i, step in enumerate(warmup.WARM_STEPS) for s, _ in step if s == "A")
    first_c = min(i for i, step in enumerate(warmup.WARM_STEPS) for s, _ in step if s == "C")
    assert warmup.ROWS["C"] == warmup.ROWS["A"] and last_a < first_c


def test_warm_once_runs_on_cuda_only_once_and_not_when_switched_off(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    calls: list[object] = []
    monkeypatch.setattr(warmup, "warm_up", lambda make, attend: calls.append(make) or warmup.WarmReport(steps=11))
    monkeypatch.setattr(warmup, "_warmed", set())
    key = ("fmt", 2)
    assert warmup.warm_once(key, "m", masked_attend, torch.device("cpu")).skipped == "not on CUDA (nothing to compile)"  # type: ignore[arg-type]
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert warmup.warm_once(key, "m", masked_attend, cuda).skipped == "inside a CUDA graph capture"  # type: ignore[arg-type]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv(warmup.WARMUP_ENV, "0")
    assert warmup.warm_once(key, "m", masked_attend, cuda).skipped == "OSCAR_VLLM_WARMUP=0"  # type: ignore[arg-type]
    monkeypatch.setenv(warmup.WARMUP_ENV, "yes")
    with pytest.raises(ValueError, match="OSCAR_VLLM_WARMUP: expected 0 or 1"):
        warmup.warm_once(key, "m", masked_attend, cuda)  # type: ignore[arg-type]
    monkeypatch.delenv(warmup.WARMUP_ENV)
    assert warmup.warm_once(key, "m", masked_attend, cuda).steps == 11  # type: ignore[arg-type]
    assert warmup.warm_once(key, "m", masked_attend, cuda).skipped == "already warmed in this process"  # type: ignore[arg-type]
    assert warmup.warm_once(("fmt", 4), "m", masked_attend, cuda).steps == 11  # type: ignore[arg-type]
    assert calls == ["m", "m"]
    lines = [r.getMessage() for r in caplog.records if "warmed the INT2 backend" in r.getMessage()]
    assert len(lines) == 2 and "OSCAR_VLLM_WARMUP=0 skips this" in lines[0]
