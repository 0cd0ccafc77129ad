"""The vLLM backend's logic without vLLM: KV spec sizes, metadata -> kernel arguments, artifact -> per-layer tensors,
and the reference semantics of a simulated vLLM run (slot-mapping writes, chunked prefill, a mixed batch of decodes
and a prefill chunk) through the backend's core with the Triton interpreter, against oscar's reference cache."""

from __future__ import annotations

import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from helpers.calib import RESOLVED, random_orthogonal, random_transform, tiny_recipe
from helpers.tiny import tiny_causal_lm
from helpers.vllm_twin import HKV, HQ, INV_FREQ, D, TorchKernels

from oscar_cli.errors import OscarError, UnsupportedModelError
from oscar_cli.quant.int2_layer import Int2Layer
from oscar_cli.quant.key_mean import rope as rope_fn
from oscar_cli.quant.methods import LayerTransform, oscar_method
from oscar_cli.vllm import layout, spec
from oscar_cli.vllm.core import PagedInt2Layer, build_step, split_decodes
from oscar_kernels import ops
from oscar_kernels import reference as ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GB = 1 << 30


# ---------------------------------------------------------------------------------------------------- spec sizes
@pytest.mark.unit
@pytest.mark.parametrize(("d", "meta", "slot"), [(128, 2, 72), (64, 2, 40), (128, 4, 80), (128, 1, 68), (64, 1, 36)])
def test_slot_bytes_match_the_bpe_formula(d: int, meta: int, slot: int) -> None:
    assert spec.slot_bytes(d, meta) == slot
    # the pages' bits per element are the BPE formula's INT2 term 2 + 2·b_meta/G (G = D), long-context limit
    bpe_hist = ref.bits_per_element(10**9, d, None, 8 * meta, sink=0, recent=0)
    assert spec.bits_per_stored_element(d, meta) == pytest.approx(bpe_hist)
    s = spec.Int2KVSpec(num_kv_heads=8, head_dim=d, block_size=16, meta=meta)
    assert s.page_bytes == 16 * 8 * slot and s.token_bytes * 8 == 2 * 8 * d * bpe_hist


@pytest.mark.unit
@pytest.mark.parametrize(
    ("name", "layers", "h_kv", "d", "memory", "seqs"),
    [("qwen3-8b", 36, 8, 128, 60 * GB, 32), ("qwen3-8b-many-seqs", 36, 8, 128, 100 * GB, 64),
     ("qwen2.5-coder-1.5b", 28, 2, 128, 100 * GB, 64), ("qwen2.5-coder-1.5b-small", 28, 2, 128, 8 * GB, 16)],
)
def test_capacity_at_equal_memory_is_at_least_6x_bf16(name: str, layers: int, h_kv: int, d: int, memory: int,
                                                      seqs: int) -> None:
    s = spec.Int2KVSpec(num_kv_heads=h_kv, head_dim=d, block_size=16)
    assert s.ring == 263 and s.sequence_tier_bytes == (64 + 263) * h_kv * d * 2 * 2
    bf16 = spec.bf16_capacity_tokens(memory, layers, h_kv, d)
    assert bf16 == memory // (layers * 2 * h_kv * d * 2)
    ratio = spec.capacity_ratio(memory, layers, s, seqs)
    assert ratio >= 6.0, f"{name}: {ratio:.2f}x"
    assert spec.capacity_ratio(memory, layers, s, 0) == pytest.approx(512 / 72, rel=1e-3)
    # the tiers' rows are what separates the two
    free = memory - seqs * layers * s.sequence_tier_bytes
    assert spec.capacity_tokens(memory, layers, s, seqs) == free // (layers * s.token_bytes)


@pytest.mark.unit
@pytest.mark.parametrize(("d", "meta", "slot"), [(128, 1, 100), (128, 2, 104), (64, 1, 52)])
def test_int4_key_layers_pages_hold_the_low_plane(d: int, meta: int, slot: int) -> None:
    """A layer with INT4 keys stores ``D/4`` more bytes per token and KV head (the keys' low plane): 3 bits per
    element over K and V plus the metadata's; the model's token bytes add that on those layers only."""
    assert spec.slot_bytes(d, meta, 4) == slot == spec.slot_bytes(d, meta) + d // 4
    assert spec.bits_per_stored_element(d, meta, 4) == pytest.approx(3 + 2 * 8 * meta / d)
    s = spec.Int2KVSpec(num_kv_heads=2, head_dim=d, block_size=16, meta=meta)
    assert spec.model_token_bytes(28, s, 8) == 20 * 2 * spec.slot_bytes(d, meta) + 8 * 2 * slot
    assert spec.capacity_tokens(GB, 28, s, 0, 8) == GB // spec.model_token_bytes(28, s, 8)
    with pytest.raises(ValueError, match="key_bits"):
        spec.slot_bytes(d, meta, 3)
    with pytest.raises(ValueError, match="int4_layers"):
        spec.model_token_bytes(28, s, 29)


@pytest.mark.unit
def test_qwen_recipe_pages_hold_6_6x_the_tokens_of_bf16() -> None:
    """Qwen2.5-Coder-1.5B's recipe (8 of 28 layers with INT4 keys, 8-bit metadata): 4,320 page bytes per token
    against BF16's 28,672 (6.64x at equal memory, before the BF16 tiers' rows)."""
    s = spec.Int2KVSpec(num_kv_heads=2, head_dim=128, block_size=16, meta=1)
    assert spec.model_token_bytes(28, s, 8) == 4320
    assert spec.capacity_ratio(100 * GB, 28, s, 0, 8) == pytest.approx(28672 / 4320, rel=1e-6)


@pytest.mark.unit
def test_ring_and_meta_edge_cases() -> None:
    assert spec.ring_tokens(0) == 0 and spec.ring_tokens(256) == 263 and spec.ring_tokens(8, 4) == 11
    with pytest.raises(ValueError, match="meta_dtype"):
        spec.meta_bytes("int8")
    with pytest.raises(ValueError, match="multiple of 16"):
        spec.slot_bytes(72)


# ---------------------------------------------------------------------------------------------- metadata -> args
@pytest.mark.unit
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 5, 17], [33], [1, 1, 64, 2]])
def test_token_positions_on_awkward_lengths(q_lens: list[int]) -> None:
    computed = [0 if q > 1 else 40 + i for i, q in enumerate(q_lens)]
    seq = [c + q for c, q in zip(computed, q_lens, strict=True)]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    pad = 3
    req, pos = layout.token_positions(qsl, torch.tensor(seq, dtype=torch.int32), int(qsl[-1]) + pad)
    want_req = [i for i, q in enumerate(q_lens) for _ in range(q)]
    want_pos = [c + j for c, q in zip(computed, q_lens, strict=True) for j in range(q)]
    n = len(want_req)
    assert req[:n].tolist() == want_req and pos[:n].tolist() == want_pos
    assert (req[n:] == len(q_lens) - 1).all()  # padding: clamped to a real request (its slot is -1)


