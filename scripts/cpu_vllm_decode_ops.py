#!/usr/bin/env python3
"""Count the device operations of one vLLM decode step of one INT2 layer (``oscar_cli.vllm.core``), on the CPU.

Every top-level torch op of ``PagedInt2Layer.forward`` for a decode-only batch is one device kernel (or a no-op
cast), and the kernel entry points (the K/V rotation, quantize-on-write x2, the tier write, the tier gather, the
decode's q rotation + stage 1 + merge) are counted by a stub; a step's total is this times the number of layers. The
stub rotates as ``TritonKernels`` does on CUDA: one launch up to ``core.ROTATE_TRITON_MAX_ROWS`` tokens, the torch
ops (2 matmuls, 4 casts) above it or with ``OSCAR_VLLM_TORCH_ROTATE=1``; the writes as one launch
(``ops.write_step``: K, V and tiers), or as three with ``OSCAR_VLLM_FUSED_WRITE=0``; the decode's q rotation in
the tier gather's launch (the default below ``core.DIRECT_TIERS_FROM_BATCH`` (8) requests), or in its own with
``OSCAR_VLLM_FUSED_GATHER=0``; no gather, the q rotation in the K/V rotation's launch, from 8 requests on
(``--batch 8``) or with ``OSCAR_VLLM_DIRECT_TIERS=1``.
No GPU or vLLM needed:

    python3 scripts/cpu_vllm_decode_ops.py --batch 1 --history 4096
    OSCAR_VLLM_FUSED_WRITE=0 python3 scripts/cpu_vllm_decode_ops.py --batch 1 --history 4096
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from oscar_cli.vllm import debug, layout  # noqa: E402
from oscar_cli.vllm.core import (  # noqa: E402
    PagedInt2Layer,
    build_step,
    direct_tiers_for,
    rotates_in_torch,
    torch_rotate,
)

# ops that only make views or metadata (no device kernel)
VIEWS = {"aten::slice", "aten::view", "aten::select", "aten::permute", "aten::expand", "aten::as_strided",
         "aten::t", "aten::transpose", "aten::unsqueeze", "aten::_unsafe_view", "aten::empty", "aten::empty_strided",
         "aten::alias", "aten::reshape", "aten::detach", "aten::lift_fresh", "aten::result_type", "aten::expand_as",
         "aten::squeeze", "aten::resolve_conj", "aten::resolve_neg", "aten::empty_like"}


class KernelStub:
    """Counts the Triton launches the layer would make (one per rotation, write or gather; decode: q rotation, stage 1,
    merge)."""

    def __init__(self) -> None:
        self.launches = 0
        self.torch_rotate = debug.torch_rotate_forced()
        self.fused_write = debug.fused_write()
        self.fused_gather = debug.fused_gather()
        self.direct_tiers = debug.direct_tiers()

    def direct_for(self, num_decodes: int) -> bool:  # as TritonKernels.direct_for
        return direct_tiers_for(self.direct_tiers, num_decodes)

    def rotates_query(self, num_tokens: int, num_decodes: int) -> bool:  # as TritonKernels.rotates_query
        return self.direct_for(num_decodes) and not rotates_in_torch(num_tokens, self.torch_rotate)

    def rotate_kv(self, k: torch.Tensor, v: torch.Tensor, r_k: torch.Tensor, r_v: torch.Tensor,
                  dtype: torch.dtype, query: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        if rotates_in_torch(int(k.shape[0]), self.torch_rotate):  # as TritonKernels.rotate_kv
            return torch_rotate(k, r_k, dtype), torch_rotate(v, r_v, dtype)
        self.launches += 1  # ops.rotate_kv: both (and the query) in one launch, into new tensors (no device op)
        return torch.empty(k.shape, dtype=dtype), torch.empty(v.shape, dtype=dtype)

    def quantize_write(self, *args: Any, **kw: Any) -> None:
        self.launches += 1

    def tier_write(self, *args: Any) -> None:
        self.launches += 1

    def write_step(self, *args: Any, **kw: Any) -> None:
        self.launches += 1  # ops.write_step: K, V and tiers in one launch

    def tier_gather(self, *args: Any, **kw: Any) -> Any:
        self.launches += 1  # with a query (OSCAR_VLLM_FUSED_GATHER=1) the decode's q rotation is in this launch
        return args[-1]  # the layer's shared buffers (what ops.tier_gather fills)

    def decode(self, *args: Any, q_rot: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:
        self.launches += 3 if q_rot is None else 2  # (q rotation,) stage 1, merge
        return args[11]  # out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--history", type=int, default=4096)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--layers", type=int, default=36, help="for the per-step total (Qwen3-8B: 36)")
    ap.add_argument("--key-mean", choices=["constant", "rope"], default="constant",
                    help="rope: keys centred by position (quant.key_mean rope, the Qwen recipe's format): the write "
                         "computes each new token's mean in torch")
    a = ap.parse_args()
    d, hkv, hq, p, s0, w, b, n = 128, a.kv_heads, a.q_heads, 16, 64, 256, a.batch, a.history
    q_, _ = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(0)))
    rope = a.key_mean == "rope"
    tensors = layout.LayerTensors(k_rotation=q_, v_rotation=q_.T.contiguous(), k_mean=torch.zeros(hkv, d),
                                  v_mean=torch.zeros(hkv, d), k_clip=0.9, v_clip=0.9,
                                  k_mean_pre=torch.randn(hkv, d) if rope else None)
    s = layout.Int2Settings(sink=s0, recent=w)
    stub = KernelStub()
    freqs = layout.RopeFrequencies(1e6 ** -(torch.arange(0, d, 2).float() / d), 1.0, n + 64) if rope else None
    layer = PagedInt2Layer(tensors, s, 64, hq, hkv, d, p, torch.bfloat16, "cpu", kernels=stub,  # type: ignore[arg-type]
                           rope=freqs)
    nb = n // p + 2
    kv = torch.zeros(b * nb + 1, p, hkv, d // 2 + 8, dtype=torch.uint8)
    table = torch.tensor([[1 + i * nb + j for j in range(nb)] for i in range(b)], dtype=torch.int32)
    qsl, seq = list(range(b + 1)), [n] * b
    slots = torch.tensor([int(table[i, (n - 1) // p]) * p + (n - 1) % p for i in range(b)])
    state = torch.zeros(65, 2, dtype=torch.int32)
    state[:b, 0] = w
    st = build_step(torch.tensor(qsl, dtype=torch.int32), qsl, torch.tensor(seq, dtype=torch.int32), seq, table,
                    slots, b, list(range(b)), state, s, torch.zeros(b, dtype=torch.bool))
    kp, vp = layout.carve_pages(kv, d)
    q, k, v = torch.randn(b, hq, d).bfloat16(), torch.randn(b, hkv, d).bfloat16(), torch.randn(b, hkv, d).bfloat16()
    out = torch.zeros(b, hq, d, dtype=torch.bfloat16)
    layer.forward(q, k, v, kp, vp, st, out)
    stub.launches = 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        layer.forward(q, k, v, kp, vp, st, out)
    ops = Counter(e.name for e in prof.events() if e.name.startswith("aten::") and e.name not in VIEWS
                  and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
    per_layer = sum(ops.values()) + stub.launches
    print(f"batch {b}, history {n}: {sum(ops.values())} torch ops + {stub.launches} kernel launches = {per_layer} "
          f"per layer, {per_layer * a.layers} per step at {a.layers} layers")
    for name, count in ops.most_common():
        print(f"  {count:3d} {name}")


if __name__ == "__main__":
    main()
