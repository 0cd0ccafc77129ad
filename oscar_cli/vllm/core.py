"""The INT2 attention step over vLLM's pages, in torch + ``oscar_kernels.ops`` (no vLLM import).

:class:`Step` is one engine step's batch (built once per step from vLLM's metadata by :func:`build_step`, shared by
all layers); :class:`PagedInt2Layer` is one attention layer: its transforms and the per-sequence BF16 tiers, with

- :meth:`PagedInt2Layer.rotate` — the step's new K and V rows ``@ R`` in float32, rounded to the activation dtype
  (``ops.rotate_kv``, one launch, up to :data:`ROTATE_TRITON_MAX_ROWS` tokens; cuBLAS above);
- :meth:`PagedInt2Layer.write` — quantize-on-write of every new token into its page through the slot mapping
  (``ops.quantize_write``: K rows, V token quads), plus its rotated BF16 copy into the sequence's sink (positions
  ``< S0``) or recent ring (the newest ``W + B - 1`` positions) (``ops.tier_write``, one launch);
- :meth:`PagedInt2Layer.decode` — one query per sequence over sink + INT2 history + recent (``ops.tier_gather``
  centres the batch's sink and ring rows into buffers shared by the layers, then ``ops.DecodePlan``, the split-KV
  kernel; all launches are CUDA-graph capturable);
- :meth:`PagedInt2Layer.prefill` — a chunk attends to the sink, to earlier tokens through a transient
  dequantized copy of their INT2 pages (``ops.dequantize_history``, one launch per chunk), and to itself unquantized
  (causal), as the reference cache does.

Keys centred by position (``quant.key_mean: rope``, a layer with ``k_mean_pre`` and the model's
:class:`~oscar_cli.vllm.layout.RopeFrequencies`): writes take one mean per row (:meth:`PagedInt2Layer.key_means` at
each token's position), the decode adds the mean's logit term in the kernel (``ops.RopeMean`` over a shared position
table), and a prefill chunk's dequantized history gets each position's mean back.

INT4 keys (recipe ``quant.int4_keys``, :attr:`PagedInt2Layer.key_bits` 4, formula 9): the layer's pages also hold
the keys' low plane (:func:`oscar_cli.vllm.layout.carve_low_plane`, laid out as the key codes). Writes quantize keys
in one launch (``ops.quantize_write(low_plane=...)``: both planes, scale and zero, bitwise the reference's
``quantize_rows_int4``; the torch twin :func:`write_int4_keys`), the decode kernel reads the low plane through the
same block table (``ops.LowPlane(codes)``, paged), and a prefill chunk dequantizes that layer's history in torch
(``ops.dequantize_history`` with the plane; the torch twin :func:`torch_history`).

Semantics are the reference cache's (``oscar_cli.quant.int2_layer.Int2Layer``): the recent length follows its placement
rule (:func:`oscar_cli.vllm.layout.next_recent_len`), so a decode step sees exactly the tokens the reference keeps
in BF16; every token is also stored in INT2 at arrival, so a token that leaves the recent window needs no
re-quantization (the codes are those the reference computes when it demotes it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from oscar_cli.vllm.layout import (
    Int2Settings,
    LayerTensors,
    RopeFrequencies,
    advance_recent,
    decode_lengths,
    ring_gather_index,
    tier_write_index,
    token_positions,
)
from oscar_kernels.reference import (
    QuantizedRows,
    dequantize_codes,
    dequantize_int2,
    dequantize_int4_planes,
    quantize_rows_int4,
    unpack_int2,
    unpack_token_quads,
)

# (q [n, H_q, D], k [T, H_kv, D], v [T, H_kv, D], offset, softmax scale) -> [n, H_q, D];
# query i sees keys 0 .. offset + i
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


@dataclass
class Step:
    """One engine step: vLLM's metadata plus what the INT2 path derives from it (device tensors unless noted)."""

    num_tokens: int  # real query tokens (host int)
    num_decodes: int  # leading one-token requests (host int)
    seq_lens: torch.Tensor  # int32 [R]: lengths after this step
    block_table: torch.Tensor  # int32 [R, max_blocks]
    slot_mapping: torch.Tensor  # int64 [N]
    rows: torch.Tensor  # int64 [R]: the request's row of the BF16 tiers
    rows_host: list[int]  # the same rows (host ints)
    req: torch.Tensor  # int64 [N]: request of each token
    pos: torch.Tensor  # int64 [N]: absolute position of each token
    recent_len: torch.Tensor  # int32 [R]
    sink_len: torch.Tensor  # int32 [R]
    hist_len: torch.Tensor  # int32 [R]: INT2 tokens from position S0 (decode rows)
    ring_index: torch.Tensor  # int64 [R, ring]
    # where each new token's rotated BF16 K/V goes (layout.tier_write_index), int64 [N]: the same for every layer
    sink_row: torch.Tensor
    sink_pos: torch.Tensor
    ring_row: torch.Tensor
    ring_slot: torch.Tensor
    prefills: list[tuple[int, int, int, int]] = field(default_factory=list)  # (request, q_start, q_end, seq_len)
    # the position table's rows of the new tokens, for keys centred by position: gathered by the step's first layer
    # and read by the others (:meth:`PagedInt2Layer.key_means`): (table, n) -> float32 [n, D]
    rope_rows: dict[tuple[object, ...], torch.Tensor] = field(default_factory=dict)


def split_decodes(query_start_loc_cpu: list[int]) -> int:
    """Number of leading one-token requests (vLLM puts decodes first when ``reorder_batch_threshold = 1``)."""
    lens = [b - a for a, b in zip(query_start_loc_cpu[:-1], query_start_loc_cpu[1:], strict=True)]
    nd = 0
    while nd < len(lens) and lens[nd] == 1:
        nd += 1
    if any(n == 1 for n in lens[nd:]):
        raise ValueError(f"batch not reordered: a one-token request after a prefill ({lens})")
    return nd