@pytest.mark.unit
def test_slot_mapping_and_shifted_block_table_address_the_same_tokens() -> None:
    """The kernel reads history position S0 + t at block_table[:, S0/P:][t // P]: the slot vLLM wrote it to."""
    p, s0 = 16, 32
    table = torch.tensor([[7, 3, 9, 1, 4]], dtype=torch.int32)
    for pos in (32, 47, 48, 79):
        slot = int(table[0, pos // p]) * p + pos % p
        t = pos - s0
        assert int(table[0, s0 // p:][t // p]) * p + t % p == slot


@pytest.mark.unit
def test_decode_lengths_and_ring_index() -> None:
    seq = torch.tensor([5, 64, 65, 400], dtype=torch.int32)
    recent = torch.tensor([0, 0, 1, 260], dtype=torch.int32)
    sink_len, hist_len = layout.decode_lengths(seq, recent, 64)
    assert sink_len.tolist() == [5, 64, 64, 64] and hist_len.tolist() == [0, 0, 0, 76]
    idx = layout.ring_gather_index(seq, recent, 263)
    assert idx[2, 0].item() == 64 % 263 and idx[3, :260].tolist() == [p % 263 for p in range(140, 400)]


def _reference_recent(chunks: list[int], decodes: int, sink: int, recent: int) -> list[int]:
    """Recent-tier sizes of the reference cache after each update (the rule next_recent_len reproduces)."""
    meth = oscar_method([random_transform(0)], sink=sink, recent=recent)
    lay = Int2Layer(meth, meth.layer(0))
    sizes = []
    steps = [(c, i == len(chunks) - 1) for i, c in enumerate(chunks)] + [(1, True)] * decodes
    for n, final in steps:
        lay.final_chunk = final
        lay.update(torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16))
        sizes.append(lay.tier_sizes()[2])
    return sizes


@pytest.mark.unit
@pytest.mark.parametrize(("chunks", "sink", "recent"), [([40, 30], 16, 16), ([5], 8, 16), ([3, 9], 8, 8),
                                                        ([1], 8, 16), ([20], 8, 0), ([8, 100, 4], 8, 32),
                                                        ([40, 1], 16, 16), ([8, 100, 1], 8, 32)])
def test_next_recent_len_follows_the_reference_placement(chunks: list[int], sink: int, recent: int) -> None:
    s = layout.Int2Settings(sink=sink, recent=recent)
    want = _reference_recent(chunks, 30, sink, recent)
    state = torch.tensor([[7, 3]], dtype=torch.int32)  # a previous owner's state: a new sequence ignores it
    rows = torch.tensor([0])
    got, seq = [], 0
    for i, n in enumerate(chunks + [1] * 30):
        seq += n
        args = (state, rows, torch.tensor([n]), torch.tensor([seq]), s, torch.tensor([i < len(chunks)]))
        r = layout.advance_recent(*args)
        assert torch.equal(layout.advance_recent(*args), r)  # the same step built twice does not advance twice
        got.append(int(r))
    # after a non-final chunk the reference holds no recent tier; the backend cannot tell a chunk is not the last,
    # and nothing reads that value (the next step of that sequence is another chunk, which ignores it)
    final = [False] * (len(chunks) - 1) + [True] * 31
    assert [g for g, f in zip(got, final, strict=True) if f] == [w for w, f in zip(want, final, strict=True) if f]


@pytest.mark.unit
def test_split_decodes_requires_decodes_first() -> None:
    assert split_decodes([0, 1, 2, 10]) == 2 and split_decodes([0, 5]) == 0 and split_decodes([0, 1]) == 1
    with pytest.raises(ValueError, match="not reordered"):
        split_decodes([0, 4, 5])


@pytest.mark.unit
def test_sequence_rows_assign_reuse_evict_and_refuse() -> None:
    rows = layout.SequenceRows(2)
    assert rows.assign([5, 9], [True, True]) == [0, 1]
    assert rows.assign([9, 5], [False, False]) == [1, 0]
    assert rows.assign([0, 0], [True, True]) == [2, 2]  # vLLM's null block (dummy / padding) -> scratch row
    assert rows.assign([12], [True]) == [1]  # least recently seen owner (9) gives its row away
    with pytest.raises(OscarError, match="BF16 tiers of a running request"):
        rows.assign([9], [False])
    with pytest.raises(OscarError, match="more than 2 requests"):
        rows.assign([5, 12, 13], [False, False, True])


class _FakeRunner:
    """The shape of vLLM 0.25's GPU model runner that host_first_blocks reads (input_batch.block_table[gid])."""

    def __init__(self, table: list[list[int]]) -> None:
        import numpy as np

        arr = np.array(table, dtype=np.int32)
        self.input_batch = SimpleNamespace(block_table=[SimpleNamespace(get_numpy_array=lambda: arr)])

    def _build_attention_metadata(self, num_reqs: int):
        kv_cache_gid = 0  # noqa: F841 (read from this frame)
        return _builder_build(num_reqs)


def _builder_build(num_reqs: int):
    return (lambda: layout.host_first_blocks(num_reqs))()


@pytest.mark.unit
def test_host_first_blocks_reads_the_calling_runners_table() -> None:
    assert _FakeRunner([[7, 1], [3, 2], [0, 0]])._build_attention_metadata(2) == [7, 3]
    assert layout.host_first_blocks(2) is None  # no runner among the callers


def _v2_execute_model(scheduler_output: object, batch: object, num_reqs: int, dummy_run: bool = False):
    """The frames of vLLM 0.25's V2 runner that host_request_slots reads: execute_model -> prepare_attn."""
    return _v2_prepare_attn(batch, num_reqs)


def _v2_prepare_attn(input_batch: object, num_reqs: int):
    return (lambda: layout.host_request_slots(num_reqs))()


def _v2_batch(slots: list[int], num_reqs: int) -> SimpleNamespace:
    import numpy as np

    return SimpleNamespace(idx_mapping_np=np.array(slots, dtype=np.int32), num_reqs=num_reqs)


@pytest.mark.unit
def test_host_request_slots_reads_the_v2_runners_batch() -> None:
    assert _v2_execute_model(object(), _v2_batch([5, 0, 3], 3), 3) == [5, 0, 3]
    # a full-graph batch padded from 2 to 4 requests: the padding has no slot
    assert _v2_execute_model(object(), _v2_batch([5, 0], 2), 4) == [5, 0, -1, -1]
    # a dummy batch (profiling, DP padding): its arange slots are not requests
    assert _v2_execute_model(object(), _v2_batch([0, 1], 2), 2, dummy_run=True) == [-1, -1]
    assert layout.host_request_slots(2) is None  # no runner among the callers
    assert _v2_prepare_attn(_v2_batch([1], 1), 1) is None  # no execute_model frame above prepare_attn: unknown caller


@pytest.mark.unit
def test_rows_from_slots_and_their_check() -> None:
    assert layout.rows_from_slots([3, -1, 0], num_rows=4, scratch=4) == [3, 4, 0]
    with pytest.raises(OscarError, match="slot 4 is beyond the 4 rows"):
        layout.rows_from_slots([4], num_rows=4, scratch=4)
    layout.check_slots_against_blocks([3, 0, -1], [17, 9, 0])
    layout.check_slots_against_blocks([-1, -1], [5, 0])  # dummy rows are not checked
    for slots, blocks in (([3, 3], [17, 9]), ([3, 1], [17, 17]), ([2], [0])):
        with pytest.raises(OscarError, match="do not match the batch's block table"):
            layout.check_slots_against_blocks(slots, blocks)


@pytest.mark.unit
@pytest.mark.parametrize("fmt", ["meta16", "meta8", "meta8-int4-keys", "meta16-int4-keys"])
@pytest.mark.parametrize(("p", "h_kv", "d"), [(16, 2, 64), (64, 8, 128), (32, 1, 64)])
def test_carved_pages_partition_the_page_bytes(p: int, h_kv: int, d: int, fmt: str) -> None:
    """The views of a page (K codes, V token quads, four metadata arrays, and with INT4 keys the low plane) cover
    its bytes without overlap; the low plane has the K codes' shape and strides (the kernel addresses it by their
    offsets), and 8-bit metadata sits on 4-byte boundaries (the decode reads it as 32-bit words)."""
    nb = 3
    md = torch.uint8 if fmt.startswith("meta8") else torch.bfloat16
    bits = 4 if fmt.endswith("int4-keys") else 2
    slot = spec.slot_bytes(d, 1 if md == torch.uint8 else 2, bits)
    raw = torch.zeros(nb, p, h_kv, slot, dtype=torch.uint8)
    kc, vc = layout.carve_pages(raw, d, md, bits)
    views = [kc.packed, vc.packed, kc.scale, kc.zero, vc.scale, vc.zero]
    if bits == 4:
        lo = layout.carve_low_plane(raw, d, md)
        assert lo.shape == kc.packed.shape and lo.stride() == kc.packed.stride()
        views.append(lo)
    else:
        with pytest.raises(ValueError, match="4-bit keys"):
            layout.carve_low_plane(raw, d, md)
    assert kc.packed.shape == (nb, h_kv, p, d // 4) and kc.scale.shape == (nb, h_kv, p, 1)
    assert vc.packed.shape == (nb, h_kv, p // min(p, 64) * d, min(p, 64) // 4)
    assert kc.scale.stride() == kc.zero.stride() == vc.scale.stride() == vc.zero.stride()
    assert kc.scale.dtype == md
    if md == torch.uint8:
        assert all(t.data_ptr() % 4 == 0 and t.stride(0) % 4 == 0 and t.stride(1) % 4 == 0
                   for t in (kc.scale, kc.zero, vc.scale, vc.zero))
    owner = torch.zeros(raw.numel(), dtype=torch.int64)
    for i, t in enumerate(views, start=1):
        before = raw.clone()
        t.view(torch.uint8).fill_(255) if t.dtype == torch.uint8 else t.fill_(float("nan"))
        changed = (raw != before).reshape(-1)
        assert (owner[changed] == 0).all(), f"view {i} overlaps another"
        owner[changed] = i
    assert (owner > 0).all(), "page bytes not covered by any view"
    with pytest.raises(ValueError, match="does not hold"):
        layout.carve_pages(torch.zeros(nb, p, h_kv, slot + 4, dtype=torch.uint8), d, md, bits)


# ----------------------------------------------------------------------------------- artifact -> layer tensors
@pytest.mark.unit
@pytest.mark.parametrize("grouping", ["layer", "head"])
def test_layer_tensors_from_a_calibrated_tiny_artifact(tmp_path, grouping: str) -> None:
    from oscar_cli.calibration.run import calibrate_model
    from oscar_cli.quant.methods import oscar_from_artifact

    model = tiny_causal_lm("qwen3", intermediate=64, max_positions=512)
    res = calibrate_model(model, None, tiny_recipe(rotation={"grouping": grouping}), reference="tiny", resolved=RESOLVED,
                          out=tmp_path / "a")
    meth = oscar_from_artifact(str(res.artifact_path), model.config)
    lts = layout.layer_tensors(meth, 2, 2, 16)
    for lt, tr in zip(lts, meth.layers, strict=True):
        want = (16, 16) if grouping == "layer" else (2, 16, 16)
        assert tuple(lt.k_rotation.shape) == want and tuple(lt.v_rotation.shape) == want
        assert torch.equal(lt.k_rotation.reshape(-1, 16, 16), tr.k_rotation.reshape(-1, 16, 16))
        assert lt.k_mean.shape == (2, 16) and lt.v_mean.is_contiguous() and lt.k_clip == tr.k_clip
    with pytest.raises(UnsupportedModelError, match="3 layers, the model 2|2 layers, the model 3"):
        layout.layer_tensors(meth, 3, 2, 16)
    with pytest.raises(UnsupportedModelError, match="k_rotation"):
        layout.layer_tensors(meth, 2, 4, 32)


@pytest.mark.unit
def test_rope_frequencies_from_the_model_config() -> None:
    """Plain RoPE from rope_theta; YaRN through transformers' initialisation (its attention factor, interpolated low
    frequencies); a RoPE whose frequencies change with the length is refused in one line."""
    import math

    from oscar_cli.model.rope import apply_yarn

    tiny = tiny_causal_lm("qwen3")
    d = int(tiny.config.head_dim)
    r = layout.rope_frequencies(tiny.config, d, 32768)
    assert torch.equal(r.inv_freq, tiny.model.rotary_emb.inv_freq.float().cpu()) and r.scaling == 1.0
    assert r.positions == 32768
    apply_yarn(tiny, 4.0)
    y = layout.rope_frequencies(tiny.config, d, 4096)
    rotary = tiny.model.rotary_emb
    assert y.scaling == pytest.approx(0.1 * math.log(4) + 1) and y.scaling == pytest.approx(rotary.attention_scaling)
    assert torch.allclose(y.inv_freq, rotary.inv_freq.float().cpu())
    dyn = SimpleNamespace(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(UnsupportedModelError, match="dynamic RoPE") as e:
        layout.rope_frequencies(dyn, 128, 4096)
    assert "\n" not in str(e.value)


@pytest.mark.unit
def test_layer_tensors_of_a_rope_mean_artifact() -> None:
    """Keys centred by position: the constant key mean is zero (the BF16 tiers stay uncentred, as the reference cache
    keeps them) and ``k_mean_pre`` travels; a layer without it is refused."""
    g = torch.Generator().manual_seed(0)
    pre = torch.randn(2, 64, generator=g)
    t = LayerTransform(k_mean=torch.randn(2, 64, generator=g), v_mean=torch.randn(1, 64, generator=g),
                       k_mean_pre=pre)
    meth = replace(oscar_method([t], sink=16, recent=16), key_mean="rope")
    got = layout.layer_tensors(meth, 1, 2, 64)[0]
    assert torch.equal(got.k_mean, torch.zeros(2, 64)) and torch.equal(got.k_mean_pre, pre)
    assert layout.layer_tensors(oscar_method([t], sink=16, recent=16), 1, 2, 64)[0].k_mean_pre is None
    with pytest.raises(UnsupportedModelError, match="k_mean_pre"):
        layout.layer_tensors(replace(meth, layers=(replace(t, k_mean_pre=None),)), 1, 2, 64)
    with pytest.raises(ValueError, match="RopeFrequencies"):
        PagedInt2Layer(got, layout.Int2Settings(sink=16, recent=16), 2, 4, 2, 64, 16, torch.float16, "cpu")


@pytest.mark.unit
@pytest.mark.parametrize("key_mean", ["constant", "rope"])
@pytest.mark.parametrize("default", [torch.bfloat16, torch.float16])
def test_layer_tensors_are_float32_under_the_model_default_dtype(key_mean: str, default: torch.dtype) -> None:
    """vLLM builds the attention layers under ``torch.set_default_dtype(model dtype)``: every operand the kernels
    check as float32 (rotations, means, ``k_mean_pre``), including the zero key mean of a rope artifact and the
    identity rotation of a layer without one, stays float32 (on the H200 a rope artifact failed engine start with
    ``k_mean: expected float32 [2, 128], got torch.bfloat16`` before)."""
    g = torch.Generator().manual_seed(1)
    t = LayerTransform(k_mean=torch.randn(2, 64, generator=g), v_mean=torch.randn(1, 64, generator=g),
                       k_mean_pre=torch.randn(2, 64, generator=g))
    meth = replace(oscar_method([t], sink=16, recent=16), key_mean=key_mean)
    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        got = layout.layer_tensors(meth, 1, 2, 64)[0]
    finally:
        torch.set_default_dtype(before)
    tensors = [got.k_rotation, got.v_rotation, got.k_mean, got.v_mean] + ([got.k_mean_pre] if key_mean == "rope" else [])
    assert [x.dtype for x in tensors] == [torch.float32] * len(tensors)
    assert (got.k_mean_pre is None) == (key_mean == "constant")


@pytest.mark.unit
def test_geometry_refusals_are_one_line() -> None:
    s = layout.Int2Settings(sink=64, recent=256)
    layout.check_geometry(head_dim=128, block_size=16, settings=s, group_size=None)
    cases = [(dict(head_dim=96), "head_dim 96"), (dict(block_size=8), "block size 8"),
             (dict(group_size=32), "quantization group 32"), (dict(sliding_window=4096), "sliding-window"),
             (dict(settings=layout.Int2Settings(sink=24, recent=256)), "sink 24"),
             (dict(keep_fraction=0.01), "BF16 keep budget"),
             (dict(key_mean="learned"), "key mean 'learned'"),
             (dict(layer_kinds=("int2", "dense", "int2", "kivi", "dense")), r"\(BF16: layers 1, 4; KIVI: layer 3;")]
    layout.check_geometry(head_dim=128, block_size=16, settings=s, group_size=None, key_mean="rope")  # served
    layout.check_geometry(head_dim=128, block_size=16, settings=s, group_size=None, layer_kinds=("int2",) * 3)
    for over, msg in cases:
        args = dict(head_dim=128, block_size=16, settings=s, group_size=None) | over
        with pytest.raises(UnsupportedModelError, match=msg) as e:
            layout.check_geometry(**args)  # type: ignore[arg-type]
        assert "\n" not in str(e.value)
    assert layout.layer_index("model.layers.12.self_attn.attn") == 12
    with pytest.raises(UnsupportedModelError, match="decoder layer"):
        layout.layer_index("vision.attn")


@pytest.mark.unit
@pytest.mark.parametrize(("block_size", "sink", "hinted"), [
    (16, 64, True), (32, 128, True), (16, 0, True),    # the sink fits 64-token pages: suggest them
    (64, 64, False),                                   # already there
    (16, 32, False), (32, 96, False),                  # 64-token pages would split the sink: the engine refuses them
])
def test_page_size_hint_names_64_token_pages_only_where_they_are_served(block_size: int, sink: int,
                                                                         hinted: bool) -> None:
    hint = layout.page_size_hint(block_size, sink)
    assert (hint is not None) == hinted
    if hint is not None:
        assert "--block-size 64" in hint and f"{block_size}-token pages" in hint and "\n" not in hint
        # what it suggests, the geometry check accepts
        layout.check_geometry(head_dim=128, block_size=64, settings=layout.Int2Settings(sink=sink, recent=256),
                              group_size=None)


@pytest.mark.parametrize("scheme", ["bf16", "kivi", "identity", "hadamard"])
def test_an_artifact_with_a_fallback_layer_is_refused_or_served_as_stored(tmp_path, scheme: str) -> None:
    """The calibration's per-layer fallback (calibration.layers[i].scheme): a layer it keeps in BF16 or serves by
    KIVI is refused at engine start in one line (the backend would otherwise serve it as INT2 with an identity
    transform: silently wrong); identity and Hadamard layers are INT2 layers and are served with their stored
    transform."""
    from oscar_cli.artifact import Manifest, write_artifact
    from oscar_cli.model import architecture_fingerprint
    from oscar_cli.quant.methods import oscar_from_artifact

    model = tiny_causal_lm("qwen3", layers=3, head_dim=64, heads=2, kv_heads=1, intermediate=32)
    d = model.config.head_dim
    t = [replace(random_transform(i, d=d), k_eigenvalues=torch.zeros(1, d), v_eigenvalues=torch.zeros(1, d))
         for i in range(3)]
    rows = [{"scheme": "oscar"}, {"scheme": scheme}, {"scheme": "oscar"}]
    m = Manifest(oscar_version="0.1.0", model={"reference": "t", "resolved": RESOLVED},
                 architecture=architecture_fingerprint(model.config), method="oscar", recipe={},
                 quant={"group_size": None, "meta_dtype": "bfloat16", "sink": 16, "recent": 16}, data={}, seed=0,
                 calibration={"layers": rows})
    meth = oscar_from_artifact(str(write_artifact(tmp_path / "a", m, t, "{}\n")), model.config)
    if scheme in ("bf16", "kivi"):
        with pytest.raises(UnsupportedModelError, match=f"{'BF16' if scheme == 'bf16' else 'KIVI'}: layer 1;") as e:
            layout.check_method(meth, head_dim=model.config.head_dim, block_size=16)
        assert "\n" not in str(e.value) and "transformers" in str(e.value)
        return
    settings = layout.check_method(meth, head_dim=model.config.head_dim, block_size=16)
    assert (settings.sink, settings.recent) == (16, 16)
    tensors = layout.layer_tensors(meth, 3, model.config.num_key_value_heads, model.config.head_dim)
    got = tensors[1].k_rotation if tensors[1].k_rotation.dim() == 2 else tensors[1].k_rotation[0]
    assert torch.allclose(got.float(), torch.eye(d) if scheme == "identity" else t[1].k_rotation[0])


def test_an_artifact_with_bf16_keys_on_some_layers_is_refused(tmp_path) -> None:
    """``quant.bf16_keys`` writes a keep tier on the chosen layers (quant.keep.layers): the kernels do not read it,
    so engine start refuses the artifact in one line instead of serving those layers' keys as INT2."""
    from oscar_cli.artifact import Manifest, write_artifact
    from oscar_cli.model import architecture_fingerprint
    from oscar_cli.quant.methods import oscar_from_artifact

    model = tiny_causal_lm("qwen3", layers=3, head_dim=64, heads=2, kv_heads=1, intermediate=32)
    d = model.config.head_dim
    t = [replace(random_transform(i, d=d), k_eigenvalues=torch.zeros(1, d), v_eigenvalues=torch.zeros(1, d))
         for i in range(3)]
    keep = {"fraction": 1.0, "score": "knorm", "side": "keys", "layers": [1]}
    m = Manifest(oscar_version="0.1.0", model={"reference": "t", "resolved": RESOLVED},
                 architecture=architecture_fingerprint(model.config), method="oscar", recipe={},
                 quant={"group_size": None, "meta_dtype": "bfloat16", "sink": 16, "recent": 16, "keep": keep},
                 data={}, seed=0, calibration={})
    meth = oscar_from_artifact(str(write_artifact(tmp_path / "a", m, t, "{}\n")), model.config)
    assert meth.keep_layers == (1,)
    with pytest.raises(UnsupportedModelError, match="a BF16 keep budget") as e:
        layout.check_method(meth, head_dim=d, block_size=16)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------- simulated vLLM vs reference cache
P, S0, W = 16, 16, 16
ACT = torch.float16  # interpreter: fp16 operands (bf16 tl.dot is wrong there)
CFG = ops.DecodeConfig(block_n=16, block_nb=16, num_warps=4, num_stages=1)  # the interpreter's tiles


def _cpu_simulation(kernels: str) -> str:
    """The simulated runs keep every tensor on the CPU (requests, pages, the reference cache): the torch twin runs
    anywhere, the Triton kernels in the interpreter only (CI, or TRITON_INTERPRET=1); on a GPU the same path is
    checked end to end by ``scripts/gpu_session.sh vruler`` (vLLM on Qwen2.5 against oscar's path)."""
    if kernels.startswith("triton") and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs the interpreter (TRITON_INTERPRET=1)")
    return "cpu"




class _FixedRope:
    """The reference cache's RoPE source for a model-free test (:class:`oscar_cli.quant.key_mean.RopeTable`'s
    interface): fixed frequencies and attention scaling."""

    def __init__(self, inv: torch.Tensor, scaling: float) -> None:
        self.inv, self.scaling = inv, scaling

    def frequencies(self) -> tuple[torch.Tensor, float]:
        return self.inv, self.scaling

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ref.rope_cos_sin(self.inv, self.scaling, positions.long())

    def kernel_table(self, positions: int, device: torch.device) -> torch.Tensor:
        return ops.position_table(self.inv, max(positions, 4096), device)


class _Request:
    def __init__(self, name: str, prompt: list[int], decodes: int, blocks: list[int], seed: int, t,
                 sink: int = S0) -> None:
        g = torch.Generator().manual_seed(seed)
        total = sum(prompt) + decodes
        self.q = torch.randn(total, HQ, D, generator=g).to(ACT)
        self.k = (torch.randn(total, HKV, D, generator=g) * 1.5 + 0.3).to(ACT)
        self.v = torch.randn(total, HKV, D, generator=g).to(ACT)
        self.blocks, self.done, self.name, self.prompt, self.sink = blocks, 0, name, sum(prompt), sink
        meth = oscar_method([t], sink=sink, recent=W)
        if t.k_mean_pre is not None:
            meth = replace(meth, key_mean="rope")
            self.ref = Int2Layer(meth, meth.layer(0), rope_table=_FixedRope(INV_FREQ, ROPE_SCALING))  # type: ignore[arg-type]
        else:
            self.ref = Int2Layer(meth, meth.layer(0))
        self.t = t

    def set_format(self, meta_dtype: torch.dtype, int4_keys: bool) -> None:
        """The reference cache with this metadata dtype, and INT4 keys on its layer when ``int4_keys``."""
        meth = replace(oscar_method([self.t], sink=self.sink, recent=W, meta_dtype=meta_dtype),
                       int4_key_layers=(0,) if int4_keys else ())
        meth = replace(meth, key_mean="rope") if self.t.k_mean_pre is not None else meth
        rope = _FixedRope(INV_FREQ, ROPE_SCALING) if self.t.k_mean_pre is not None else None
        self.ref = Int2Layer(meth.for_layer(0), meth.layer(0), rope_table=rope)  # type: ignore[arg-type]

    def reference(self, n: int, final: bool) -> torch.Tensor:
        """The reference cache's update + attention for the next ``n`` tokens (float32, model space)."""
        a, b = self.done, self.done + n
        self.ref.final_chunk = final
        keys, values = self.ref.update(self.k[a:b].transpose(0, 1)[None], self.v[a:b].transpose(0, 1)[None])
        rk = self.t.k_rotation.expand(HKV, D, D).repeat_interleave(HQ // HKV, 0)
        q = torch.einsum("nhd,hde->nhe", self.q[a:b].float(), rk).to(ACT).float()
        kk = keys[0].float().repeat_interleave(HQ // HKV, 0)
        vv = values[0].float().repeat_interleave(HQ // HKV, 0)
        s = torch.einsum("nhd,htd->hnt", q, kk) * D ** -0.5
        mask = torch.arange(b)[None, :] <= torch.arange(a, b)[:, None]
        o = torch.einsum("hnt,htd->nhd", torch.softmax(s.masked_fill(~mask, float("-inf")), -1), vv)
        rv = self.t.v_rotation.expand(HKV, D, D).repeat_interleave(HQ // HKV, 0)
        return torch.einsum("nhd,hed->nhe", o, rv)


def _step(layer: PagedInt2Layer, kv: torch.Tensor, rows: layout.SequenceRows, state: torch.Tensor,
          batch: list[tuple[_Request, int, bool]], pad: int):
    """One vLLM step: decodes first, then prefill chunks; ``pad`` padding tokens (slot -1) at the end."""
    qs, ks, vs, slots, qsl, seq, table = [], [], [], [], [0], [], []
    P = layer.block_size
    for r, n, _ in batch:
        a = r.done
        qs.append(r.q[a:a + n]), ks.append(r.k[a:a + n]), vs.append(r.v[a:a + n])
        slots += [r.blocks[p // P] * P + p % P for p in range(a, a + n)]
        qsl.append(qsl[-1] + n)
        seq.append(a + n)
        table.append(r.blocks + [0] * (8 - len(r.blocks)))
    q, k, v = (torch.cat(x + [torch.zeros(pad, *x[0].shape[1:], dtype=ACT)]) for x in (qs, ks, vs))
    slot_t = torch.tensor(slots + [-1] * pad, dtype=torch.int64)
    new = [r.done == 0 for r, _, _ in batch]
    row_ids = rows.assign([r.blocks[0] for r, _, _ in batch], new)
    prefilling = torch.tensor([r.done < r.prompt for r, _, _ in batch])  # vLLM's is_prefilling (before the step)
    st = build_step(torch.tensor(qsl, dtype=torch.int32), qsl, torch.tensor(seq, dtype=torch.int32), seq,
                    torch.tensor(table, dtype=torch.int32), slot_t, qsl[-1], row_ids, state, layer.s, prefilling)
    kp, vp = layout.carve_pages(kv, D, layer.s.meta_dtype, layer.key_bits)
    low = layout.carve_low_plane(kv, D, layer.s.meta_dtype) if layer.key_bits == 4 else None
    out = torch.full((q.shape[0], HQ, D), float("nan"), dtype=ACT)
    layer.forward(q, k, v, kp, vp, st, out, k_low=low)
    got, want = [], []
    for j, ((r, n, final), a) in enumerate(zip(batch, qsl, strict=False)):
        want.append(r.reference(n, final))
        got.append(out[a:a + n].float())
        r.done += n
        if final:  # (after a non-final chunk nothing reads the recent length: see next_recent_len)
            assert int(st.recent_len[j]) == r.ref.tier_sizes()[2], r.name
    return torch.cat(got), torch.cat(want), kp, vp


ROPE_SCALING = 1.07  # YaRN x2's attention factor: the term and the means scale with it


@pytest.mark.slow
@pytest.mark.parametrize("page", [16, 64], ids=["pages-16", "pages-64"])
def test_simulated_vllm_run_switches_tier_reads_by_batch(page: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's default (``OSCAR_VLLM_DIRECT_TIERS`` unset: ``direct_tiers=None``) with the switch lowered to 2
    decode requests: the run's one-decode step gathers the tiers (the fused gather, q rotated in its launch), its
    two-decode steps read them in place (q rotated in the K/V rotation's launch), and the pages and outputs are
    the reference cache's as in every other path (the rope format with INT4 keys, the most arguments); with vLLM's
    default 16-token pages and with ``--block-size 64`` (one block-table entry per 64-token tile, a one-page sink)."""
    from oscar_cli.vllm import core

    monkeypatch.setattr(core, "DIRECT_TIERS_FROM_BATCH", 2)
    seen: list[tuple[int, bool]] = []
    gather, decode = core.TritonKernels.tier_gather, core.TritonKernels.decode

    def spy_gather(self: object, *args: object, **kw: object) -> object:
        seen.append((int(args[1].shape[0]), False))  # type: ignore[attr-defined]
        return gather(self, *args, **kw)  # type: ignore[arg-type]

    def spy_decode(self: object, q: torch.Tensor, *args: object, **kw: object) -> object:
        if kw.get("tier_index") is not None:
            seen.append((int(q.shape[0]), True))
        return decode(self, q, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(core.TritonKernels, "tier_gather", spy_gather)
    monkeypatch.setattr(core.TritonKernels, "decode", spy_decode)
    _simulated_run("triton-by-batch", "rope", "int4-keys-meta8", page=page)
    assert seen == [(1, False), (2, True)]


@pytest.mark.parametrize("fmt", ["meta16", "int4-keys-meta8"])
@pytest.mark.parametrize("key_mean", ["constant", "rope"])
@pytest.mark.parametrize("kernels", [pytest.param("torch", marks=pytest.mark.unit),
                                     pytest.param("triton", marks=pytest.mark.slow),
                                     pytest.param("triton-fused-write", marks=pytest.mark.slow),
                                     pytest.param("triton-fused-gather", marks=pytest.mark.slow),
                                     pytest.param("triton-direct-tiers", marks=pytest.mark.slow)])
def test_simulated_vllm_run_matches_the_reference_cache(kernels: str, key_mean: str, fmt: str) -> None:
    """Two requests, chunked prefill, a mixed batch (a decode + a final chunk + padding tokens), decodes (with the
    torch twin: across a demotion): the INT2 pages hold the reference cache's codes bitwise and every output is
    within fp16 attention error of the reference cache's (the Triton path runs in the interpreter on CPU: 4 steps).
    ``rope``: keys centred by position (a large pre-RoPE mean, as Qwen2.5's ``k_proj`` bias makes): every write
    centres by its position's mean, the decode adds the term, the prefill's history gets the means back; the
    backend computes the means as table rows times ``rope_matrix`` (one GEMM), the reference cache as RoPE then the
    rotation: equal to float32 rounding, which on this data leaves every page byte equal.
    ``int4-keys-meta8``: the layer's keys in INT4 (the low plane in its pages, written by the reference quantizer,
    read by the decode kernel through the block table and by the prefill's torch history) and 8-bit metadata: the
    pages hold the reference cache's high plane, low plane and metadata bytes bitwise. ``triton-fused-write``: the
    Triton path with each step's K, V and tier writes in one launch (the engine's default; ``triton``: three,
    ``OSCAR_VLLM_FUSED_WRITE=0``); ``triton-fused-gather``: that, and the decode's query rotation in the tier
    gather's launch (``OSCAR_VLLM_FUSED_GATHER=1``); ``triton-direct-tiers``: no gather, the decode reading the tiers
    in place and its query rotation in the K/V rotation's launch (``OSCAR_VLLM_DIRECT_TIERS=1``)."""
    _simulated_run(kernels, key_mean, fmt)


@pytest.mark.unit
def test_simulated_vllm_run_with_64_token_pages() -> None:
    """The torch twin's run with ``--block-size 64`` pages and a one-page sink, in the recipes' format (the Triton
    path at 64-token pages: ``test_simulated_vllm_run_switches_tier_reads_by_batch[pages-64]``)."""
    _simulated_run("torch", "rope", "int4-keys-meta8", page=64)


def _simulated_run(kernels: str, key_mean: str, fmt: str, page: int = 16) -> None:
    sink = S0 if page == 16 else page  # (the sink is whole pages)
    g = torch.Generator().manual_seed(3)
    pre = 3.0 * torch.randn(HKV, D, generator=g) if key_mean == "rope" else None
    t = LayerTransform(k_rotation=random_orthogonal(HKV, D, 5), v_rotation=random_orthogonal(1, D, 6),
                       k_mean=0.2 * torch.randn(HKV, D, generator=g), v_mean=0.1 * torch.randn(1, D, generator=g),
                       k_clip=0.92, v_clip=0.9, k_mean_pre=pre)
    if page == 16:
        a = _Request("A", [40, 30], 10, [7, 3, 11, 2, 9, 14], 1, t)
        b = _Request("B", [20, 25], 9, [5, 13, 1, 8], 2, t)
        batches = [[(a, 40, False)], [(a, 30, True), (b, 20, False)], [(a, 1, True), (b, 25, True)],
                   [(a, 1, True), (b, 1, True)]]
    else:  # 64-token pages: the sink one page, prompts long enough for an INT2 history past it
        a = _Request("A", [100, 60], 10, [7, 3, 11], 1, t, sink=page)
        b = _Request("B", [60, 50], 9, [5, 13], 2, t, sink=page)
        batches = [[(a, 100, False)], [(a, 60, True), (b, 60, False)], [(a, 1, True), (b, 50, True)],
                   [(a, 1, True), (b, 1, True)]]
    if pre is not None:  # keys with that mean at their positions (the reference and the backend see the same keys)
        for r in (a, b):
            cos, sin = ref.rope_cos_sin(INV_FREQ, ROPE_SCALING, torch.arange(r.k.shape[0])[None])
            r.k = (r.k.float() + rope_fn(pre[None, :, None, :], cos[:, None], sin[:, None])[0].transpose(0, 1)
                   ).to(ACT)
    int4 = fmt == "int4-keys-meta8"
    md = torch.uint8 if int4 else torch.bfloat16
    s = layout.Int2Settings(sink=sink, recent=W, meta_dtype=md, int4_layers=(0,) if int4 else ())
    kern = TorchKernels() if kernels == "torch" else None
    from oscar_cli.vllm.core import TritonKernels

    meth = oscar_method([t], sink=sink, recent=W)
    meth = replace(meth, key_mean="rope") if pre is not None else meth
    rope = layout.RopeFrequencies(INV_FREQ, ROPE_SCALING, 256) if pre is not None else None
    layer = PagedInt2Layer(layout.layer_tensors(meth, 1, HKV, D)[0], s, 4, HQ, HKV, D,
                           page, ACT, _cpu_simulation(kernels),
                           kernels=kern or TritonKernels(CFG, fused_write=kernels != "triton",  # type: ignore[arg-type]
                                                         fused_gather=kernels in ("triton-fused-gather",
                                                                                  "triton-by-batch"),
                                                         direct_tiers=None if kernels == "triton-by-batch" else
                                                         kernels == "triton-direct-tiers"),
                           rope=rope,
                           key_bits=s.key_bits(0))
    kv = torch.zeros(16, page, HKV, spec.slot_bytes(D, s.meta_bytes, s.key_bits(0)), dtype=torch.uint8)
    for r in (a, b):  # the reference cache: the same format
        r.set_format(md, int4)
    rows, state = layout.SequenceRows(4), torch.zeros(5, 2, dtype=torch.int32)
    if kernels == "torch":  # B's recent tier reaches W + 8 at its 8th decode, A's at its 8th
        batches += [[(a, 1, True), (b, 1, True)]] * 8
    worst = 0.0
    for i, batch in enumerate(batches):
        got, want, kp, vp = _step(layer, kv, rows, state, batch, pad=3 if i == 2 else 0)
        assert torch.isfinite(got).all()
        worst = max(worst, (got - want).abs().max().item())
    assert worst < 5e-3, worst
    for r in (a, b):  # INT2 pages == reference history, bitwise (positions sink .. sink + n_hist)
        n_hist = r.ref.tier_sizes()[1]
        assert n_hist > 0, r.name
        pos = torch.arange(sink, sink + n_hist)
        blocks = torch.tensor(r.blocks)[pos // page]
        hk, hv = r.ref.history("k"), r.ref.history("v")
        assert hk is not None and hv is not None
        assert torch.equal(kp.packed[blocks, :, pos % page], hk[0][0].transpose(0, 1))
        assert torch.equal(kp.scale[blocks, :, pos % page], hk[1][0].transpose(0, 1))
        assert torch.equal(kp.zero[blocks, :, pos % page], hk[2][0].transpose(0, 1)) and kp.scale.dtype == md
        if int4:  # the low plane: the reference's, slot n of its history at the page of position S0 + n
            low = layout.carve_low_plane(kv, D, md)
            assert r.ref.k_lo is not None
            assert torch.equal(low[blocks, :, pos % page], r.ref.k_lo[0, :, :n_hist].transpose(0, 1))
        vcodes = torch.stack([ref.unpack_token_quads(vp.packed[pg], page, D)[:, o] for pg, o in
                              zip(blocks, pos % page, strict=True)], 1)
        assert torch.equal(vcodes, ref.unpack_int2(hv[0][0]))


@pytest.mark.unit
def test_history_dequantizes_the_same_in_pieces() -> None:
    """The prefill's transient history (float32 only per piece) does not depend on the piece size."""
    s = layout.Int2Settings(sink=S0, recent=W)
    t = LayerTransform(k_rotation=random_orthogonal(1, D, 1), v_rotation=random_orthogonal(1, D, 2),
                       k_mean=0.1 * torch.ones(HKV, D), v_mean=-0.1 * torch.ones(HKV, D), k_clip=0.9, v_clip=0.9)
    layer = PagedInt2Layer(layout.layer_tensors(oscar_method([t], sink=S0, recent=W), 1, HKV, D)[0], s, 2, HQ, HKV,
                           D, P, ACT, "cpu", kernels=TorchKernels())  # type: ignore[arg-type]
    kv = torch.zeros(12, P, HKV, spec.slot_bytes(D), dtype=torch.uint8)
    kp, vp = layout.carve_pages(kv, D)
    blocks = torch.tensor([4, 9, 2, 7, 1, 11, 3], dtype=torch.int32)
    slots = torch.tensor([int(blocks[p // P]) * P + p % P for p in range(100)])
    x = torch.randn(100, HKV, D).to(ACT)
    layer.kernels.quantize_write(x, kp, slots, t.k_mean, 0.9, "rows")
    layer.kernels.quantize_write(x, vp, slots, t.v_mean, 0.9, "token_quads")
    outs = []
    for piece in (16, 48, 4096):
        k, v = torch.empty(100 - S0, HKV, D, dtype=ACT), torch.empty(100 - S0, HKV, D, dtype=ACT)
        layer.history(kp, vp, blocks, S0, k, v, piece=piece)
        outs.append((k, v))
    for k, v in outs[:-1]:
        assert torch.equal(k, outs[-1][0]) and torch.equal(v, outs[-1][1])
    want = ref.fake_quantize_rows(x[S0:].transpose(0, 1), None, t.k_mean, 0.9) + t.k_mean[:, None]
    assert torch.allclose(outs[-1][0].transpose(0, 1).float(), want, atol=1e-2)


@pytest.mark.unit
def test_runs_oscar_reads_the_engine_arguments() -> None:
    from oscar_cli.vllm.plugin import runs_oscar

    art = {"oscar_artifact": "hf://org/x@v1"}
    assert runs_oscar(SimpleNamespace(attention_backend="CUSTOM", additional_config=art))
    assert runs_oscar(SimpleNamespace(attention_backend=SimpleNamespace(name="CUSTOM"), additional_config=art))
    assert not runs_oscar(SimpleNamespace(attention_backend="CUSTOM", additional_config={}))
    assert not runs_oscar(SimpleNamespace(attention_backend=None, additional_config=art))
    assert not runs_oscar(SimpleNamespace())


@pytest.mark.unit
@pytest.mark.parametrize(("backend", "given", "expected"), [("CUSTOM", None, False), ("CUSTOM", True, True),
                                                            ("CUSTOM", False, False), ("FLASH_ATTN", None, None)])
def test_prefix_caching_defaults_to_off_only_for_the_int2_backend(backend: str, given: bool | None,
                                                                  expected: bool | None) -> None:
    from oscar_cli.vllm.plugin import with_prefix_caching_off

    seen = {}

    def create_engine_config(self: SimpleNamespace) -> str:
        seen["prefix"] = self.enable_prefix_caching
        return "config"

    args = SimpleNamespace(attention_backend=backend, additional_config={"oscar_artifact": "x"},
                           enable_prefix_caching=given)
    assert with_prefix_caching_off(create_engine_config)(args) == "config"
    assert seen["prefix"] is expected


@pytest.mark.unit
@pytest.mark.parametrize("decode_only", [True, False], ids=["decode-only", "mixed"])
def test_layer_write_keeps_the_other_tokens_bits(decode_only: bool) -> None:
    """``PagedInt2Layer.write`` through the Triton kernels (interpreter on CPU) over pages of stale bytes: a
    decode-only step (its V write without atomics: ``exclusive_words``) and a mixed step (decode + a prefill chunk
    whose tokens share token-quad words: the atomic path) leave the pages as the torch twin's read-modify-write,
    every other token's bits kept; the padding row (slot -1) writes nothing."""
    from oscar_cli.vllm.core import TritonKernels
    from oscar_cli.vllm.core import decode_only as is_decode_only

    g = torch.Generator().manual_seed(11)
    t = layout.LayerTensors(torch.eye(D), torch.eye(D), 0.2 * torch.randn(HKV, D, generator=g),
                            0.1 * torch.randn(HKV, D, generator=g), 0.92, 0.9)
    s = layout.Int2Settings(sink=S0, recent=W)
    layer = PagedInt2Layer(t, s, 4, HQ, HKV, D, P, ACT, _cpu_simulation("triton"),
                           kernels=TritonKernels(CFG))  # type: ignore[arg-type]
    # (tokens this step, length after it, blocks): three decodes in the middle of their pages, or a decode and a
    # 6-token chunk (positions 18 .. 23 of page 5: two words' worth of quads)
    reqs = [(1, 30, [2, 7]), (1, 22, [4, 1]), (1, 45, [3, 6, 0])] if decode_only else [(1, 30, [2, 7]), (6, 24, [4, 5])]
    qsl, seq, slots, table = [0], [], [], []
    for n, length, blocks in reqs:
        qsl.append(qsl[-1] + n)
        seq.append(length)
        slots += [blocks[p // P] * P + p % P for p in range(length - n, length)]
        table.append(blocks + [0] * (3 - len(blocks)))
    n_tok = qsl[-1] + 1  # one padding token
    st = build_step(torch.tensor(qsl, dtype=torch.int32), qsl, torch.tensor(seq, dtype=torch.int32), seq,
                    torch.tensor(table, dtype=torch.int32), torch.tensor(slots + [-1], dtype=torch.int64), n_tok,
                    list(range(len(reqs))), torch.zeros(5, 2, dtype=torch.int32), s)
    assert is_decode_only(st) is decode_only
    kv = torch.randint(0, 256, (8, P, HKV, spec.slot_bytes(D)), generator=g, dtype=torch.uint8)
    kv_twin = kv.clone()
    kr, vr = (torch.randn(n_tok, HKV, D, generator=g).to(ACT) for _ in range(2))
    layer.write(kr, vr, *layout.carve_pages(kv, D), st)
    kp, vp = layout.carve_pages(kv_twin, D)
    TorchKernels().quantize_write(kr, kp, st.slot_mapping, t.k_mean, t.k_clip, "rows")
    TorchKernels().quantize_write(vr, vp, st.slot_mapping, t.v_mean, t.v_clip, "token_quads")
    assert torch.equal(kv, kv_twin), f"{int((kv != kv_twin).sum())} bytes differ"
