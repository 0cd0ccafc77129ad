"""The Triton history dequantization (``ops.dequantize_history``) vs its torch twin (``core.torch_history``, what
``PagedInt2Layer.history`` ran before, 4,096 tokens at a time): bitwise.

Pages hold random bytes (every code pattern) with scales and zeros spread over many binades, both signs of zero
points, in shuffled, non-contiguous pages of a block-table row; ranges start at a page boundary past the sink and
end inside a page. CPU runs use the Triton interpreter (bf16 outputs too: the kernel rounds to bfloat16 with integer
arithmetic, the interpreter's cast truncates). With bf16 / fp16 scales ``code·scale`` is exact in float32, so a fused
multiply-add would not change a bit; float32 scales make it inexact, and only the GPU compiles ``zero + code·scale``
(the launcher turns fusion off): ``-m gpu`` checks float32 scales at the engine's shapes and times both paths.
"""

from __future__ import annotations

import pytest
import torch
from helpers.bitwise import assert_bitwise as _assert_bitwise

from oscar_cli.vllm import layout
from oscar_cli.vllm.core import PagedInt2Layer, TorchTiers, TritonKernels, torch_history
from oscar_kernels import ops
from oscar_kernels.reference import QuantizedRows

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _fill(pages: QuantizedRows, g: torch.Generator) -> None:
    """Random code bytes; scales > 0 and zeros of both signs spread over 2^-12 .. 2^6, some zero scales."""
    pages.packed.copy_(torch.randint(0, 256, pages.packed.shape, generator=g, dtype=torch.uint8))
    shape = pages.scale.shape
    spread = torch.exp2(torch.randint(-12, 7, shape, generator=g).float())
    scale = torch.rand(shape, generator=g) * spread
    scale.view(-1)[::11] = 0.0
    zero = -1.5 * torch.randn(shape, generator=g) * spread
    pages.scale.copy_(scale.to(pages.scale.dtype))
    pages.zero.copy_(zero.to(pages.zero.dtype))


def _pages(num: int, h: int, p: int, d: int, g_k: int, g_v: int, meta: torch.dtype, gen: torch.Generator
           ) -> tuple[QuantizedRows, QuantizedRows]:
    kp = ops.new_paged_cache(num, h, p, d, g_k, meta, DEV, "rows")
    vp = ops.new_paged_cache(num, h, p, d, g_v, meta, DEV, "token_quads")
    _fill(kp, gen)
    _fill(vp, gen)
    return kp, vp


