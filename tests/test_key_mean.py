"""The position-dependent key mean (recipe ``quant.key_mean: rope``): INT2 keys centred by ``RoPE_p(m_pre)·R_K``
through calibration, the artifact and the cache (oscar_cli.quant.key_mean)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers.calib import RESOLVED, check_tampered_tensor, random_transform, tiny_recipe
from helpers.layers import decode_logits, feed, kernel_model_and_method
from helpers.tiny import tiny_causal_lm

from oscar_cli.artifact import open_artifact
from oscar_cli.calibration.run import calibrate_model
from oscar_cli.errors import OscarError
from oscar_cli.quant import oscar_method
from oscar_cli.quant.cache import Int2Cache
from oscar_cli.quant.generation import cache_kwarg
from oscar_cli.quant.int2_layer import Int2Layer
from oscar_cli.quant.key_mean import RopeTable, position_means, pre_rope_mean, rope, unrope
from oscar_cli.quant.methods import oscar_from_artifact
from oscar_cli.quant.runtime import use_method
from oscar_cli.recipe import Recipe, recipe_from_dict
from oscar_cli.vllm.layout import Int2Settings, check_geometry
from oscar_kernels.reference import dequantize_rows, quantize_rows

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(("d", "scaling"), [(16, None), (64, None), (16, "yarn")])
def test_unrope_inverts_the_models_rope(family: str, d: int, scaling: str | None) -> None:
    """Keys made with the model's own cos/sin (YaRN's attention scaling included) come back pre-RoPE."""
    from oscar_cli.model.rope import apply_yarn

    model = tiny_causal_lm(family, head_dim=d, max_positions=256)
    if scaling:
        apply_yarn(model, 4.0)  # cos² + sin² = mscale² ≠ 1
    table = RopeTable(model)
    pos = torch.tensor([[0, 1, 7, 200, 900]])
    cos, sin = table(pos)
    if scaling:
        assert not torch.allclose(cos.square() + sin.square(), torch.ones_like(cos))
    u = torch.randn(1, 2, 5, d, generator=torch.Generator().manual_seed(1))
    k = rope(u, cos[:, None], sin[:, None])
    assert torch.allclose(unrope(k, cos[:, None], sin[:, None]), u, atol=1e-5)
    assert torch.allclose(pre_rope_mean(k, cos, sin), u.double().sum(dim=(0, 2)), atol=1e-4)
    # the model's own key path: rotary_emb + apply_rotary_pos_emb give the same keys as rope()
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    assert torch.allclose(apply_rotary_pos_emb(u, u, cos, sin)[1], k, atol=1e-6)


def test_position_means_rotate_the_roped_mean() -> None:
    model = tiny_causal_lm()
    cos, sin = RopeTable(model)(torch.arange(10)[None])
    m = torch.randn(2, 16)
    r = random_transform(4, n=2).k_rotation
    mu = position_means(m, r, cos, sin)
    assert mu.shape == (1, 2, 10, 16)
    want = torch.einsum("bhnd,hde->bhne", rope(m[None, :, None], cos[:, None], sin[:, None]), r)
    assert torch.allclose(mu, want, atol=1e-6)
    assert torch.allclose(position_means(m, None, cos, sin), rope(m[None, :, None], cos[:, None], sin[:, None]))


def _rope_layer(m_pre: torch.Tensor, table: RopeTable, mean: str, sink: int = 8, recent: int = 16,
                k_mean: torch.Tensor | None = None) -> Int2Layer:
    t = random_transform(11, d=16)
    t = replace(t, k_mean=t.k_mean if k_mean is None else k_mean, k_mean_pre=m_pre)
    meth = replace(oscar_method([t], sink=sink, recent=recent), key_mean=mean)
    return Int2Layer(meth, meth.layer(0), rope_table=table)


@pytest.mark.parametrize("pads", [[0], [0, 5], [3, 0]], ids=["one-row", "pad-second", "pad-first"])
@pytest.mark.parametrize("chunks", [[100], [40, 60], [33, 7, 60]], ids=["one-chunk", "two-chunks", "ragged"])
def test_cache_centres_each_int2_key_by_the_mean_at_its_position(pads: list[int], chunks: list[int]) -> None:
    """Chunked prefill + decode, left padding: every INT2 key slot is served as
    ``dequant(quant(k·R - μ_p)) + μ_p`` with ``μ_p = RoPE_p(m_pre)·R`` at ``p = slot - pad``; BF16 tiers as is."""
    model = tiny_causal_lm()
    table = RopeTable(model)
    m_pre = torch.randn(2, 16, generator=torch.Generator().manual_seed(2)) * 5
    layer = _rope_layer(m_pre, table, "rope")
    layer.pads, layer.sink_slots = pads, layer.method.sink + max(pads)
    b = len(pads)
    g = torch.Generator().manual_seed(13)
    k = torch.randn(b, 2, 120, 16, generator=g) * 2
    v = torch.randn(b, 2, 120, 16, generator=g)
    served = feed(layer, k, v, chunks, 20)[-1][0]  # the last decode step: slots [0, 120) stored, then the new token
    t = layer.transform
    kr = k @ t.k_rotation[0]
    pos = (torch.arange(120)[None] - torch.tensor(pads)[:, None]).clamp(min=0)
    mu = position_means(m_pre, t.k_rotation, *table(pos))
    s, hist, _ = layer.tier_sizes()
    deq = dequantize_rows(quantize_rows(kr, None, mu, t.k_clip, None, torch.bfloat16)) + mu
    for row, pad in enumerate(pads):
        real = slice(max(s, pad), s + hist)  # pad slots hold no INT2 row
        assert torch.allclose(served[row, :, real], deq[row, :, real], atol=1e-5)
    assert torch.allclose(served[..., :s, :], kr[..., :s, :], atol=1e-6)  # the sink as is (rotated per update)
    assert torch.allclose(served[..., s + hist : 120, :], kr[..., s + hist :, :], atol=1e-6)  # recent as is


def test_rope_mean_removes_the_drift_beyond_the_calibrated_positions() -> None:
    """Keys with a large pre-RoPE mean: centred by the constant mean of the first 256 positions their INT2
    error grows far beyond them; centred by position it stays at the noise's level."""
    model = tiny_causal_lm(max_positions=4096)
    table = RopeTable(model)
    g = torch.Generator().manual_seed(3)
    m_pre = torch.randn(2, 16, generator=g) * 8
    n = 3000
    cos, sin = table(torch.arange(n)[None])
    k = rope(m_pre[None, :, None] + torch.randn(1, 2, n, 16, generator=g), cos[:, None], sin[:, None])
    rot = random_transform(11, d=16).k_rotation
    const = position_means(m_pre, rot, cos[:, :256], sin[:, :256]).mean(2)[0]  # [H, D]: what a 256-token fit sees
    errs = {}
    for mean in ("constant", "rope"):
        layer = _rope_layer(m_pre, table, mean, k_mean=const)
        served = feed(layer, k, k, [n - 1], 1)[-1][0]
        kr = k @ rot[0]
        far = slice(2000, 2900)
        errs[mean] = float((served[..., far, :] - kr[..., far, :]).square().mean())
    assert errs["rope"] < 0.25 * errs["constant"], errs