def decode_only(st: Step) -> bool:
    """Whether no two tokens of the step share a 32-bit token-quad word of the V pages (so the V write needs no
    atomics): every request with tokens has exactly one (no prefill chunk: :func:`split_decodes` puts all one-token
    requests first and :func:`build_step` lists every later request with tokens in ``prefills``); the tokens past
    those (FULL-graph padding) have slot -1 (vLLM's ``PAD_SLOT_ID``), skipped; and requests never share a page:
    pages are shared only through prefix caching, which the backend refuses (``backend.runtime``). Host-side, from
    the step's layout alone: static per captured graph (vLLM captures FULL graphs of one-token decodes only)."""
    return not st.prefills


def build_step(query_start_loc: torch.Tensor, query_start_loc_cpu: list[int], seq_lens: torch.Tensor,
               seq_lens_cpu: list[int], block_table: torch.Tensor, slot_mapping: torch.Tensor, num_tokens: int,
               rows: list[int], recent_state: torch.Tensor, s: Int2Settings,
               prefilling: torch.Tensor | None = None) -> Step:
    """Derive a :class:`Step`; advances ``recent_state`` (int32 ``[rows + 1, 2]``, see
    :func:`~oscar_cli.vllm.layout.advance_recent`; its last row is the scratch row) in place. ``prefilling``: vLLM's
    ``is_prefilling`` (bool ``[R]``).

    Call it once per engine step, not per layer: the recent length is per-sequence state.
    """
    nd = split_decodes(query_start_loc_cpu)
    rows_dev = torch.tensor(rows, dtype=torch.int64).to(seq_lens.device, non_blocking=True)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    pre = None if prefilling is None else prefilling[: len(rows)].to(seq_lens.device, non_blocking=True)
    recent = advance_recent(recent_state, rows_dev, q_lens, seq_lens, s, pre)
    req, pos = token_positions(query_start_loc, seq_lens, int(slot_mapping.shape[0]))
    sink_len, hist_len = decode_lengths(seq_lens, recent, s.sink)
    prefills = [(i, query_start_loc_cpu[i], query_start_loc_cpu[i + 1], seq_lens_cpu[i])
                for i in range(nd, len(seq_lens_cpu)) if query_start_loc_cpu[i + 1] > query_start_loc_cpu[i]]
    tiers = tier_write_index(req, pos, slot_mapping, seq_lens, rows_dev, s, int(recent_state.shape[0]) - 1)
    return Step(num_tokens, nd, seq_lens, block_table, slot_mapping, rows_dev, list(rows), req, pos, recent, sink_len, hist_len,
                ring_gather_index(seq_lens, recent, s.ring), *tiers, prefills)