def _means(gen: torch.Generator, h: int, d: int, per_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (h, d) if per_head else (d,)
    return (torch.randn(*shape, generator=gen).to(DEV) for _ in range(2))  # type: ignore[return-value]


def _run_both(kp: QuantizedRows, vp: QuantizedRows, blocks: torch.Tensor, start: int, n: int, h: int, d: int,
              dtype: torch.dtype, k_mean: torch.Tensor, v_mean: torch.Tensor, **kw: int
              ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    want = tuple(torch.full((n, h, d), float("nan"), dtype=dtype, device=DEV) for _ in range(2))
    torch_history(kp, vp, blocks, start, k_mean, v_mean, *want)
    got = tuple(torch.full((n, h, d), float("nan"), dtype=dtype, device=DEV) for _ in range(2))
    ops.dequantize_history(kp, vp, blocks, start, *got, k_mean, v_mean, **kw)
    return got, want  # type: ignore[return-value]


CASES = [
    # id, P, D, H_kv, G_K, G_V, meta dtype, start (page multiple), T, per-head mean
    ("p16-d64-h1-g64", 16, 64, 1, 64, 64, torch.bfloat16, 16, 37, True),
    ("p16-d128-h8-g128", 16, 128, 8, 128, 128, torch.bfloat16, 64, 200, True),
    ("p16-d64-h2-g16", 16, 64, 2, 16, 32, torch.float16, 0, 49, False),
    ("p32-d128-h2-g32", 32, 128, 2, 32, 128, torch.float32, 32, 95, True),
    ("p32-d64-h1-g64", 32, 64, 1, 64, 16, torch.bfloat16, 64, 64, False),
    ("p64-d128-h1-g128", 64, 128, 1, 128, 64, torch.float16, 64, 150, True),
    ("p64-d64-h8-g32", 64, 64, 8, 32, 64, torch.bfloat16, 128, 71, False),
    ("p128-d128-h2-g128", 128, 128, 2, 128, 128, torch.bfloat16, 128, 300, True),
    ("p128-d64-h1-g16", 128, 64, 1, 16, 16, torch.float32, 0, 129, False),
]


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_dequantize_history_bitwise(case: tuple, dtype: torch.dtype) -> None:
    """Every page size, head count, group sizes (K and V alike or not), scale dtype and mean form, through a shuffled
    block-table row with unused pages in it, into slices of a wider buffer (as the prefill's ``k_all[S0:c]``)."""
    name, p, d, h, g_k, g_v, meta, start, n, per_head = case
    gen = torch.Generator().manual_seed(len(name) * 31 + p + d)
    used = start // p + -(-n // p)
    num = 2 * used + 3
    kp, vp = _pages(num, h, p, d, g_k, g_v, meta, gen)
    blocks = torch.randperm(num, generator=gen)[: used + 2].to(torch.int32).to(DEV)  # 2 columns past the range
    k_mean, v_mean = _means(gen, h, d, per_head)
    got, want = _run_both(kp, vp, blocks, start, n, h, d, dtype, k_mean, v_mean)
    for nm, a, b in zip(("k_out", "v_out"), got, want, strict=True):
        assert torch.isfinite(b.float()).all(), nm
        _assert_bitwise(a, b, nm)
    # into row slices of one wider [start + n + 3, H_kv, D] buffer: the rows around the range stay untouched
    bufs = [torch.zeros(start + n + 3, h, d, dtype=dtype, device=DEV) for _ in range(2)]
    ops.dequantize_history(kp, vp, blocks.long(), start, bufs[0][start:start + n], bufs[1][start:start + n],
                           k_mean, v_mean)
    for buf, w in zip(bufs, want, strict=True):
        _assert_bitwise(buf[start:start + n], w, "slice")
        assert not buf[:start].any() and not buf[start + n:].any()


@pytest.mark.unit
@pytest.mark.parametrize("block_t", [1, 16, 64])
def test_dequantize_history_block_sizes_and_strided_outputs(block_t: int) -> None:
    """Tile sizes below, at and above the page size, outputs with head-major strides (``[H, T, D]`` transposed)."""
    p, d, h, n, start = 16, 64, 2, 45, 32
    gen = torch.Generator().manual_seed(block_t)
    kp, vp = _pages(12, h, p, d, d, d, torch.bfloat16, gen)
    blocks = torch.tensor([5, 0, 9, 3, 11, 7, 1], dtype=torch.int32, device=DEV)
    k_mean, v_mean = _means(gen, h, d, True)
    want = tuple(torch.empty(n, h, d, dtype=torch.float16, device=DEV) for _ in range(2))
    torch_history(kp, vp, blocks, start, k_mean, v_mean, *want)
    got = tuple(torch.empty(h, n, d, dtype=torch.float16, device=DEV).transpose(0, 1) for _ in range(2))
    ops.dequantize_history(kp, vp, blocks, start, *got, k_mean, v_mean, block_t=block_t)
    for a, b in zip(got, want, strict=True):
        _assert_bitwise(a.contiguous(), b, f"block_t {block_t}")


@pytest.mark.unit
@pytest.mark.parametrize("meta", [torch.bfloat16, torch.uint8], ids=["meta16", "meta8"])
def test_dequantize_history_reads_vllm_pages(meta: torch.dtype) -> None:
    """The engine's page views (``layout.carve_pages``: K, V, scales and zeros interleaved in one uint8 page, scales
    strided), written by the quantize-on-write path, fp32 outputs too; ``meta8``: formula 10's one-byte scale and
    zero, decoded in the kernel as the torch twin decodes them (bitwise)."""
    from oscar_cli.vllm.spec import slot_bytes

    p, d, h, n, s0 = 16, 64, 2, 70, 16
    gen = torch.Generator().manual_seed(7)
    kv = torch.zeros(9, p, h, slot_bytes(d, 1 if meta == torch.uint8 else 2), dtype=torch.uint8, device=DEV)
    kp, vp = layout.carve_pages(kv, d, meta)
    blocks = torch.tensor([4, 8, 2, 6, 1, 3, 7], dtype=torch.int32, device=DEV)
    slots = torch.tensor([int(blocks[i // p]) * p + i % p for i in range(s0 + n)], device=DEV)
    x = torch.randn(s0 + n, h, d, generator=gen).to(DEV)
    k_mean, v_mean = _means(gen, h, d, True)
    ops.quantize_write(x.half(), kp, slots, mean=k_mean, clip_ratio=0.9, layout="rows")
    ops.quantize_write(x.half(), vp, slots, mean=v_mean, clip_ratio=0.9, layout="token_quads")
    for dtype in (torch.float16, torch.float32):
        got, want = _run_both(kp, vp, blocks, s0, n, h, d, dtype, k_mean, v_mean)
        for a, b in zip(got, want, strict=True):
            _assert_bitwise(a, b, str(dtype))
        assert (got[0].float() - x[s0:]).abs().max() < 0.7 * x.abs().max()  # (a dequantization, not noise)


@pytest.mark.unit
@pytest.mark.parametrize("meta", [torch.bfloat16, torch.uint8], ids=["meta16", "meta8"])
def test_dequantize_history_reads_int4_keys_bitwise(meta: torch.dtype) -> None:
    """INT4 keys' pages (the vLLM backend's INT4 layers: the high plane with scale and zero in the page, the low
    plane at the same offsets, written by ``quantize_write(low_plane=...)``): the kernel gives the torch twin's bytes
    (``reference.dequantize_int4_planes``), and the keys come back closer to the rows than 2-bit keys would."""
    from oscar_cli.vllm.spec import slot_bytes

    p, d, h, n, s0 = 16, 64, 2, 70, 16
    gen = torch.Generator().manual_seed(9)
    kv = torch.zeros(9, p, h, slot_bytes(d, 1 if meta == torch.uint8 else 2, 4), dtype=torch.uint8, device=DEV)
    kp, vp = layout.carve_pages(kv, d, meta, 4)
    low = layout.carve_low_plane(kv, d, meta)
    blocks = torch.tensor([4, 8, 2, 6, 1, 3, 7], dtype=torch.int32, device=DEV)
    slots = torch.tensor([int(blocks[i // p]) * p + i % p for i in range(s0 + n)], device=DEV)
    x = torch.randn(s0 + n, h, d, generator=gen).to(DEV)
    k_mean, v_mean = _means(gen, h, d, True)
    ops.quantize_write(x.half(), kp, slots, mean=k_mean, low_plane=low)
    ops.quantize_write(x.half(), vp, slots, mean=v_mean, clip_ratio=0.9, layout="token_quads")
    for dtype in (torch.float16, torch.float32):
        want = tuple(torch.full((n, h, d), float("nan"), dtype=dtype, device=DEV) for _ in range(2))
        torch_history(kp, vp, blocks, s0, k_mean, v_mean, *want, k_low=low)
        got = tuple(torch.full((n, h, d), float("nan"), dtype=dtype, device=DEV) for _ in range(2))
        ops.dequantize_history(kp, vp, blocks, s0, *got, k_mean, v_mean, k_low=low)
        for a, b in zip(got, want, strict=True):
            _assert_bitwise(a, b, str(dtype))
    err4 = (got[0].float() - x[s0:].half().float()).abs().max()
    two = torch.full_like(got[0], float("nan"))
    ops.dequantize_history(kp, vp, blocks, s0, two, torch.empty_like(two), k_mean, v_mean)  # the high plane alone
    assert err4 < 0.5 * (two.float() - x[s0:].half().float()).abs().max()
    with pytest.raises(ValueError, match="k_low"):
        ops.dequantize_history(kp, vp, blocks, s0, *got, k_mean, v_mean, k_low=low[:, :1])


class _Twin(TorchTiers):
    pass


@pytest.mark.unit
def test_layer_history_uses_the_kernel_bitwise_as_its_torch_twin() -> None:
    """``PagedInt2Layer.history`` with the engine's kernels (``TritonKernels``: ``ops.dequantize_history``) and with
    the torch twin (pieces of 2 pages), per-head means from the layer's tensors."""
    p, d, hq, h, s0 = 16, 64, 4, 2, 32
    gen = torch.Generator().manual_seed(3)
    t = layout.LayerTensors(torch.eye(d), torch.eye(d), torch.randn(h, d, generator=gen),
                            torch.randn(h, d, generator=gen), 0.0, 0.0)
    s = layout.Int2Settings(sink=s0, recent=16)
    layers = [PagedInt2Layer(t, s, 2, hq, h, d, p, torch.bfloat16, DEV, kernels=k)  # type: ignore[arg-type]
              for k in (TritonKernels(), _Twin())]
    kp, vp = _pages(10, h, p, d, d, d, torch.bfloat16, gen)
    blocks = torch.tensor([9, 2, 4, 0, 7, 5, 1, 3], dtype=torch.int32, device=DEV)
    outs = []
    for layer in layers:
        k, v = (torch.empty(90, h, d, dtype=torch.bfloat16, device=DEV) for _ in range(2))
        layer.history(kp, vp, blocks, s0, k, v, piece=32)
        outs.append((k, v))
    _assert_bitwise(outs[0][0], outs[1][0], "k")
    _assert_bitwise(outs[0][1], outs[1][1], "v")


@pytest.mark.unit
def test_dequantize_history_empty_range_launches_nothing() -> None:
    gen = torch.Generator().manual_seed(0)
    kp, vp = _pages(2, 1, 16, 64, 64, 64, torch.bfloat16, gen)
    k = torch.empty(0, 1, 64, dtype=torch.bfloat16, device=DEV)
    ops.dequantize_history(kp, vp, torch.zeros(1, dtype=torch.int32, device=DEV), 16, k, k.clone(),
                           *_means(gen, 1, 64, False))


@pytest.mark.unit
def test_dequantize_history_refuses_bad_arguments() -> None:
    """One-line errors naming the argument (dtype, shape, device, alignment)."""
    gen = torch.Generator().manual_seed(0)
    h, p, d, n = 2, 16, 64, 20
    kp, vp = _pages(4, h, p, d, d, d, torch.bfloat16, gen)
    blocks = torch.arange(4, dtype=torch.int32, device=DEV)
    km, vm = _means(gen, h, d, True)
    out = torch.empty(n, h, d, dtype=torch.bfloat16, device=DEV)

    def call(kp=kp, vp=vp, blocks=blocks, start=16, k_out=out, v_out=out, km=km, vm=vm, **kw):  # type: ignore[no-untyped-def]
        ops.dequantize_history(kp, vp, blocks, start, k_out, v_out, km, vm, **kw)

    q = QuantizedRows
    cases = [
        ("k_out", dict(k_out=out.to(torch.int32))),
        ("k_out", dict(k_out=out[..., :62])),
        ("k_out", dict(k_out=out[..., ::2], v_out=out[..., ::2])),
        ("k_out", dict(k_out=out.reshape(n, h * d))),
        ("v_out", dict(v_out=out.half())),
        ("v_out", dict(v_out=out[:-1])),
        ("k_pages.packed", dict(kp=q(kp.packed.view(torch.int8), kp.scale, kp.zero))),
        ("k_pages.packed", dict(kp=q(kp.packed[:, :1], kp.scale, kp.zero))),
        ("k_pages.scale", dict(kp=q(kp.packed, kp.scale.to(torch.int16), kp.zero))),
        ("k_pages.scale", dict(kp=q(kp.packed, torch.zeros(4, h, p, 3, dtype=torch.bfloat16, device=DEV),
                                    torch.zeros(4, h, p, 3, dtype=torch.bfloat16, device=DEV)))),
        ("k_pages.zero", dict(kp=q(kp.packed, kp.scale, kp.zero.half()))),
        ("k_pages.zero", dict(kp=q(kp.packed, kp.scale, kp.zero.transpose(1, 2).contiguous().transpose(1, 2)))),
        ("v_pages.packed", dict(vp=q(kp.packed, vp.scale, vp.zero))),  # rows, not token quads
        ("v_pages.scale", dict(vp=q(vp.packed, vp.scale[:, :, :8], vp.zero[:, :, :8]))),
        ("blocks", dict(blocks=blocks.float())),
        ("blocks", dict(blocks=blocks[None])),
        ("blocks", dict(blocks=blocks[:2])),  # positions 16 .. 36 need 3 pages
        ("start", dict(start=8)),
        ("start", dict(start=-16)),
        ("k_mean", dict(km=km.double())),
        ("v_mean", dict(vm=vm[:1])),
        ("block_t", dict(block_t=24)),
    ]
    for name, kw in cases:
        with pytest.raises(ValueError, match=f"^{name}") as err:
            call(**kw)
        assert "\n" not in str(err.value), str(err.value)
    if not CUDA:  # a CUDA-only tensor is not available: a meta-device mean stands for another device
        with pytest.raises(ValueError, match="^k_mean"):
            call(km=torch.empty(h, d, device="meta"))
    else:
        with pytest.raises(ValueError, match="^blocks"):
            call(blocks=blocks.cpu())


# the kernel compiled for sm_90 on any machine (Triton's bundled ptxas; a subprocess: this session's kernels are the
# interpreter's), with the launcher's options and, for contrast, Triton's default contraction
_PTX = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from oscar_kernels import history, history_ops
fn = history._history_kernel
const = dict(P=16, R=16, D=128, BLOCK_D=128, G_K=128, NG_K=1, G_V=32, NG_V=4, BLOCK_T=32)
ptr = {"kc_ptr": "*u8", "vc_ptr": "*u8", "blocks_ptr": "*i32", "k_mean_ptr": "*fp32", "v_mean_ptr": "*fp32",
       "k_out_ptr": "*bf16", "v_out_ptr": "*bf16"}
sig = {a: "constexpr" if a in const else ptr.get(a, "*fp32" if a.endswith("_ptr") else "i32") for a in fn.arg_names}
out = {}
for name, opts in (("launcher", history_ops.COMPILE_OPTIONS), ("default", {})):
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options={**opts, "num_warps": 4})
    out[name] = k.asm["ptx"]
json.dump(out, sys.stdout)
"""


@pytest.mark.unit
def test_dequantize_history_compiles_without_fma() -> None:
    """``zero + code·scale`` is a multiply and an add in the sm_90 PTX the launcher's options give (float32 scales:
    Triton's default would fuse them, as the contrast shows)."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("Triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _PTX], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    ptx = json.loads(res.stdout)
    assert "fma.rn.f32" in ptx["default"], "the contrast compiled no FMA: the check below would prove nothing"
    assert "fma.rn.f32" not in ptx["launcher"]
    assert "mul.rn.f32" in ptx["launcher"] and "add.rn.f32" in ptx["launcher"]


# ---------------------------------------------------------------------------- GPU: the engine's shapes, timed
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("meta", [torch.bfloat16, torch.float32], ids=["bf16-meta", "fp32-meta"])
def test_dequantize_history_engine_shapes_on_gpu(meta: torch.dtype) -> None:
    """Qwen3-8B's attention shape (8 KV heads, D = 128, pages of 16, bf16 outputs, per-head means) over a 128K-token
    history (S0 = 64 to 131,008) in shuffled pages: bitwise the torch twin; prints both paths' times (µs per call,
    CUDA events, median of 5 after a warm-up; the kernel also at other tile sizes and warp counts). fp32 scales make
    ``code·scale`` inexact: a contracted FMA would show."""
    h, d, p, s0, n = 8, 128, 16, 64, 131_072 - 64 - 64
    gen = torch.Generator().manual_seed(11)
    used = s0 // p + -(-n // p)
    kp, vp = _pages(used + 64, h, p, d, d, d, meta, gen)
    blocks = torch.randperm(used + 64, generator=gen)[:used].to(torch.int32).to(DEV)
    k_mean, v_mean = _means(gen, h, d, True)
    got, want = _run_both(kp, vp, blocks, s0, n, h, d, torch.bfloat16, k_mean, v_mean)
    for nm, a, b in zip(("k_out", "v_out"), got, want, strict=True):
        _assert_bitwise(a, b, nm)

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        fn()
        times = []
        for _ in range(5):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1) * 1e3)
        return sorted(times)[2]

    t_kernel = timed(lambda: ops.dequantize_history(kp, vp, blocks, s0, *got, k_mean, v_mean))
    t_torch = timed(lambda: torch_history(kp, vp, blocks, s0, k_mean, v_mean, *want))
    moved = 2 * n * h * (d * 2 + d // 4 + 2 * meta.itemsize)  # K and V: outputs, codes, scale + zero
    print(f"\nhistory {n} tokens x {h} heads x D {d}, {meta} meta: ops.dequantize_history {t_kernel:.1f} us "
          f"({moved / t_kernel / 1e6:.2f} TB/s), torch_history {t_torch:.1f} us ({t_torch / t_kernel:.1f}x)")
    tiles = []  # the launcher's tile size (block_t = 32, 4 warps) against its neighbours
    for bt in (16, 32, 64, 128):
        for nw in (4, 8):
            us = timed(lambda bt=bt, nw=nw: ops.dequantize_history(kp, vp, blocks, s0, *got, k_mean, v_mean,
                                                                   block_t=bt, num_warps=nw))
            tiles.append(f"{bt}/{nw}w {us:.1f}")
    print("block_t/warps (us): " + ", ".join(tiles))
    for nm, a, b in zip(("k_out", "v_out"), got, want, strict=True):
        _assert_bitwise(a, b, nm)
