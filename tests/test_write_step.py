"""``ops.write_step``: a decode step's key pages, value pages and BF16 tiers in one launch, byte for byte what
``quantize_write`` (K, V) and ``tier_write`` write as three launches, over the backend's variants (2- and 4-bit
keys, 16- and 8-bit metadata, a key mean per head or per row, token-quad updates with or without atomics, padding
rows). CPU runs use the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from oscar_kernels import ops
from oscar_kernels.reference import QuantizedRows

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
H, D, PAGE = 2, 64, 16

CASES = [
    # id, N, INT4 keys, metadata dtype, key mean per row, exclusive token-quad words, decode-shaped slots
    ("n1-int2-bf16", 1, False, torch.bfloat16, False, True, True),
    ("n5-int2-meta8-rowmean", 5, False, torch.uint8, True, True, True),
    ("n5-int4-meta8-rowmean", 5, True, torch.uint8, True, True, True),
    ("n3-int4-bf16-atomics", 3, True, torch.bfloat16, False, False, True),
    ("n19-int2-bf16-prefill", 19, False, torch.bfloat16, True, False, False),
    ("n19-int4-meta8-prefill", 19, True, torch.uint8, False, False, False),
]


def _state(n: int, int4: bool, meta: torch.dtype, row_mean: bool, decode: bool, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    pages = max(n + 2, 4)
    if decode:  # one token per sequence, each on its own page (what exclusive words need)
        slots = torch.randperm(pages, generator=gen)[:n] * PAGE + torch.randint(0, PAGE, (n,), generator=gen)
    else:  # a prefill chunk: distinct slots sharing pages and token-quad words
        slots = torch.randperm(pages * PAGE, generator=gen)[:n]
    if n > 2:
        slots[n // 2] = -1  # a padding row: no page write
    rows, sink, ring = n + 1, 4, 8
    kc = ops.new_paged_cache(pages, H, PAGE, D, None, meta, DEV)
    vc = ops.new_paged_cache(pages, H, PAGE, D, None, meta, DEV, layout="token_quads")
    for c in (kc, vc):  # stale bytes everywhere: what is not written must stay
        c.packed.copy_(torch.randint(0, 256, c.packed.shape, generator=gen, dtype=torch.uint8))
        for t in (c.scale, c.zero):
            t.copy_(torch.randint(0, 200, t.shape, generator=gen).to(meta) if meta == torch.uint8 else
                    torch.randn(t.shape, generator=gen).to(meta))
    tiers = [torch.randn(rows, H, size, D, generator=gen).to(torch.float16) for size in (sink, sink, ring, ring)]
    perm = torch.randperm(rows * sink, generator=gen)[:n]  # distinct destinations per token
    permr = torch.randperm(rows * ring, generator=gen)[:n]
    return {
        "k": (torch.randn(n, H, D, generator=gen) * 2).to(torch.float16),
        "v": torch.randn(n, H, D, generator=gen).to(torch.float16),
        "k_cache": kc, "v_cache": vc,
        "k_low": torch.randint(0, 256, kc.packed.shape, generator=gen, dtype=torch.uint8) if int4 else None,
        "slots": slots.to(torch.int64),
        "tiers": tiers,
        "idx": (perm // sink, perm % sink, permr // ring, permr % ring),
        "k_mean": torch.randn(*((n,) if row_mean else ()), H, D, generator=gen) * 0.3,
        "v_mean": torch.randn(H, D, generator=gen) * 0.1,
    }


def _to(s: dict) -> dict:
    """A copy of a state on the test device (caches, tiers and index tuples included)."""
    def mv(x: object) -> object:
        if isinstance(x, torch.Tensor):
            return x.clone().to(DEV)
        if isinstance(x, QuantizedRows):
            return QuantizedRows(x.packed.clone().to(DEV), x.scale.clone().to(DEV), x.zero.clone().to(DEV))
        if isinstance(x, (list, tuple)):
            return type(x)(mv(t) for t in x)
        return x

    return {k: mv(v) for k, v in s.items()}


@pytest.mark.unit
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_write_step_equals_the_three_launches(case: tuple) -> None:
    name, n, int4, meta, row_mean, exclusive, decode = case
    base = _state(n, int4, meta, row_mean, decode, len(name) + n)
    a, b = _to(base), _to(base)
    k_clip = 0.0 if int4 else 0.92
    ops.quantize_write(a["k"], a["k_cache"], a["slots"], mean=a["k_mean"], clip_ratio=k_clip, layout="rows",
                       low_plane=a["k_low"])
    ops.quantize_write(a["v"], a["v_cache"], a["slots"], mean=a["v_mean"], clip_ratio=0.9, layout="token_quads",
                       exclusive_words=exclusive)
    ops.tier_write(a["k"], a["v"], *a["tiers"], *a["idx"])
    ops.write_step(b["k"], b["v"], b["k_cache"], b["v_cache"], b["slots"], tuple(b["tiers"]), *b["idx"],
                   k_mean=b["k_mean"], v_mean=b["v_mean"], k_clip=k_clip, v_clip=0.9, exclusive_words=exclusive,
                   k_low=b["k_low"], pdl=decode)  # (the PDL trigger of OSCAR_VLLM_DIRECT_TIERS: CUDA only)
    pairs = [("k_cache." + f, getattr(a["k_cache"], f), getattr(b["k_cache"], f)) for f in ("packed", "scale", "zero")]
    pairs += [("v_cache." + f, getattr(a["v_cache"], f), getattr(b["v_cache"], f)) for f in ("packed", "scale", "zero")]
    pairs += [(f"tier {i}", x, y) for i, (x, y) in enumerate(zip(a["tiers"], b["tiers"], strict=True))]
    if int4:
        pairs.append(("k_low", a["k_low"], b["k_low"]))
    for what, x, y in pairs:
        same = x.cpu().view(torch.uint8) == y.cpu().view(torch.uint8)
        assert bool(same.all()), f"{what}: {int((~same).sum())} bytes differ"
    assert not torch.equal(a["v_cache"].packed.cpu(), base["v_cache"].packed.cpu()), "nothing was written"


@pytest.mark.unit
def test_write_step_refusals_name_the_argument() -> None:
    s = _to(_state(3, False, torch.bfloat16, False, True, 7))
    tiers = tuple(s["tiers"])
    other = ops.new_paged_cache(8, H, 32, D, None, torch.bfloat16, DEV, layout="token_quads")
    with pytest.raises(ValueError, match="one page size serves both"):
        ops.write_step(s["k"], s["v"], s["k_cache"], other, s["slots"], tiers, *s["idx"])
    with pytest.raises(ValueError, match="sink_row"):
        ops.write_step(s["k"], s["v"], s["k_cache"], s["v_cache"], s["slots"], tiers, s["idx"][0][:2], *s["idx"][1:])
    with pytest.raises(ValueError, match="low_plane"):
        ops.write_step(s["k"], s["v"], s["k_cache"], s["v_cache"], s["slots"], tiers, *s["idx"], k_clip=0.9,
                       k_low=torch.zeros_like(s["k_cache"].packed))


@pytest.mark.unit
@pytest.mark.parametrize(("which", "raw", "want"), [
    ("fused_write", None, True), ("fused_write", "1", True), ("fused_write", "0", False), ("fused_write", " 0 ", False),
    ("fused_write", "", True), ("fused_write", "on", None),
    ("fused_gather", None, True), ("fused_gather", "1", True), ("fused_gather", "0", False),
    ("fused_gather", "yes", None)])
def test_fusion_switches(monkeypatch: pytest.MonkeyPatch, which: str, raw: str | None, want: bool | None) -> None:
    """``OSCAR_VLLM_FUSED_WRITE``: on unless 0 (the measured default); ``OSCAR_VLLM_FUSED_GATHER``: off unless 1 (not
    yet timed on a GPU); anything but 0 / 1 is refused in one line naming the variable (None: refused)."""
    from oscar_cli.vllm import debug

    env = {"fused_write": debug.FUSED_WRITE_ENV, "fused_gather": debug.FUSED_GATHER_ENV}[which]
    if raw is None:
        monkeypatch.delenv(env, raising=False)
    else:
        monkeypatch.setenv(env, raw)
    if want is None:
        with pytest.raises(ValueError, match=f"{env}: expected 0 or 1"):
            getattr(debug, which)()
    else:
        assert getattr(debug, which)() is want


@pytest.mark.unit
@pytest.mark.parametrize(("fused", "gather", "direct", "key_mean", "batch", "torch_ops", "launches"),
                         [("0", "0", "0", "constant", 1, 0, 8), ("1", "0", "0", "constant", 1, 0, 6),
                          ("0", "0", "0", "rope", 1, 1, 8), ("1", "0", "0", "rope", 1, 1, 6),
                          ("1", "1", "0", "constant", 1, 0, 5), ("1", "0", "1", "constant", 1, 0, 4),
                          ("1", "1", "1", "rope", 1, 1, 4), ("0", "0", "1", "constant", 1, 0, 6),
                          ("", "", "", "constant", 1, 0, 5), ("", "", "", "rope", 1, 1, 5),
                          ("", "", "", "constant", 7, 0, 5), ("", "", "", "constant", 8, 0, 4),
                          ("", "", "", "rope", 8, 1, 4), ("", "", "0", "constant", 8, 0, 5)])
def test_decode_step_launch_count(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fused: str,
                                  gather: str, direct: str, key_mean: str, batch: int, torch_ops: int,
                                  launches: int) -> None:
    """scripts/cpu_vllm_decode_ops.py on a decode step of ``batch`` requests: eight launches per layer (K/V rotation,
    K, V and tier writes, tier gather, q rotation, stage 1, merge) with ``OSCAR_VLLM_FUSED_WRITE=0``, six with the
    three writes in one, five by default below 8 requests (unset: that, and the q rotation in the tier gather's
    launch), four with ``OSCAR_VLLM_DIRECT_TIERS=1`` (no gather; the q rotation in the K/V rotation's launch; it
    takes precedence over the fused gather) and by default from 8 requests on (``core.DIRECT_TIERS_FROM_BATCH``;
    ``OSCAR_VLLM_DIRECT_TIERS=0`` keeps the gather there); the rope format adds one torch op per layer for its key
    means (a GEMM with the layer's ``rope_matrix``; the step's table rows are gathered once, by its first layer)."""
    from helpers.scripts import load_script

    from oscar_cli.vllm import core

    assert core.DIRECT_TIERS_FROM_BATCH == 8, "the batches above straddle the switch: move them with it"
    monkeypatch.setenv("OSCAR_VLLM_FUSED_WRITE", fused)
    monkeypatch.setenv("OSCAR_VLLM_FUSED_GATHER", gather)
    monkeypatch.setenv("OSCAR_VLLM_DIRECT_TIERS", direct)
    monkeypatch.setattr("sys.argv", ["cpu_vllm_decode_ops.py", "--batch", str(batch), "--history", "256",
                                     "--key-mean", key_mean])
    load_script("cpu_vllm_decode_ops").main()
    assert f": {torch_ops} torch ops + {launches} kernel launches = {torch_ops + launches} per layer" in \
        capsys.readouterr().out