def masked_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, scale: float) -> torch.Tensor:
    """Reference :data:`Attend` in float32 (GQA by contiguous head groups)."""
    n, h_q = q.shape[:2]
    t = k.shape[0]
    g = h_q // k.shape[1]
    mask = torch.arange(t, device=q.device)[None, :] <= (offset + torch.arange(n, device=q.device))[:, None]
    qq = q.float().transpose(0, 1)  # [H_q, n, D]
    kk = k.float().transpose(0, 1).repeat_interleave(g, 0)
    vv = v.float().transpose(0, 1).repeat_interleave(g, 0)
    s = (qq @ kk.transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    return (p @ vv).transpose(0, 1)


Tiers = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # sink_k, sink_v, ring_k, ring_v

# The Triton rotation (``ops.rotate_kv``) serves batches of up to this many tokens, cuBLAS (torch) larger ones. On an
# H200 cuBLAS runs ``x.float() @ R`` for one decode token with a float32 GEMM tile that took 51.6 µs per call (plus
# two casts). With the launcher's tiles (16 rows per program up to 64 tokens, 32 above: a 64-row tile spilled), on
# an H100 (scripts/gpu_write_bench.py --ops rotate_kv,torch_rotate, K and V together, CUDA-graph replay; docs/VLLM.md,
# "The K/V rotation by row count"): ops.rotate_kv 7.1 / 8.1 / 20.9 / 29.7 / 56.5 / 101.8 µs at 64 / 80 / 512 / 1,024 /
# 2,048 / 4,096 tokens against torch's 18.1 / 18.0 / 24.6 / 34.2 / 58.5 / 102.3 µs. Not measured above 4,096 tokens
# (prefill chunks that large rotate with cuBLAS).
ROTATE_TRITON_MAX_ROWS = 4096

# A decode step of at least this many requests reads the BF16 tiers in place (no tier gather) unless
# ``OSCAR_VLLM_DIRECT_TIERS`` says otherwise. Measured on an H100 (docs/VLLM.md, "Where the tiers are read: the
# crossing by batch"; one layer's step, CUDA graphs, scripts/gpu_layer_step_bench.py): the fused gather is faster at
# 4 x 32K (57.2 against 59.6 us per layer), 2 x 128K (80.8 / 81.4) and 8 x 4K (40.0 / 40.0 with the tier rows not
# prefetched); in place is faster from 8 x 32K on (84.5 against 91.1 us; 12: 149.0 / 162.1; 16: 156.7 / 177.1),
# at 4 x 128K (142.7 / 149.6) and 32 x 4K (92.9 / 121.8), and at 73 x 32K in the engine (29.17 against 30.95 ms
# per step). 6 x 32K is a tie (73.8 / 74.4). The choice is per batch size (one CUDA graph each), so 8.
DIRECT_TIERS_FROM_BATCH = 8


def direct_tiers_for(setting: bool | None, num_decodes: int) -> bool:
    """Whether a decode step of ``num_decodes`` requests reads the tiers in place: ``setting`` True or False forces
    it (``OSCAR_VLLM_DIRECT_TIERS=1`` / ``0``); None (unset) chooses by batch: from
    :data:`DIRECT_TIERS_FROM_BATCH` requests on. A CUDA graph is captured per batch size, so each graph holds one
    path."""
    return setting if setting is not None else num_decodes >= DIRECT_TIERS_FROM_BATCH


def rotates_in_torch(num_tokens: int, forced: bool) -> bool:
    """Whether a batch of ``num_tokens`` is rotated by torch (cuBLAS) rather than ``ops.rotate_kv``: above
    :data:`ROTATE_TRITON_MAX_ROWS`, or always when ``forced`` (``OSCAR_VLLM_TORCH_ROTATE=1``)."""
    return forced or num_tokens > ROTATE_TRITON_MAX_ROWS


def torch_rotate(x: torch.Tensor, r: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [N, H_kv, D] @ R`` (``[D, D]`` or per head ``[H_kv, D, D]``) in float32, cast to ``dtype`` (cuBLAS)."""
    y = x.float() @ r if r.dim() == 2 else torch.einsum("nhd,hde->nhe", x.float(), r)
    return y.to(dtype)


def torch_history(k_pages: QuantizedRows, v_pages: QuantizedRows, blocks: torch.Tensor, start: int,
                  k_mean: torch.Tensor, v_mean: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor,
                  piece: int = 4096, k_low: torch.Tensor | None = None) -> None:
    """The torch twin of ``ops.dequantize_history``: positions ``start .. start + len(k_out)`` (``start``
    page-aligned) of the sequence whose pages are ``blocks`` (its block-table row) into ``k_out``/``v_out``
    ``[T, H_kv, D]``, ``float32(zero) + code * float32(scale)`` per group of ``G``, ``+ mean`` (float32 ``[H_kv, D]`` or ``[D]``), cast
    to the outputs' dtype; ``piece`` tokens at a time (float32 only per piece; about 15 device ops each).
    ``k_low``: INT4 keys' low plane (paged like the key codes): keys by formula 9."""
    p, d, h_kv = int(k_pages.packed.shape[2]), int(k_out.shape[-1]), int(k_out.shape[1])
    n = int(k_out.shape[0])
    per = max(1, piece // p)
    for a in range(0, -(-n // p), per):
        ids = blocks[start // p + a: start // p + min(a + per, -(-n // p))].long()
        t0, t1 = a * p, min(n, (a + per) * p)

        def tokens(x: torch.Tensor, m: int = t1 - t0) -> torch.Tensor:  # [pages, H, P, C] -> [m, H, C]
            return x.permute(0, 2, 1, 3).reshape(-1, h_kv, x.shape[-1])[:m]

        if k_low is None:
            k = dequantize_int2(tokens(k_pages.packed[ids]), tokens(k_pages.scale[ids]), tokens(k_pages.zero[ids]))
        else:
            k = dequantize_int4_planes(unpack_int2(tokens(k_pages.packed[ids])), unpack_int2(tokens(k_low[ids])),
                                       tokens(k_pages.scale[ids]), tokens(k_pages.zero[ids]))
        codes = unpack_token_quads(v_pages.packed[ids], p, d)  # [pages, H, P, D]
        v = dequantize_codes(tokens(codes), tokens(v_pages.scale[ids]), tokens(v_pages.zero[ids]))
        k_out[t0:t1] = (k + k_mean).to(k_out.dtype)
        v_out[t0:t1] = (v + v_mean).to(v_out.dtype)


def write_int4_keys(x: torch.Tensor, pages: QuantizedRows, low: torch.Tensor, slots: torch.Tensor,
                    mean: torch.Tensor) -> None:
    """INT4 keys (formula 9) of rotated rows ``x [N, H_kv, D]``, centred by ``mean`` (``[H_kv, D]``, or one per row
    ``[N, H_kv, D]``), into the pages at ``slots`` (int64 ``[N]``): the high plane with its scale and zero into
    ``pages``, the low plane into ``low`` (paged like the key codes), in torch: the twin of
    ``ops.quantize_write(low_plane=...)``. The reference's ``quantize_rows_int4`` computes them (what the
    transformers cache stores). Rows with a negative slot (padding) go to slot 0, in vLLM's null block 0, which no
    request reads: the write stays free of host syncs."""
    m = mean.transpose(0, 1) if mean.dim() == 3 else mean  # the reference's rows layout: [H_kv, N, D]
    qk, lo = quantize_rows_int4(x.transpose(0, 1), None, m, None, pages.scale.dtype)
    p = int(pages.packed.shape[2])
    at = torch.where(slots >= 0, slots, torch.zeros_like(slots))
    blk, off = at // p, at % p
    pages.packed[blk, :, off] = qk.packed.transpose(0, 1)
    pages.scale[blk, :, off] = qk.scale.transpose(0, 1)
    pages.zero[blk, :, off] = qk.zero.transpose(0, 1)
    low[blk, :, off] = lo.transpose(0, 1)


class TorchTiers:
    """The K/V rotation, the BF16 tier copies and the prefill's history in torch (the twin of ``ops.rotate_kv``,
    ``ops.tier_write``, ``ops.tier_gather`` and ``ops.dequantize_history``: matmuls, index assignments, gathers,
    bit operations and casts, several device ops each); kernel twins of tests inherit it."""

    def rotate_kv(self, k: torch.Tensor, v: torch.Tensor, r_k: torch.Tensor, r_v: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return torch_rotate(k, r_k, dtype), torch_rotate(v, r_v, dtype)

    def quantize_write_int4(self, x: torch.Tensor, cache: QuantizedRows, low: torch.Tensor, slots: torch.Tensor,
                            mean: torch.Tensor) -> None:
        write_int4_keys(x, cache, low, slots, mean)

    def tier_write(self, kr: torch.Tensor, vr: torch.Tensor, tiers: Tiers, sink_row: torch.Tensor,
                   sink_pos: torch.Tensor, ring_row: torch.Tensor, ring_slot: torch.Tensor) -> None:
        sink_k, sink_v, ring_k, ring_v = tiers
        sink_k[sink_row, :, sink_pos] = kr
        sink_v[sink_row, :, sink_pos] = vr
        ring_k[ring_row, :, ring_slot] = kr
        ring_v[ring_row, :, ring_slot] = vr

    def tier_gather(self, tiers: Tiers, rows: torch.Tensor, ring_index: torch.Tensor, k_mean: torch.Tensor,
                    v_mean: torch.Tensor, out: Tiers | None, query: object | None = None) -> Tiers:
        """``query``: an ``ops.GatherQuery``, its ``out`` written as ``(q @ R_K) · qk_scale`` (float32 product,
        rounded once to ``q``'s dtype)."""
        sink_k, sink_v, ring_k, ring_v = tiers
        if query is not None:
            q, r = query.q.float(), query.rotation.float()  # type: ignore[attr-defined]
            b, hq, d = q.shape
            rq = q @ r if r.dim() == 2 else torch.einsum(
                "bhgd,hde->bhge", q.view(b, r.shape[0], hq // r.shape[0], d), r).reshape(b, hq, d)
            query.out.copy_((rq * query.qk_scale).to(query.out.dtype))  # type: ignore[attr-defined]

        def centred(x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
            return (x.float() - mean[None, :, None, :]).to(sink_k.dtype).contiguous()

        got = (centred(sink_k[rows], k_mean), centred(sink_v[rows], v_mean),
               centred(ring_k[rows[:, None], :, ring_index].permute(0, 2, 1, 3), k_mean),
               centred(ring_v[rows[:, None], :, ring_index].permute(0, 2, 1, 3), v_mean))
        if out is None:
            return got
        for o, g in zip(out, got, strict=True):
            o.copy_(g)
        return out

    def history(self, k_pages: QuantizedRows, v_pages: QuantizedRows, blocks: torch.Tensor, start: int,
                k_mean: torch.Tensor, v_mean: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor,
                piece: int, k_low: torch.Tensor | None = None) -> None:
        torch_history(k_pages, v_pages, blocks, start, k_mean, v_mean, k_out, v_out, piece, k_low)


class TritonKernels:
    """The kernel entry points the layer uses (``oscar_kernels.ops``); tests may pass a torch twin. ``pdl``:
    overrides the decode config's programmatic dependent launches (None: the config's choice); ``torch_rotate``:
    every K/V rotation in torch (cuBLAS), not only those above :data:`ROTATE_TRITON_MAX_ROWS` tokens;
    ``fused_write``: a step's K pages, V pages and tiers in one launch (:meth:`write_step`; the engine's default,
    ``OSCAR_VLLM_FUSED_WRITE=0`` turns it off); ``fused_gather``: the decode's query rotation in the tier gather's
    launch (:meth:`tier_gather` with a query, :meth:`decode` with ``q_rot``; the engine's default,
    ``OSCAR_VLLM_FUSED_GATHER=0`` turns it off);
    ``direct_tiers``: no gather at all: the decode's stage 1 reads the tiers in place (``ops.TierIndex``) and the
    query rotation runs in the K/V rotation's launch (:meth:`rotate_kv` with a query, when the batch is rotated by
    the kernel): True always (``OSCAR_VLLM_DIRECT_TIERS=1``), False never (``=0``), None (the engine's default)
    for decode steps of :data:`DIRECT_TIERS_FROM_BATCH` requests or more (:meth:`direct_for`)."""

    def __init__(self, decode_config: object | None = None, pdl: bool | None = None,
                 torch_rotate: bool = False, fused_write: bool = True, fused_gather: bool = True,
                 direct_tiers: bool | None = False) -> None:
        self.config = decode_config
        self.pdl = pdl
        self.torch_rotate = torch_rotate
        self.fused_write = fused_write
        self.fused_gather = fused_gather
        self.direct_tiers = direct_tiers

    def direct_for(self, num_decodes: int) -> bool:
        """Whether a step with ``num_decodes`` decode requests reads the tiers in place (:func:`direct_tiers_for`)."""
        return direct_tiers_for(self.direct_tiers, num_decodes)

    def rotates_query(self, num_tokens: int, num_decodes: int) -> bool:
        """Whether :meth:`rotate_kv` of a ``num_tokens`` batch with ``num_decodes`` decodes takes the decode's query
        rotation (:meth:`direct_for` the decodes, and the batch rotated by ``ops.rotate_kv``, not cuBLAS)."""
        return self.direct_for(num_decodes) and not rotates_in_torch(num_tokens, self.torch_rotate)

    def write_step(self, kr: torch.Tensor, vr: torch.Tensor, k_pages: QuantizedRows, v_pages: QuantizedRows,
                   slots: torch.Tensor, k_mean: torch.Tensor, k_clip: float, v_mean: torch.Tensor, v_clip: float,
                   tiers: Tiers, tier_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                   exclusive_words: bool, k_low: torch.Tensor | None, num_decodes: int = 1) -> None:
        """The K write, the V write and the tier write in one launch (``ops.write_step``: the bytes of
        :meth:`quantize_write` / :meth:`quantize_write_int4` and :meth:`tier_write`). When the step's
        ``num_decodes`` decodes read the tiers in place (:meth:`direct_for`) the decode's stage 1 comes next: the
        launch lets it start early (PDL), as the decode's own first launch does."""
        from oscar_kernels import ops

        pdl = self.direct_for(num_decodes) and (self.pdl if self.pdl is not None
                                                else bool(getattr(self.config, "pdl", True)))
        ops.write_step(kr, vr, k_pages, v_pages, slots, tiers, *tier_index, k_mean=k_mean, v_mean=v_mean,
                       k_clip=0.0 if k_low is not None else k_clip, v_clip=v_clip, exclusive_words=exclusive_words,
                       k_low=k_low, pdl=pdl)

    def rotate_kv(self, k: torch.Tensor, v: torch.Tensor, r_k: torch.Tensor, r_v: torch.Tensor,
                  dtype: torch.dtype, query: object | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``query``: an ``ops.GatherQuery`` rotated in the same launch (only when :meth:`rotates_query`)."""
        if rotates_in_torch(int(k.shape[0]), self.torch_rotate):
            if query is not None:
                raise ValueError(f"rotate_kv: a query with a batch of {int(k.shape[0])} tokens rotated by torch")
            return torch_rotate(k, r_k, dtype), torch_rotate(v, r_v, dtype)
        from oscar_kernels import ops

        return ops.rotate_kv(k, v, r_k, r_v, dtype=dtype, query=query)  # type: ignore[arg-type]

    def quantize_write(self, x: torch.Tensor, cache: QuantizedRows, slots: torch.Tensor, mean: torch.Tensor,
                       clip: float, layout: str, exclusive_words: bool = False) -> None:
        from oscar_kernels import ops

        ops.quantize_write(x, cache, slots, mean=mean, clip_ratio=clip, layout=layout, exclusive_words=exclusive_words)

    def quantize_write_int4(self, x: torch.Tensor, cache: QuantizedRows, low: torch.Tensor, slots: torch.Tensor,
                            mean: torch.Tensor) -> None:
        """INT4 keys: both planes, scale and zero in one launch (no clip; formula 9)."""
        from oscar_kernels import ops

        ops.quantize_write(x, cache, slots, mean=mean, low_plane=low)

    def tier_write(self, kr: torch.Tensor, vr: torch.Tensor, tiers: Tiers, sink_row: torch.Tensor,
                   sink_pos: torch.Tensor, ring_row: torch.Tensor, ring_slot: torch.Tensor) -> None:
        from oscar_kernels import ops

        ops.tier_write(kr, vr, *tiers, sink_row, sink_pos, ring_row, ring_slot)

    def tier_gather(self, tiers: Tiers, rows: torch.Tensor, ring_index: torch.Tensor, k_mean: torch.Tensor,
                    v_mean: torch.Tensor, out: Tiers | None, query: object | None = None) -> Tiers:
        """``query``: an ``ops.GatherQuery``, the decode's query rotation in the same launch (which then lets the
        decode's stage 1 start early when the decode config uses programmatic dependent launches, as the decode's
        own rotation kernel does)."""
        from oscar_kernels import ops

        if query is None:
            return ops.tier_gather(*tiers, rows, ring_index, k_mean, v_mean, out=out)
        pdl = self.pdl if self.pdl is not None else bool(getattr(self.config, "pdl", True))
        return ops.tier_gather(*tiers, rows, ring_index, k_mean, v_mean, out=out, query=query,  # type: ignore[arg-type]
                               pdl=pdl)

    def history(self, k_pages: QuantizedRows, v_pages: QuantizedRows, blocks: torch.Tensor, start: int,
                k_mean: torch.Tensor, v_mean: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor,
                piece: int, k_low: torch.Tensor | None = None) -> None:
        """``ops.dequantize_history``: one launch for the whole range (``piece`` is the torch twin's); ``k_low``:
        INT4 keys' low plane."""
        from oscar_kernels import ops

        ops.dequantize_history(k_pages, v_pages, blocks, start, k_out, v_out, k_mean, v_mean, k_low=k_low)

    def decode(self, q: torch.Tensor, k_pages: QuantizedRows, v_pages: QuantizedRows, table: torch.Tensor,
               hist_len: torch.Tensor, sink: tuple[torch.Tensor, torch.Tensor], sink_len: torch.Tensor,
               recent: tuple[torch.Tensor, torch.Tensor], recent_len: torch.Tensor, t: LayerTensors, scale: float,
               out: torch.Tensor | None, rope: object | None = None, low: torch.Tensor | None = None,
               q_rot: torch.Tensor | None = None, tier_index: object | None = None) -> torch.Tensor:
        """``rope``: an ``ops.RopeMean`` (keys centred by position: stage 1 adds their logit term); ``low``: INT4
        keys' low plane, paged like the key codes (``ops.LowPlane(low)``); ``q_rot``: the queries already rotated
        and scaled (:meth:`tier_gather`'s or :meth:`rotate_kv`'s query): two launches instead of three;
        ``tier_index``: an ``ops.TierIndex``, the tiers (``sink``, ``recent``) read in place."""
        from oscar_kernels import ops

        cfg = self.config or ops.default_config(int(q.shape[0]), rope_mean=rope is not None)
        if self.pdl is not None:
            cfg = replace(cfg, pdl=self.pdl)  # type: ignore[type-var]
        return ops.DecodePlan(q, k_pages, v_pages, table, hist_len, sink[0], sink[1], sink_len, recent[0], recent[1],
                              recent_len, rotation_k=t.k_rotation, rotation_v=t.v_rotation, mean_v=t.v_mean,
                              sm_scale=scale, config=cfg, out=out, rope_mean=rope,  # type: ignore[arg-type]
                              low_plane=None if low is None else ops.LowPlane(low), q_rot=q_rot,
                              tier_index=tier_index).run()  # type: ignore[arg-type]


_GATHERED: dict[tuple[object, ...], Tiers] = {}
_SHARED_ROPE: dict[tuple[object, ...], tuple[torch.Tensor, RopeFrequencies]] = {}


def shared_rope(rope: RopeFrequencies, device: torch.device) -> tuple[torch.Tensor, RopeFrequencies]:
    """``(ops.position_table over rope's positions, rope with its frequencies on device)``, built once per engine and
    device and shared by all layers (64 MB at 128K positions, D = 128), at fixed addresses (CUDA graphs; the
    frequencies on the device: a per-step host-to-device copy would break graph capture). One object for every
    layer, so the step's table rows are shared too (``Step.rope_rows``)."""
    key = (str(device), rope.positions, rope.scaling, tuple(rope.inv_freq.tolist()))
    if key not in _SHARED_ROPE:
        from oscar_kernels.rope_ops import position_table

        _SHARED_ROPE[key] = (position_table(rope.inv_freq, max(rope.positions, 128), device),
                             replace(rope, inv_freq=rope.inv_freq.to(device)))
    return _SHARED_ROPE[key]


def gather_buffers(rows: int, h_kv: int, sink: int, ring: int, d: int, dtype: torch.dtype,
                   device: torch.device) -> Tiers:
    """The decode's centred tier inputs for up to ``rows`` sequences: ``(sink_k, sink_v, recent_k, recent_v)``
    ``[rows, H_kv, S or R, D]``, allocated once per shape and device and shared by all layers (a layer's gather
    overwrites them only after the previous layer's decode has read them: one stream), at fixed addresses (CUDA
    graphs)."""
    key = (str(device), dtype, rows, h_kv, sink, ring, d)
    if key not in _GATHERED:
        sk, sv = (torch.empty(rows, h_kv, sink, d, dtype=dtype, device=device) for _ in range(2))
        rk, rv = (torch.empty(rows, h_kv, ring, d, dtype=dtype, device=device) for _ in range(2))
        _GATHERED[key] = (sk, sv, rk, rv)
    return _GATHERED[key]


class PagedInt2Layer:
    """One attention layer of the INT2 backend: transforms, BF16 tiers ``[rows + 1, H_kv, T, D]`` (the last row is
    scratch for padding tokens), and the write / decode / prefill operations."""

    def __init__(self, tensors: LayerTensors, s: Int2Settings, num_rows: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, block_size: int, act_dtype: torch.dtype, device: torch.device | str,
                 sm_scale: float | None = None, kernels: TritonKernels | None = None,
                 rope: RopeFrequencies | None = None, key_bits: int = 2) -> None:
        if key_bits not in (2, 4):
            raise ValueError(f"key_bits must be 2 or 4, got {key_bits}")
        self.key_bits = key_bits  # 4: INT4 keys, the low plane in the layer's pages (forward's k_low)
        self.t = tensors.to(device)
        self.rope = rope if self.t.k_mean_pre is not None else None
        if self.t.k_mean_pre is not None and rope is None:
            raise ValueError("a layer with keys centred by position (k_mean_pre) needs the model's RopeFrequencies")
        self.s = s
        self.h_q, self.h_kv, self.d, self.block_size = num_heads, num_kv_heads, head_dim, block_size
        self.group = num_heads // num_kv_heads
        self.act = act_dtype
        self.scale = head_dim ** -0.5 if sm_scale is None else sm_scale
        self.kernels = kernels or TritonKernels()
        self.scratch = num_rows
        shape = (num_rows + 1, num_kv_heads)
        self.sink_k = torch.zeros(*shape, max(s.sink, 1), head_dim, dtype=act_dtype, device=device)
        self.sink_v = torch.zeros_like(self.sink_k)
        self.ring_k = torch.zeros(*shape, max(s.ring, 1), head_dim, dtype=act_dtype, device=device)
        self.ring_v = torch.zeros_like(self.ring_k)
        self.tiers: Tiers = (self.sink_k, self.sink_v, self.ring_k, self.ring_v)
        self.gathered = gather_buffers(num_rows, num_kv_heads, int(self.sink_k.shape[2]), int(self.ring_k.shape[2]),
                                       head_dim, act_dtype, self.sink_k.device)
        if self.rope is not None:  # the decode's term: history slot n of every row sits at position S0 + n
            from oscar_kernels.rope_ops import rope_mean_matrix

            self.position_table, self.rope = shared_rope(self.rope, self.sink_k.device)
            self.first_position = torch.full((num_rows,), s.sink, dtype=torch.int32, device=self.sink_k.device)
            assert self.t.k_mean_pre is not None
            m = rope_mean_matrix(self.t.k_mean_pre, self.t.k_rotation, self.rope.scaling)  # [H_kv, D, D]
            # [D, H_kv·D]: a key mean is table row @ this, viewed [H_kv, D] (key_means)
            self.rope_matrix = m.permute(1, 0, 2).reshape(head_dim, num_kv_heads * head_dim).to(self.sink_k.device)

    # ------------------------------------------------------------------ transforms
    def rotate(self, key: torch.Tensor, value: torch.Tensor, q: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``key @ R_K``, ``value @ R_V`` (``[N, H_kv, D]``, any row strides) in float32, cast to the activation dtype
        (what the reference cache stores): ``kernels.rotate_kv``. ``q``: the step's decode queries ``[B, H_q, D]``;
        when the kernels take them in the same launch (``direct_tiers``), the third result is their rotation
        for :meth:`decode` (else None: the decode rotates them itself)."""
        rotates_query = getattr(self.kernels, "rotates_query", None)
        if q is None or not q.shape[0] or rotates_query is None or not rotates_query(int(key.shape[0]),
                                                                                      int(q.shape[0])):
            kr, vr = self.kernels.rotate_kv(key, value, self.t.k_rotation, self.t.v_rotation, self.act)
            return kr, vr, None
        from oscar_kernels.ops import GatherQuery, query_scale

        q_rot = torch.empty_like(q)
        query = GatherQuery(q, self.t.k_rotation, q_rot, query_scale(self.scale, self.d))
        kr, vr = self.kernels.rotate_kv(key, value, self.t.k_rotation, self.t.v_rotation, self.act,
                                        query=query)  # type: ignore[call-arg]
        return kr, vr, q_rot

    def key_means(self, pos: torch.Tensor, st: Step | None = None) -> torch.Tensor:
        """``a·RoPE_p(k_mean_pre)·R_K`` float32 ``[n, H_kv, D]`` for int64 positions ``pos [n]`` (keys centred by
        position; ``a`` the attention scaling) as one GEMM: the positions' rows of the shared position table
        (``[cos θp | sin θp]`` from float64 angles) times :attr:`rope_matrix`
        (``oscar_kernels.rope_ops.rope_mean_matrix``, the layer's mean and rotation folded together in float64).
        The reference cache computes the same float64 definition as RoPE then a rotation
        (``oscar_cli.quant.key_mean.position_means``): the two agree to float32 rounding (``tests/test_vllm_logic.py``),
        and this takes one device op per layer where that took ten. ``st``: ``pos`` are that step's new tokens, whose
        table rows every layer shares (``Step.rope_rows``: gathered once per step)."""
        assert self.rope is not None
        key = (id(self.position_table), int(pos.shape[0]))
        rows = st.rope_rows.get(key) if st is not None else None
        if rows is None:
            rows = self.position_table[pos.clamp(0, int(self.position_table.shape[0]) - 1)]
            if st is not None:
                st.rope_rows[key] = rows
        return (rows @ self.rope_matrix).view(-1, self.h_kv, self.d)

    def _low(self, k_low: torch.Tensor | None) -> torch.Tensor | None:
        """The low plane a call got, checked against the layer's key bits (INT4 layers need it, INT2 ones take none)."""
        if (k_low is not None) != (self.key_bits == 4):
            raise ValueError(f"a layer with {self.key_bits}-bit keys got {'a' if k_low is not None else 'no'} low plane")
        return k_low

    def _per_q_head(self, r: torch.Tensor) -> torch.Tensor:
        return r.expand(self.h_kv, -1, -1).repeat_interleave(self.group, 0) if r.dim() == 2 else \
            r.repeat_interleave(self.group, 0)

    # ------------------------------------------------------------------ write
    def write(self, kr: torch.Tensor, vr: torch.Tensor, k_pages: QuantizedRows, v_pages: QuantizedRows,
              st: Step, k_low: torch.Tensor | None = None) -> None:
        """Store rotated rows ``kr``/``vr`` ``[N, H_kv, D]`` (from :meth:`rotate`): INT2 into the pages at
        ``st.slot_mapping`` (negative: skipped), BF16 into the sink / ring rows of their requests.

        V token quads of a decode-only step (:func:`decode_only`) are written without atomics
        (``exclusive_words``): its rows are one token per request, each in the request's own last page, and the
        padding rows are skipped; a static choice per captured graph (those are decode-only). Other steps keep
        the shared-word atomics (a prefill chunk's tokens share words). INT4 keys (``k_low``, the layer's low
        plane): ``kernels.quantize_write_int4``."""
        n = int(kr.shape[0])
        slots = st.slot_mapping[:n]
        k_mean = self.t.k_mean if self.rope is None else self.key_means(st.pos[:n], st)  # one mean per row: rope
        if getattr(self.kernels, "fused_write", False):  # the three launches below in one (the same bytes)
            self.kernels.write_step(kr, vr, k_pages, v_pages, slots, k_mean, self.t.k_clip, self.t.v_mean,
                                    self.t.v_clip, self.tiers, (st.sink_row[:n], st.sink_pos[:n], st.ring_row[:n],
                                                                st.ring_slot[:n]),
                                    decode_only(st), self._low(k_low), num_decodes=st.num_decodes)
            return
        if self._low(k_low) is not None:
            assert k_low is not None
            self.kernels.quantize_write_int4(kr, k_pages, k_low, slots, k_mean)
        else:
            self.kernels.quantize_write(kr, k_pages, slots, k_mean, self.t.k_clip, "rows")
        self.kernels.quantize_write(vr, v_pages, slots, self.t.v_mean, self.t.v_clip, "token_quads",
                                    exclusive_words=decode_only(st))
        self.kernels.tier_write(kr, vr, self.tiers, st.sink_row[:n], st.sink_pos[:n], st.ring_row[:n],
                                st.ring_slot[:n])

    # ------------------------------------------------------------------ decode

    def decode(self, q: torch.Tensor, k_pages: QuantizedRows, v_pages: QuantizedRows, st: Step,
               out: torch.Tensor | None = None, k_low: torch.Tensor | None = None,
               q_rot: torch.Tensor | None = None) -> torch.Tensor:
        """``q [B, H_q, D]`` (post-RoPE, unrotated) of the step's ``B = st.num_decodes`` first requests -> attention
        output ``[B, H_q, D]`` in the model's space. ``q_rot``: ``q`` rotated and scaled already (:meth:`rotate`'s
        third result). When ``kernels.direct_for(B)`` the decode reads the tiers in place (no gather launch)."""
        b = int(q.shape[0])
        table = st.block_table[:b, self.s.sink // self.block_size:]
        rope = None
        if self.rope is not None:
            from oscar_kernels.ops import RopeMean

            assert self.t.k_mean_pre is not None
            rope = RopeMean(self.t.k_mean_pre, self.position_table, self.first_position[:b], self.rope.scaling)
        direct_for = getattr(self.kernels, "direct_for", None)
        if direct_for is not None and direct_for(b):
            from oscar_kernels.ops import TierIndex

            index = TierIndex(st.rows[:b], st.ring_index[:b], self.t.k_mean, self.t.v_mean)
            return self.kernels.decode(q, k_pages, v_pages, table, st.hist_len[:b], (self.sink_k, self.sink_v),
                                       st.sink_len[:b], (self.ring_k, self.ring_v), st.recent_len[:b], self.t,
                                       self.scale, out, rope, low=self._low(k_low), q_rot=q_rot,
                                       tier_index=index)  # type: ignore[call-arg]
        g = self.gathered
        bufs = (g[0][:b], g[1][:b], g[2][:b], g[3][:b]) if b <= self.scratch else None
        q_rot = None
        extra: dict[str, object] = {}
        if getattr(self.kernels, "fused_gather", False):  # the decode's q rotation in the gather's launch
            from oscar_kernels.ops import GatherQuery, query_scale

            q_rot = torch.empty_like(q)
            extra["query"] = GatherQuery(q, self.t.k_rotation, q_rot, query_scale(self.scale, self.d))
        sink_k, sink_v, rec_k, rec_v = self.kernels.tier_gather(self.tiers, st.rows[:b], st.ring_index[:b],
                                                                self.t.k_mean, self.t.v_mean, bufs, **extra)
        return self.kernels.decode(q, k_pages, v_pages, table, st.hist_len[:b], (sink_k, sink_v), st.sink_len[:b],
                                   (rec_k, rec_v), st.recent_len[:b], self.t, self.scale, out, rope,
                                   low=self._low(k_low), **({"q_rot": q_rot} if q_rot is not None else {}))

    # ------------------------------------------------------------------ prefill
    def history(self, k_pages: QuantizedRows, v_pages: QuantizedRows, blocks: torch.Tensor, start: int,
                k_out: torch.Tensor, v_out: torch.Tensor, piece: int = 4096, k_low: torch.Tensor | None = None) -> None:
        """Dequantize positions ``start .. start + len(k_out)`` of the sequence whose pages are ``blocks`` (int32, its
        block-table row; ``start`` page-aligned) into ``k_out``/``v_out`` ``[T, H_kv, D]`` (activation dtype, rotated,
        mean added back: what the reference cache's view holds): ``kernels.history`` (``ops.dequantize_history``,
        one launch; the torch twin :func:`torch_history` goes ``piece`` tokens at a time). INT4 keys: ``k_low``, the
        layer's low plane, read with the high plane."""
        self.kernels.history(k_pages, v_pages, blocks, start, self.t.k_mean, self.t.v_mean, k_out, v_out, piece,
                             k_low=self._low(k_low))

    def prefill(self, q: torch.Tensor, kr: torch.Tensor, vr: torch.Tensor, k_pages: QuantizedRows,
                v_pages: QuantizedRows, st: Step, attend: Attend = masked_attend,
                k_low: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Attention of each prefill chunk of ``st.prefills`` (``q``/``kr``/``vr`` are the whole batch's tokens);
        returns one ``[n, H_q, D]`` output per chunk, in the model's space. Each chunk's keys and values (sink,
        dequantized history, itself) are assembled in one transient ``[c + n, H_kv, D]`` buffer each."""
        if not st.prefills:  # (a decode-only step: not even the per-query-head rotations)
            return []
        rk = self._per_q_head(self.t.k_rotation)  # [H_q, D, D]
        rv_t = self._per_q_head(self.t.v_rotation).transpose(-1, -2)
        s0 = self.s.sink
        outs = []
        for i, qs, qe, seq_len in st.prefills:
            n = qe - qs
            c = seq_len - n
            row = st.rows_host[i]
            k_all = torch.empty(seq_len, self.h_kv, self.d, dtype=self.act, device=kr.device)
            v_all = torch.empty_like(k_all)
            ns = min(c, s0)
            k_all[:ns] = self.sink_k[row, :, :ns].transpose(0, 1)
            v_all[:ns] = self.sink_v[row, :, :ns].transpose(0, 1)
            if c > s0:
                self.history(k_pages, v_pages, st.block_table[i], s0, k_all[s0:c], v_all[s0:c], k_low=k_low)
                if self.rope is not None:  # the history came back centred (k_mean is zero): add each position's mean
                    for a in range(s0, c, 8192):
                        e = min(c, a + 8192)
                        pos = torch.arange(a, e, dtype=torch.int64, device=k_all.device)
                        k_all[a:e] = (k_all[a:e].float() + self.key_means(pos)).to(k_all.dtype)
            k_all[c:] = kr[qs:qe]
            v_all[c:] = vr[qs:qe]
            qr = torch.einsum("nhd,hde->nhe", q[qs:qe].float(), rk).to(self.act)
            o = attend(qr, k_all, v_all, c, self.scale)  # rotated value space
            outs.append(torch.einsum("nhd,hde->nhe", o.float(), rv_t).to(self.act))
        return outs

    # ------------------------------------------------------------------ one step
    def forward(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pages: QuantizedRows,
                v_pages: QuantizedRows, st: Step, out: torch.Tensor, attend: Attend = masked_attend,
                k_low: torch.Tensor | None = None) -> torch.Tensor:
        """The whole layer step: write the batch's ``st.num_tokens`` new tokens, then attention for the decodes
        (first ``st.num_decodes`` tokens, INT2 kernel) and each prefill chunk; fills ``out [N, H_q, D]``.
        ``k_low``: the keys' low plane of a layer with INT4 keys (:func:`oscar_cli.vllm.layout.carve_low_plane`)."""
        n, nd = st.num_tokens, st.num_decodes
        kr, vr, q_rot = self.rotate(key[:n], value[:n], q[:nd])
        self.write(kr, vr, k_pages, v_pages, st, k_low)
        if nd:
            self.decode(q[:nd], k_pages, v_pages, st, out=out[:nd], k_low=k_low, q_rot=q_rot)
        for (_, qs, qe, _), o in zip(st.prefills, self.prefill(q, kr, vr, k_pages, v_pages, st, attend, k_low),
                                     strict=True):
            out[qs:qe] = o
        return out