def test_rope_mean_needs_its_tensors_and_the_models_rope() -> None:
    t = random_transform(11, d=16)
    meth = replace(oscar_method([t], sink=8, recent=16), key_mean="rope")
    with pytest.raises(OscarError, match="needs the layer's k_mean_pre"):
        Int2Layer(meth, meth.layer(0))
    meth = replace(oscar_method([replace(t, k_mean_pre=torch.zeros(2, 16))], sink=8, recent=16), key_mean="rope")
    x = torch.randn(1, 2, 40, 16)
    with pytest.raises(OscarError, match="no RoPE table"):
        Int2Cache(meth, 1).update(x, x, 0)


def _reference_and_triton(model: object, meth: object, device: str, pad: int, length: int) -> tuple:
    """Logits of 3 decode steps after a prefill of ``length`` tokens on the reference and the Triton path, and the
    two caches."""
    caches: list = []
    ref = decode_logits(model, meth, "reference", device, 3, caches, pad=pad, length=length)
    fast = decode_logits(model, meth, "triton", device, 3, caches, pad=pad, length=length)
    assert caches[1].oscar_layers[0].path == "triton"
    return ref, fast, caches


@pytest.mark.parametrize("pad", [0, 5], ids=["no-pad", "left-pad"])
def test_triton_decode_with_a_rope_mean_matches_the_reference_path(pad: int) -> None:
    """The Triton path (CPU: TRITON_INTERPRET=1, fp16) with keys centred by position: INT2 rows written with the
    per-row means bitwise as the reference path writes them, and decode through the kernel's logit term gives the
    reference path's logits."""
    if torch.cuda.is_available():
        pytest.skip("the CPU interpreter case (the gpu marker covers CUDA)")
    model, meth = kernel_model_and_method(key_mean_pre=3.0)
    ref, fast, caches = _reference_and_triton(model, meth, "cpu", pad, 90)
    for which in ("k", "v"):
        a, b = caches[0].oscar_layers[0].history(which), caches[1].oscar_layers[0].history(which)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), which
    assert (ref - fast).abs().max().item() < 2e-3 * max(1.0, ref.abs().max().item())
    # the term matters: without it the logits differ by far more than the Triton path from the reference (the
    # reference path stands in for a second interpreted Triton run, 23 s)
    const = decode_logits(model, replace(meth, key_mean="constant"), "reference", "cpu", 3, pad=pad, length=90)
    assert (const - ref).abs().max().item() > 1e-2 > 5 * (ref - fast).abs().max().item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
