"""The inputs ``oscar bench`` measures: random INT2 decode cases (shuffled pages, BF16 sink and recent tiers,
rotations), their launch plans, and the bytes one decode step must move (INT2 and BF16)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from oscar_cli.bench.config import BenchConfig
from oscar_cli.bench.shapes import AttnShape
from oscar_cli.bench.timing import rotating


def int2_bytes(shape: AttnShape, batch: int, ctx: int, sink: int, recent: int, page: int, meta_bytes: int = 2,
               key_bits: int = 2) -> int:
    """Bytes one INT2 decode step must move (G = D): history codes + scale + zero (``key_bits`` 4: the keys' low
    plane too), BF16 tiers, q, out, R_K, R_V, mu_V and the block table."""
    hp = min(ctx, sink + recent)
    hist = ctx - hp
    per_tok = 2 * shape.h_kv * (shape.d // 4 + 2 * meta_bytes) + (shape.h_kv * shape.d // 4 if key_bits == 4 else 0)
    tiers = 2 * hp * shape.h_kv * shape.d * 2
    qo = 2 * shape.h_q * shape.d * 2
    table = math.ceil(hist / page) * 4
    return batch * (hist * per_tok + tiers + qo + table) + 2 * shape.d * shape.d * 4 + shape.d * 4


def bf16_bytes(shape: AttnShape, batch: int, ctx: int) -> int:
    """Bytes one BF16 decode step must move: K and V of every token, q and the output."""
    return batch * (2 * ctx * shape.h_kv * shape.d * 2 + 2 * shape.h_q * shape.d * 2)


def orthogonal(d: int, device: torch.device) -> torch.Tensor:
    """A random ``[d, d]`` float32 rotation."""
    return torch.linalg.qr(torch.randn(d, d, device=device, dtype=torch.float32))[0].contiguous()


def page_geometry(cfg: BenchConfig, hist: int) -> tuple[int, int]:
    """(page size, pages per sequence): ``cfg.page_size`` pages, or one page of the whole history."""
    if cfg.paged:
        return cfg.page_size, max(1, math.ceil(hist / cfg.page_size))
    return max(64, math.ceil(hist / 64) * 64), 1


def build_int2_case(
    shape: AttnShape, batch: int, ctx: int, cfg: BenchConfig, device: torch.device, seed: int
) -> dict[str, Any]:
    """Random paged INT2 cache (shuffled pages), BF16 tiers and rotations for one decode step."""
    from oscar_kernels.reference import QuantizedRows, encode_meta, token_quad_row

    torch.manual_seed(seed)
    act = cfg.activation_dtype
    hp = min(ctx, cfg.sink + cfg.recent)
    hist = ctx - hp
    page_size, n_pp = page_geometry(cfg, hist)
    pages = batch * n_pp
    h, d = shape.h_kv, shape.d

    def rows(values: bool = False) -> QuantizedRows:
        row = token_quad_row(page_size)  # token quads for V: rows of min(P, 64) tokens
        cshape = (pages, h, page_size // row * d, row // 4) if values else (pages, h, page_size, d // 4)
        codes = torch.randint(0, 256, cshape, dtype=torch.uint8, device=device)
        s = torch.rand(pages, h, page_size, 1, device=device) * 0.1 + 0.01
        mn = torch.randn(pages, h, page_size, 1, device=device) * 0.2
        if cfg.meta_bits == 8:  # formula 10's bytes of the same steps and minima
            return QuantizedRows(codes, *encode_meta(s, mn, mn + 3 * s, 3.0, torch.uint8))
        return QuantizedRows(codes, s.to(torch.bfloat16), mn.to(torch.bfloat16))

    def tier(n: int) -> torch.Tensor:
        return torch.randn(batch, h, max(n, 1), d, device=device).to(act)

    s_len, r_len = min(ctx, cfg.sink), hp - min(ctx, cfg.sink)
    return {
        "q": torch.randn(batch, shape.h_q, d, device=device).to(act),
        "k_cache": rows(),
        "v_cache": rows(values=True),
        "block_table": torch.randperm(pages, device=device, dtype=torch.int32).reshape(batch, n_pp),
        "hist_len": torch.full((batch,), hist, dtype=torch.int32, device=device),
        "sink_k": tier(s_len),
        "sink_v": tier(s_len),
        "sink_len": torch.full((batch,), s_len, dtype=torch.int32, device=device),
        "recent_k": tier(r_len),
        "recent_v": tier(r_len),
        "recent_len": torch.full((batch,), r_len, dtype=torch.int32, device=device),
        "rotation_k": orthogonal(d, device),
        "rotation_v": orthogonal(d, device),
        "mean_v": torch.randn(d, device=device) * 0.1,
    }


ROPE_THETA = 1_000_000.0  # Qwen3's RoPE base; the term's cost does not depend on the frequencies


@dataclass(frozen=True)
class RopeMeanStep:
    """One decode step over a history written centred by position (``quant.key_mean: rope``), as the Triton path
    runs it: the per-key logit term into ``bias`` (:func:`oscar_kernels.ops.rope_mean_logits`), then the
    decode plan that reads it."""

    plan: Any
    q: torch.Tensor
    mean_pre: torch.Tensor
    table: torch.Tensor
    position0: list[int]
    bias: torch.Tensor

    def run(self) -> torch.Tensor:
        from oscar_kernels import ops

        ops.rope_mean_logits(self.q, self.mean_pre, self.table, 1.0, self.position0, int(self.q.shape[-1]) ** -0.5,
                             self.bias)
        return self.plan.run()


def add_rope_mean(case: dict[str, Any], table: torch.Tensor, fused: bool = True) -> None:
    """Give a case what the position-dependent key mean needs: a pre-RoPE mean per KV head, the shared position
    ``table`` (:func:`oscar_kernels.ops.position_table` covering the sink and the block table's capacity) and each
    row's first history position (after its sink); ``fused``: as the decode's ``rope_mean`` (stage 1 computes the
    term), else the ``[B, H_q, L]`` float32 bias buffer over that capacity for the GEMM form."""
    from oscar_kernels import ops

    b, h_q, d = (int(x) for x in case["q"].shape)
    h_kv, page = int(case["k_cache"].packed.shape[1]), int(case["k_cache"].packed.shape[2])
    device = case["q"].device
    case["mean_pre"] = torch.randn(h_kv, d, device=device)
    case["position_table"] = table
    case["position0"] = [int(x) for x in case["sink_len"].tolist()]
    if fused:
        case["rope_mean"] = ops.RopeMean(case["mean_pre"], table, case["sink_len"].to(torch.int32).clone())
    else:
        case["logit_bias"] = torch.zeros(b, h_q, int(case["block_table"].shape[1]) * page, dtype=torch.float32,
                                         device=device)


def add_low_plane(case: dict[str, Any]) -> None:
    """Give a case INT4 keys (``quant.int4_keys``): random low-plane codes for every history slot of the block
    table's capacity, each row's history from slot 0, as the decode's ``low_plane``."""
    from oscar_kernels import ops

    _, h_kv, page, dq = (int(x) for x in case["k_cache"].packed.shape)
    b, cap = int(case["q"].shape[0]), int(case["block_table"].shape[1]) * page
    codes = torch.randint(0, 256, (b, h_kv, cap, dq), dtype=torch.uint8, device=case["q"].device)
    case["low_plane"] = ops.LowPlane(codes, torch.zeros(b, dtype=torch.int32, device=case["q"].device))


def rope_frequencies(d: int) -> torch.Tensor:
    """``inv_freq`` of a RoPE with base :data:`ROPE_THETA` and head dim ``d``."""
    return 1.0 / ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.float32) / d)


