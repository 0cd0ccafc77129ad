"""oscar INT2 inside a real vLLM engine (GPU only: ``pytest -m gpu tests/test_vllm_gpu.py`` with vLLM 0.25 installed).

A tiny Qwen3-shaped engine with random weights (scripts/gpu_vllm_bench.py's smoke model) serves two prompts with
the oscar backend and with BF16: both generate, CUDA graphs are on, and vLLM's block pool holds >= 6x the tokens.
"""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture(scope="module")
def bench():
    if not torch.cuda.is_available():
        pytest.skip("requires CUDA")
    pytest.importorskip("vllm")
    sys.path.insert(0, str(SCRIPTS))
    import gpu_vllm_bench

    gpu_vllm_bench.expose_plugin()
    return gpu_vllm_bench


def test_tiny_engine_generates_with_int2_pages_and_7x_capacity(bench, tmp_path: Path) -> None:
    model = bench.write_qwen3_config(tmp_path / "tiny", bench.TINY, 4096)
    art = str(bench.write_hadamard_artifact(model, tmp_path / "art"))
    args = Namespace(max_num_seqs=8, chunk=256, eager=False, block_size=16)
    ps = bench.prompts(1, 700, bench.TINY["vocab_size"], 1) + bench.prompts(1, 100, bench.TINY["vocab_size"], 2)
    facts = {}
    for backend in ("oscar", "bf16"):
        llm = bench.engine(str(model), True, backend, art, args, 2048, 0.3)
        _, toks = bench.generate(llm, ps, 8)
        facts[backend] = bench.engine_facts(llm)
        assert [len(t) for t in toks] == [8, 8]
        bench.shutdown(llm)
    assert facts["oscar"]["attention_backend"].endswith("CUSTOM")
    assert "FULL" in facts["oscar"]["cudagraph_mode"]  # decode batches run in full CUDA graphs
    assert facts["oscar"]["kv_tokens"] >= 6 * facts["bf16"]["kv_tokens"]


def test_artifact_for_another_model_is_refused_at_engine_start(bench, tmp_path: Path,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    other = bench.write_qwen3_config(tmp_path / "other", dict(bench.TINY, num_hidden_layers=3), 4096)
    art = str(bench.write_hadamard_artifact(other, tmp_path / "art3"))
    model = bench.write_qwen3_config(tmp_path / "tiny", bench.TINY, 4096)
    args = Namespace(max_num_seqs=8, chunk=256, eager=True, block_size=16)
    with pytest.raises(Exception) as err:  # noqa: B017 (the engine core's failure reaches us as a RuntimeError)
        bench.engine(str(model), True, "oscar", art, args, 2048, 0.3)
    # the reason is printed by the engine core process (same stderr) or carried by the exception itself
    assert "made for another model" in capfd.readouterr().err + str(err.value)


def test_decode_in_cuda_graphs_matches_eager_attention(bench, tmp_path: Path) -> None:
    """The captured decode (full CUDA graphs, fixed-address metadata buffers) generates what the same engine does
    with attention outside graphs (PIECEWISE: the rest of the model compiled alike). 4 prompts: a captured batch
    size, so both runs launch the kernels with the same batch (the split count depends on it)."""
    model = bench.write_qwen3_config(tmp_path / "tiny", bench.TINY, 4096)
    art = str(bench.write_hadamard_artifact(model, tmp_path / "art"))
    ps = bench.prompts(4, 400, bench.TINY["vocab_size"], 5)
    toks = {}
    for mode in ("PIECEWISE", None):
        args = Namespace(max_num_seqs=8, chunk=256, eager=False, block_size=16, cudagraph_mode=mode)
        llm = bench.engine(str(model), True, "oscar", art, args, 2048, 0.3)
        toks[mode] = bench.generate(llm, ps, 16)[1]
        assert ("FULL" in bench.engine_facts(llm)["cudagraph_mode"]) == (mode is None)
        bench.shutdown(llm)
    assert toks["PIECEWISE"] == toks[None]