@pytest.mark.parametrize("pad", [0, 5], ids=["no-pad", "left-pad"])
def test_triton_decode_with_a_rope_mean_on_cuda(pad: int) -> None:
    """The same check on CUDA: the logits within the same budget; the INT2 codes agree but where the GPU's own
    float32 rotation order moves a value across a rounding boundary (at most 1 %)."""
    model, meth = kernel_model_and_method(key_mean_pre=3.0)
    ref, fast, caches = _reference_and_triton(model.cuda(), meth, "cuda", pad, 300)
    from oscar_kernels.reference import unpack_int2

    for which in ("k", "v"):
        a, b = caches[0].oscar_layers[0].history(which), caches[1].oscar_layers[0].history(which)
        assert float((unpack_int2(a[0].cpu()) != unpack_int2(b[0].cpu())).float().mean()) < 0.01, which
    assert (ref - fast).abs().max().item() < 2e-3 * max(1.0, ref.abs().max().item())


def test_vllm_serves_a_rope_mean_and_refuses_other_means() -> None:
    """The vLLM backend serves keys centred by position (tests/test_vllm_logic.py runs it against the reference
    cache); a key mean it does not know is one line at engine start."""
    settings = Int2Settings(sink=64, recent=256, meta_dtype=torch.bfloat16)
    check_geometry(head_dim=128, block_size=16, settings=settings, group_size=None, key_mean="rope")
    with pytest.raises(OscarError, match=r"key mean 'learned'"):
        check_geometry(head_dim=128, block_size=16, settings=settings, group_size=None, key_mean="learned")


def test_recipe_knob_left_out_while_constant() -> None:
    assert "key_mean" not in Recipe().to_dict()["quant"]
    r = recipe_from_dict({"quant": {"key_mean": "rope"}})
    assert r.to_dict()["quant"]["key_mean"] == "rope"
    with pytest.raises(Exception, match="key_mean"):
        recipe_from_dict({"quant": {"key_mean": "linear"}})


def _calibrated(tmp_path: Path, mean: str, name: str, family: str = "qwen2"):  # type: ignore[no-untyped-def]
    model = tiny_causal_lm(family)
    recipe = tiny_recipe(quant={"key_mean": mean})
    res = calibrate_model(model, None, recipe, reference="t", resolved=RESOLVED, out=tmp_path / name)
    return model, res