def int2_plan(case: dict[str, Any], splits: int, config: Any, workspace: Any, out: torch.Tensor,
              paged: bool = True) -> Any:
    """A validated :class:`oscar_kernels.ops.DecodePlan` over one case (launch with ``.run()``); a case with a
    position-dependent key mean's GEMM form (:func:`add_rope_mean` with ``fused=False``) gives a
    :class:`RopeMeanStep`."""
    from oscar_kernels import ops

    keys = ("k_cache", "v_cache", "block_table", "hist_len", "sink_k", "sink_v", "sink_len",
            "recent_k", "recent_v", "recent_len")
    plan = ops.DecodePlan(case["q"], *(case[k] for k in keys), rotation_k=case["rotation_k"],
                          rotation_v=case["rotation_v"], mean_v=case["mean_v"], num_splits=splits,
                          config=config, workspace=workspace, out=out, paged=paged,
                          logit_bias=case.get("logit_bias"), rope_mean=case.get("rope_mean"),
                          low_plane=case.get("low_plane"))
    if "logit_bias" not in case:
        return plan
    return RopeMeanStep(plan, case["q"], case["mean_pre"], case["position_table"], case["position0"],
                        case["logit_bias"])


def decode_config_for(cfg: BenchConfig, batch: int) -> Any:
    """``oscar_kernels.ops.default_config(batch)`` (for the key mean measured) with the fields the bench config
    overrides (all others kept)."""
    from oscar_kernels import ops

    return replace(ops.default_config(batch, rope_mean=cfg.key_mean == "rope"), **dict(cfg.kernel))


def int2_plans(
    shape: AttnShape,
    batch: int,
    ctx: int,
    cfg: BenchConfig,
    device: torch.device,
    l2: int,
    decode_config: Any = None,
    splits: int | None = None,
) -> tuple[list[Any], list[dict[str, Any]], int]:
    """(launch plans, their cases, split count) of one INT2 decode step over enough rotating caches to exceed
    the L2 (cold-cache timing); the plans share one workspace and output. Benchmarks and GPU scripts build
    their measurements on these."""
    from oscar_kernels import ops

    dc = decode_config or decode_config_for(cfg, batch)
    hist = max(ctx - cfg.sink - cfg.recent, 0)
    ps, n_pp = page_geometry(cfg, hist)
    s = splits or cfg.num_splits or ops.default_num_splits(batch, shape.h_kv, ps * n_pp, dc.block_n, device)
    nbytes = int2_bytes(shape, batch, ctx, cfg.sink, cfg.recent, cfg.page_size, cfg.meta_bits // 8, cfg.key_bits)
    table = (ops.position_table(rope_frequencies(shape.d), min(ctx, cfg.sink) + ps * n_pp, device)
             if cfg.key_mean != "constant" else None)  # one position table for every case

    def make(i: int) -> dict[str, Any]:
        case = build_int2_case(shape, batch, ctx, cfg, device, cfg.seed + i)
        if table is not None:
            add_rope_mean(case, table, fused=cfg.key_mean == "rope")
        if cfg.key_bits == 4:
            add_low_plane(case)
        return case

    cases = rotating(make, nbytes, l2)
    ws = ops.make_workspace(batch, shape.h_q, shape.d, s, device)
    out = torch.empty(batch, shape.h_q, shape.d, dtype=cases[0]["q"].dtype, device=device)
    return [int2_plan(c, s, dc, ws, out, cfg.paged) for c in cases], cases, s
