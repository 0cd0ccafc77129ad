"""The three-line library API: ``oscar_cli.kv_cache(model, artifact)`` + ``model.generate(past_key_values=...)``."""

from __future__ import annotations

import pytest
import torch
from helpers.fakehub.artifacts import make_artifact
from helpers.tiny import tiny_causal_lm

import oscar_cli
from oscar_cli.errors import OscarError
from oscar_cli.quant import greedy_generate, left_pad
from oscar_cli.quant.generation import cache_kwarg

pytestmark = pytest.mark.unit

EOS = 2
KW = cache_kwarg(tiny_causal_lm())  # ``cache`` from transformers 5.24 (``past_key_values`` before)


def batch(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]
    return left_pad(rows, 0, torch.device("cpu"))


def until_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS)] if EOS in tokens else tokens


@pytest.mark.parametrize(
    "lengths", [[37], [70, 52, 41], [40, 23, 5, 1]], ids=["single", "ragged-batch", "ragged-batch-all-sink"]
)
def test_generate_greedy_equals_the_greedy_generate_path(tmp_path, lengths: list[int]) -> None:
    """``model.generate`` on ``kv_cache`` gives the tokens of the serving path (chunked prefill API), with INT2
    history in play (small BF16 windows), for a left-padded batch of different lengths."""
    model = tiny_causal_lm(seed=1)
    art = str(make_artifact(tmp_path))
    ids, mask = batch(lengths)
    cache = oscar_cli.kv_cache(model, art, windows=(8, 16))
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=EOS,
                         pad_token_id=0, **{cache_kwarg(model): cache})
    if min(lengths) > 1:  # a row of one token puts the whole batch in the (padding-widened) BF16 sink
        assert cache.oscar_layers[0].tier_sizes()[1] > 0  # INT2 history in play
    session = oscar_cli.attach(model, art, windows=(8, 16))  # the same method: the same session
    assert session.active is cache
    ref = greedy_generate(model, session.new_cache(), ids, mask, 20, [EOS])
    assert [until_eos(r) for r in out[:, ids.shape[1]:].tolist()] == ref
    oscar_cli.detach(model)


def test_sampling_with_a_seed_through_the_cache_equals_the_plain_model() -> None:
    """Sampling works through the cache: with the bf16 method it is the plain model, draw for draw."""
    model = tiny_causal_lm(seed=2)
    ids, mask = batch([30, 12], seed=3)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=True, temperature=0.8, top_p=0.9,
              pad_token_id=0, eos_token_id=None)
    torch.manual_seed(0)
    plain = model.generate(**kw)
    torch.manual_seed(0)
    ours = model.generate(**kw, **{KW: oscar_cli.kv_cache(model, method="bf16")})
    assert torch.equal(plain, ours)
    oscar_cli.detach(model)
    torch.manual_seed(5)
    a = model.generate(**kw, **{KW: oscar_cli.kv_cache(model, method="quarot-int2")})
    torch.manual_seed(5)
    b = model.generate(**kw, **{KW: oscar_cli.kv_cache(model, method="quarot-int2")})
    assert torch.equal(a, b) and a.shape == (2, 30 + 16)
    oscar_cli.detach(model)


def test_kv_cache_modifies_the_model_in_place_and_detach_restores_it(tmp_path) -> None:
    model = tiny_causal_lm(seed=4)
    w = model.model.layers[0].self_attn.v_proj.weight.clone()
    impl = model.config._attn_implementation
    oscar_cli.kv_cache(model, str(make_artifact(tmp_path)))
    assert not torch.equal(model.model.layers[0].self_attn.v_proj.weight, w)  # R_V folded
    assert model.config._attn_implementation == "oscar_int2"
    oscar_cli.kv_cache(model, method="naive-int2")  # another method: the first one is detached first
    assert torch.equal(model.model.layers[0].self_attn.v_proj.weight, w)
    oscar_cli.detach(model)
    assert model.config._attn_implementation == impl and not hasattr(model, "_oscar_session")
    oscar_cli.detach(model)  # no-op


def test_bad_input_is_one_line_naming_the_limit(tmp_path) -> None:
    model = tiny_causal_lm(seed=5, max_positions=64)
    ids, mask = batch([50])
    cache = oscar_cli.kv_cache(model, method="naive-int2")
    with pytest.raises(OscarError, match="beyond the model's 64 positions"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
                       **{KW: cache})
    right = torch.ones(2, 10, dtype=torch.long)
    right[1, 7:] = 0
    with pytest.raises(OscarError, match="left-padded"):
        model.generate(input_ids=torch.full((2, 10), 5), attention_mask=right,
                       max_new_tokens=2, pad_token_id=0, **{KW: oscar_cli.kv_cache(model, method="naive-int2")})
    with pytest.raises(OscarError, match="backend triton: .*bfloat16/float16"):
        cache = oscar_cli.kv_cache(model, method="naive-int2", backend="triton")
        model.generate(input_ids=ids[:, :10], max_new_tokens=2, pad_token_id=0, **{KW: cache})
    oscar_cli.detach(model)
    other = tiny_causal_lm(seed=5, layers=3)
    with pytest.raises(OscarError, match="another model"):
        oscar_cli.kv_cache(other, str(make_artifact(tmp_path)))


def test_generate_on_the_triton_path_matches_the_reference_path() -> None:
    """``model.generate`` with the kernels (paged decode; on CPU the Triton interpreter) on a left-padded batch:
    the same next-token scores as the reference path within the kernel error budget, and the kernel really ran."""
    import os

    from helpers.calib import random_transform

    from oscar_cli.quant import attach, oscar_method

    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs CUDA or the Triton interpreter")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_causal_lm(seed=6, dtype=torch.float16, head_dim=64, layers=1).to(dev)
    meth = oscar_method([random_transform(9, 1, clip=0.0, d=64)], sink=8, recent=16)
    ids, mask = batch([44, 33], seed=7)
    scores = {}
    for backend in ("reference", "triton"):
        session = attach(model, meth, backend=backend)
        cache = session.new_cache()
        out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=4, do_sample=False,
                             pad_token_id=0, eos_token_id=None, output_scores=True, return_dict_in_generate=True,
                             **{KW: cache})
        assert cache.path == backend and cache.oscar_layers[0].tier_sizes()[1] > 0
        scores[backend] = torch.stack(out.scores, 1).float()
        session.close()
    ref, fast = scores["reference"], scores["triton"]
    assert (ref - fast).abs().max().item() < 2e-2 * max(1.0, ref.abs().max().item())


def test_beam_search_reorders_the_pages() -> None:
    """Beam search reorders the cache every step (rows copied, a row may be picked twice): with the bf16 method
    it is the plain model's beam search; an INT2 method with history in play runs it to the end."""
    model = tiny_causal_lm(seed=8)
    ids, mask = batch([50, 41], seed=9)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, num_beams=3, do_sample=False, pad_token_id=0,
              eos_token_id=None)
    plain = model.generate(**kw)
    assert torch.equal(model.generate(**kw, **{KW: oscar_cli.kv_cache(model, method="bf16")}), plain)
    cache = oscar_cli.kv_cache(model, method="naive-int2")
    out = model.generate(**kw, **{KW: cache})
    assert out.shape == plain.shape and cache.oscar_layers[0].pool.batch == 6
    oscar_cli.detach(model)
