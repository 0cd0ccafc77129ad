"""vLLM's own classes around the INT2 backend, where vLLM imports (skipped otherwise, e.g. in CI): the plugin
registers ``CUSTOM``, the page spec is vLLM's, and the metadata builder + impl serve vLLM ``CommonAttentionMetadata``
steps (a prefill, a mixed decode + prefill batch, decodes, a CUDA-graph capture batch) under fake engine settings.
FlashAttention is replaced by the core's reference attention so that this also runs on the CPU."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace as N

import pytest
import torch
from helpers.calib import random_orthogonal

pytest.importorskip("vllm")

from oscar_cli.artifact import Manifest, write_artifact  # noqa: E402
from oscar_cli.errors import ArtifactError, OscarError  # noqa: E402
from oscar_cli.model import architecture_fingerprint  # noqa: E402
from oscar_cli.transform import LayerTransform  # noqa: E402

D, HKV, HQ, P = 64, 2, 4, 16
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _config(layers: int = 2):
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=256, num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D,
                       num_hidden_layers=layers, intermediate_size=64, vocab_size=128)


def _artifact(path: Path, cfg, **quant) -> Path:
    g = torch.Generator().manual_seed(0)
    layers = [LayerTransform(k_rotation=random_orthogonal(1, D, i), v_rotation=random_orthogonal(1, D, i + 7),
                             k_mean=0.1 * torch.randn(HKV, D, generator=g), v_mean=0.1 * torch.randn(HKV, D, generator=g),
                             k_eigenvalues=torch.zeros(1, D), v_eigenvalues=torch.zeros(1, D), k_clip=0.92, v_clip=0.9)
              for i in range(cfg.num_hidden_layers)]
    m = Manifest(oscar_version="0.1.0", model={"reference": "tiny", "resolved": "sha256:" + "0" * 64},
                 architecture=architecture_fingerprint(cfg), method="oscar", recipe={},
                 quant={"group_size": None, "meta_dtype": "bfloat16", "sink": 16, "recent": 16, **quant}, data={},
                 seed=0)
    return write_artifact(path, m, layers, "{}\n")


def _engine(art: Path, cfg, **over):
    fake = dict(additional_config={"oscar_artifact": str(art)},
                cache_config=N(enable_prefix_caching=False, block_size=P), speculative_config=None,
                parallel_config=N(tensor_parallel_size=1, decode_context_parallel_size=1,
                                  prefill_context_parallel_size=1),
                scheduler_config=N(max_num_seqs=4, max_num_batched_tokens=128), model_config=N(hf_config=cfg),
                compilation_config=N(max_cudagraph_capture_size=8))
    return N(**(fake | over))


def _cam(qlens, seqs, tables, slots, prefilling):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seqs, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(DEV), query_start_loc_cpu=qsl, seq_lens=seq.to(DEV), num_reqs=len(qlens),
        num_actual_tokens=int(qsl[-1]), max_query_len=max(qlens), max_seq_len=max(seqs),
        block_table_tensor=torch.tensor(tables, dtype=torch.int32, device=DEV),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV), seq_lens_cpu_upper_bound=seq,
        is_prefilling=torch.tensor(prefilling))


@pytest.mark.parametrize("quant", ["int2-meta16", "int4-keys-meta8"])
def test_builder_and_impl_serve_vllm_metadata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quant: str) -> None:
    """``int4-keys-meta8``: the served layer (1) has INT4 keys and the artifact 8-bit metadata: its page holds the
    low plane too (slot ``D/2 + 4 + D/4``), and vLLM's view of the layer's buffer infers that slot."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from oscar_cli.vllm import backend, core, plugin

    plugin.register()
    plugin.register()  # idempotent
    cls = AttentionBackendEnum.CUSTOM.get_class()
    assert cls is backend.OscarInt2Backend and AttentionBackendEnum[cls.get_name()] is AttentionBackendEnum.CUSTOM
    cfg = _config()
    extra = {"meta_dtype": "uint8", "int4_keys": [1]} if quant == "int4-keys-meta8" else {}
    fake = _engine(_artifact(tmp_path / "art", cfg, **extra), cfg)
    monkeypatch.setattr(backend, "get_current_vllm_config", lambda: fake)
    monkeypatch.setattr(backend, "_flash_attend", core.masked_attend)
    backend._RUNTIMES.clear()
    impl = cls.get_impl_cls()(HQ, D, D ** -0.5, HKV)
    slot = D // 2 + 4 + D // 4 if extra else D // 2 + 8
    spec = backend.int2_kv_cache_spec(N(num_kv_heads=HKV, head_size=D, impl=impl,
                                        layer_name="model.layers.1.self_attn.attn"), fake)
    assert type(spec).__name__ == "TQFullAttentionSpec" and spec.page_size_bytes == P * HKV * slot
    other = backend.int2_kv_cache_spec(N(num_kv_heads=HKV, head_size=D, impl=impl,
                                         layer_name="model.layers.0.self_attn.attn"), fake)
    assert other.page_size_bytes == P * HKV * (D // 2 + (4 if extra else 8))  # layer 0: 2-bit keys
    builder = cls.get_builder_cls()(spec, ["model.layers.1.self_attn.attn"], fake, torch.device(DEV))
    layer = N(layer_name="model.layers.1.self_attn.attn")
    kv = torch.zeros(17 * spec.page_size_bytes, dtype=torch.uint8, device=DEV).view(
        cls.get_kv_cache_shape(17, P, HKV, D))  # as vLLM views a layer's buffer
    assert kv.shape[-1] == slot

    def run(md, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(n, h * D, generator=g).half().to(DEV) for h in (HQ, HKV, HKV))
        out = torch.full((n, HQ * D), float("nan"), dtype=torch.float16, device=DEV)
        impl.forward(layer, q, k, v, kv if md is not None else torch.tensor([]), md, output=out)
        return out

    run(None, 8)  # vLLM's profiling call: no metadata, the tiers get allocated
    a, b = [3, 5, 9, 11], [2, 4, 6, 8]

    def slots(blocks: list[int], lo: int, hi: int) -> list[int]:
        return [blocks[p // P] * P + p % P for p in range(lo, hi)]

    steps = [([40], [40], [a], slots(a, 0, 40), [True]),
             ([1, 20], [41, 20], [a, b], slots(a, 40, 41) + slots(b, 0, 20), [False, True]),
             ([1, 1], [42, 21], [a, b], slots(a, 41, 42) + slots(b, 20, 21), [False, False])]
    for qlens, seqs, tables, sl, pre in steps:
        md = builder.build(0, _cam(qlens, seqs, tables, sl, pre))
        assert torch.isfinite(run(md, sum(qlens))).all()
    assert md.step.rows_host == [0, 1] and md.step.recent_len.tolist() == [18, 5]
    cap = builder.build_for_cudagraph_capture(_cam([1, 1], [1, 1], [[0] * 4] * 2, [-1, -1], [False, False]))
    assert cap.step.rows_host == [4, 4] and cap.step.rows.data_ptr() == md.step.rows.data_ptr()  # fixed address


def test_engine_start_refusals(tmp_path: Path) -> None:
    from oscar_cli.vllm import backend

    cfg = _config()
    art = _artifact(tmp_path / "art", cfg)
    backend._RUNTIMES.clear()
    for over, msg in ((dict(additional_config={}), "needs an artifact"),
                      (dict(cache_config=N(enable_prefix_caching=True, block_size=P)), "prefix caching"),
                      (dict(parallel_config=N(tensor_parallel_size=2, decode_context_parallel_size=1)),
                       "tensor / decode-context")):
        with pytest.raises(OscarError, match=msg):
            backend.runtime(_engine(art, cfg, **over), HKV, D)
    with pytest.raises(ArtifactError, match="another model"):
        backend.runtime(_engine(art, _config(3)), HKV, D)
    with pytest.raises(ArtifactError):
        backend.runtime(_engine(tmp_path / "missing", cfg), HKV, D)


def test_artifact_with_non_uniform_levels_is_refused_in_one_line(tmp_path: Path) -> None:
    from oscar_cli.errors import UnsupportedModelError
    from oscar_cli.vllm import backend

    cfg = _config()
    backend._RUNTIMES.clear()
    art = _artifact(tmp_path / "levels", cfg, levels=0.38)
    with pytest.raises(UnsupportedModelError, match=r"non-uniform INT2 levels \(quant.levels 0.38") as e:
        backend.runtime(_engine(art, cfg), HKV, D)
    assert "\n" not in str(e.value)