def test_calibrate_estimates_the_pre_rope_mean_and_the_artifact_serves_it(tmp_path: Path) -> None:
    """Qwen2 (k_proj bias): the artifact's k_mean_pre is the mean of k_proj's outputs over the statistics
    sequences; the method loads with key_mean rope and a model generates through it."""
    model, res = _calibrated(tmp_path, "rope", "rope")
    assert res.manifest.quant["key_mean"] == "rope"
    art = open_artifact(res.artifact_path, expect_architecture=res.manifest.architecture)
    seen: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    hooks = [model.model.layers[i].self_attn.k_proj.register_forward_hook(
        lambda mod, args, out, i=i: seen[i].append(out.detach())) for i in (0, 1)]
    from oscar_cli.calibration.data import prepare_data

    recipe = tiny_recipe(quant={"key_mean": "rope"})
    data = prepare_data(recipe.data.source, recipe.data, model=model, tokenizer=None, device=torch.device("cpu"),
                        n_seq=recipe.data.tokens // recipe.data.seq_len)
    n_stats = data.sequences.shape[0] - 1  # one held-out sequence of 256 tokens
    with torch.no_grad():
        model.model(input_ids=data.sequences[:n_stats], use_cache=False)
    for h in hooks:
        h.remove()
    for i in (0, 1):
        want = seen[i][0].reshape(-1, 2, 16).double().mean(0).float()
        got = art.layers[i].k_mean_pre
        assert got is not None and torch.allclose(got, want, atol=1e-4)
    meth = oscar_from_artifact(str(res.artifact_path), model.config)
    assert meth.key_mean == "rope"
    ids = torch.randint(0, 128, (1, 90), generator=torch.Generator().manual_seed(2))
    with use_method(model, meth, backend="reference") as session:
        cache = session.new_cache()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                       **{cache_kwarg(model): cache})
        assert cache.oscar_layers[0].tier_sizes()[1] > 0  # INT2 history was written (and centred by position)
    _, plain = _calibrated(tmp_path, "constant", "plain")
    assert "key_mean" not in plain.manifest.quant
    assert all(layer.k_mean_pre is None for layer in open_artifact(plain.artifact_path).layers)


def test_artifact_without_its_pre_rope_means_is_refused(tmp_path: Path) -> None:
    _, res = _calibrated(tmp_path, "rope", "rope", family="llama")
    check_tampered_tensor(res.artifact_path, "k_mean_pre", lambda x: x * float("nan"), r"layers.0.k_mean_pre holds NaN")


def test_clip_problem_adds_a_per_position_mean_back_into_the_logits() -> None:
    """A constant mean cancels in the softmax, a per-position one does not: the clip search's exact attention
    with keys centred by position is the uncentred attention."""
    from oscar_cli.calibration.clipping import LayerClipProblem

    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(1, 4, 8, 16, generator=g), torch.randn(1, 2, 64, 16, generator=g) * 3, torch.randn(1, 2, 64, 16, generator=g)
    t = random_transform(5, d=16)
    mu = torch.randn(1, 2, 64, 16, generator=g) * 4

    def problem(k_mean: torch.Tensor | None) -> LayerClipProblem:
        return LayerClipProblem(q, k, v, t.k_rotation, t.v_rotation, k_mean, None, 0.25, 8, 8, None, "bfloat16")

    plain, by_pos = problem(None), problem(mu)
    assert torch.allclose(by_pos.logits, plain.logits, atol=1e-4)
    assert torch.allclose(by_pos.out, plain.out, atol=1e-5)
    # keys that sit around a per-position mean: centred by it, their INT2 error is far smaller
    kr = mu @ t.k_rotation[0].T + torch.randn(1, 2, 64, 16, generator=g) * 0.3
    near_plain, near_pos = LayerClipProblem(q, kr, v, t.k_rotation, t.v_rotation, None, None, 0.25, 8, 8, None,
                                            "bfloat16"), LayerClipProblem(q, kr, v, t.k_rotation, t.v_rotation, mu,
                                                                          None, 0.25, 8, 8, None, "bfloat16")
    assert near_pos.key_error(0.9) < 0.2 * near_plain.key_error(0.9)
