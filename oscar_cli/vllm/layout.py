"""Pure-torch glue between vLLM's paged-attention metadata and oscar's INT2 kernels (no vLLM import).

- :func:`layer_tensors`: an ``oscar`` :class:`~oscar_cli.quant.methods.QuantMethod` (from an artifact) -> per layer
  :class:`LayerTensors` in the shapes ``oscar_kernels.ops`` takes (rotations ``[D, D]`` or ``[H_kv, D, D]``, means
  ``[H_kv, D]``, clip ratios); :func:`check_geometry` refuses what the kernels cannot serve, in one line.
- :func:`carve_pages`: one layer's vLLM cache tensor ``uint8 [num_blocks, P, H_kv, slot]`` -> the kernels' paged
  K rows and V token quads plus scale/zero (views of the same memory: nothing is copied).
- :func:`token_positions`, :func:`next_recent_len` / :func:`advance_recent`, :func:`decode_lengths`,
  :func:`ring_gather_index`,
  :func:`tier_write_index`: vLLM's ``query_start_loc`` / ``seq_lens`` / ``slot_mapping`` -> the kernels' lengths
  and the BF16 tiers' indices, as device tensor ops (no host sync: CUDA-graph capturable).
- :func:`host_request_slots` / :func:`rows_from_slots` (vLLM's V2 model runner: its request slots are the tier rows)
  and :class:`SequenceRows` (otherwise: rows keyed by a request's first block): which row of the per-sequence BF16
  tiers a request owns (host side).
"""

from __future__ import annotations

import re
import sys
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from oscar_cli.errors import OscarError, UnsupportedModelError
from oscar_cli.vllm.spec import DEMOTION_BLOCK, FAST_BLOCK_SIZE, fast_pages_fit, ring_tokens
from oscar_kernels.layout import UNIFORM_INNER
from oscar_kernels.reference import QuantizedRows, token_quad_row

KERNEL_HEAD_DIMS = (64, 128)
BLOCK_SIZES = (16, 32, 64)


@dataclass(frozen=True)
class Int2Settings:
    """The artifact's INT2 layout: BF16 sink ``S0``, recent window ``W``, metadata dtype (G = D; 16-bit or formula
    10's uint8), and the layers whose keys are INT4 (recipe ``quant.int4_keys``: the low plane in their pages)."""

    sink: int
    recent: int
    meta_dtype: torch.dtype = torch.bfloat16
    int4_layers: tuple[int, ...] = ()

    @property
    def meta_bytes(self) -> int:
        return torch.empty((), dtype=self.meta_dtype).element_size()

    def key_bits(self, layer: int) -> int:
        return 4 if layer in self.int4_layers else 2

    @property
    def demotion_block(self) -> int:
        return DEMOTION_BLOCK if self.recent > 0 else 1

    @property
    def ring(self) -> int:
        return ring_tokens(self.recent)


@dataclass(frozen=True)
class LayerTensors:
    """One decoder layer's transforms, float32: ``k_rotation``/``v_rotation`` ``[D, D]`` (shared by the KV heads)
    or ``[H_kv, D, D]``, ``k_mean``/``v_mean`` ``[H_kv, D]`` (rotated space), clip ratios (``<= 0``: off), and
    ``k_mean_pre`` ``[H_kv, D]`` (unrotated, pre-RoPE) when keys are centred by position (``quant.key_mean: rope``:
    then ``k_mean`` is zero and every INT2 key at position ``p`` is centred by ``RoPE_p(k_mean_pre)·R_K``)."""

    k_rotation: torch.Tensor
    v_rotation: torch.Tensor
    k_mean: torch.Tensor
    v_mean: torch.Tensor
    k_clip: float
    v_clip: float
    k_mean_pre: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> LayerTensors:
        def mv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device).contiguous()

        return LayerTensors(mv(self.k_rotation), mv(self.v_rotation), mv(self.k_mean), mv(self.v_mean), self.k_clip,
                            self.v_clip, None if self.k_mean_pre is None else mv(self.k_mean_pre))


@dataclass(frozen=True)
class RopeFrequencies:
    """The model's rotary embedding as the position-dependent key mean needs it: ``inv_freq`` float32 ``[D/2]``
    (``rotate_half`` pairing), the attention ``scaling`` multiplying cos/sin (YaRN's factor; 1 for plain RoPE), and
    the ``positions`` the engine serves (its ``max_model_len``: the position table's rows)."""

    inv_freq: torch.Tensor
    scaling: float
    positions: int


STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3")  # frequencies fixed for every length


def rope_frequencies(config: Any, head_dim: int, positions: int) -> RopeFrequencies:
    """:class:`RopeFrequencies` of a Hugging Face ``config`` (what vLLM's ``model_config.hf_config`` is), from
    :func:`oscar_cli.model.rope.rotary_frequencies`. Raises :class:`UnsupportedModelError` for a RoPE whose
    frequencies change with the length (``dynamic``, ``longrope``) or a head dim that is not the rotary dim."""
    from oscar_cli.model.rope import rope_type, rotary_frequencies

    kind = rope_type(config)
    if kind not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(f"{kind} RoPE with a position-dependent key mean (quant.key_mean rope: the "
                                    f"backend supports {', '.join(STATIC_ROPE_TYPES)} RoPE)")
    inv, scaling = rotary_frequencies(config)
    if inv.numel() * 2 != head_dim:
        raise UnsupportedModelError(f"rotary dim {inv.numel() * 2} != head_dim {head_dim} with a position-dependent "
                                    "key mean (quant.key_mean rope)")
    return RopeFrequencies(inv, scaling, int(positions))


def _rotation(r: torch.Tensor | None, h_kv: int, d: int, what: str) -> torch.Tensor:
    if r is None:
        return torch.eye(d, dtype=torch.float32)
    r = r.float()
    if r.dim() == 3 and r.shape[0] == 1:
        r = r[0]
    if tuple(r.shape) not in ((d, d), (h_kv, d, d)):
        raise UnsupportedModelError(f"artifact {what}: shape {tuple(r.shape)}, the model needs [{d}, {d}] or "
                                    f"[{h_kv}, {d}, {d}]")
    return r.contiguous()


def _mean(m: torch.Tensor | None, h_kv: int, d: int, what: str) -> torch.Tensor:
    if m is None:
        return torch.zeros(h_kv, d, dtype=torch.float32)  # vLLM loads under the model dtype as default
    m = m.float()
    if m.dim() == 1:
        m = m.unsqueeze(0)
    if m.shape[-1] != d or m.shape[0] not in (1, h_kv):
        raise UnsupportedModelError(f"artifact {what}: shape {tuple(m.shape)}, the model needs [{h_kv}, {d}]")
    return m.expand(h_kv, d).contiguous()


def layer_tensors(method: object, num_layers: int, num_kv_heads: int, head_dim: int) -> list[LayerTensors]:
    """Per-layer kernel operands of an ``oscar`` method (``QuantMethod`` with ``layers`` of ``LayerTransform``)."""
    layers = getattr(method, "layers", ())
    if len(layers) != num_layers:
        raise UnsupportedModelError(f"artifact has {len(layers)} layers, the model {num_layers}")
    rope = getattr(method, "key_mean", "constant") == "rope"
    out = []
    for i, t in enumerate(layers):
        pre = getattr(t, "k_mean_pre", None)
        if rope and pre is None:
            raise UnsupportedModelError(f"artifact layer {i}: quant.key_mean rope without its k_mean_pre")
        out.append(LayerTensors(
            _rotation(t.k_rotation, num_kv_heads, head_dim, f"layer {i} k_rotation"),
            _rotation(t.v_rotation, num_kv_heads, head_dim, f"layer {i} v_rotation"),
            _mean(None if rope else t.k_mean, num_kv_heads, head_dim, f"layer {i} k_mean"),
            _mean(t.v_mean, num_kv_heads, head_dim, f"layer {i} v_mean"),
            float(t.k_clip), float(t.v_clip),
            _mean(pre, num_kv_heads, head_dim, f"layer {i} k_mean_pre") if rope else None))
    return out


def check_method(method: Any, *, head_dim: int, block_size: int) -> Int2Settings:
    """The INT2 settings of an ``oscar`` method from an artifact (``oscar_from_artifact``), after
    :func:`check_geometry` refused, in one line, whatever of it the backend cannot serve."""
    settings = Int2Settings(sink=method.sink, recent=method.recent, meta_dtype=method.meta_dtype,
                            int4_layers=tuple(int(i) for i in getattr(method, "int4_key_layers", ())))
    check_geometry(head_dim=head_dim, block_size=block_size, settings=settings, group_size=method.group_size,
                   keep_fraction=method.keep_fraction, levels=method.levels,
                   logit_correction=method.logit_correction, key_subspace=method.key_subspace,
                   key_mean=method.key_mean, layer_kinds=tuple(method.layer_kinds))
    return settings


_KIND_NAMES = {"dense": "BF16", "kivi": "KIVI"}


def check_geometry(*, head_dim: int, block_size: int, settings: Int2Settings, group_size: int | None,
                   sliding_window: int | None = None, logits_soft_cap: float | None = None,
                   alibi: bool = False, kv_sharing: bool = False, keep_fraction: float = 0.0,
                   levels: float = UNIFORM_INNER, logit_correction: str = "none", key_subspace: int = 0,
                   key_mean: str = "constant", layer_kinds: tuple[str, ...] = ()) -> None:
    """Refuse (one line, UnsupportedModelError) what the INT2 kernels cannot serve; never fall back to BF16.

    ``layer_kinds``: the storage of each layer when the calibration's per-layer fallback chose another scheme for
    some (``QuantMethod.layer_kinds``: ``int2``, ``kivi``, ``dense``); the backend serves INT2 layers only, and
    serving a BF16 or KIVI layer as INT2 (without its rotation, means and clips) would be silently wrong."""
    reasons = []
    other = {k: [i for i, x in enumerate(layer_kinds) if x == k] for k in dict.fromkeys(layer_kinds) if k != "int2"}
    if other:
        which = "; ".join(f"{_KIND_NAMES.get(k, k)}: layer{'s' if len(v) > 1 else ''} {', '.join(map(str, v))}"
                          for k, v in other.items())
        reasons.append(f"layers the calibration's per-layer fallback serves with another scheme ({which}; "
                       "calibration.layers in the manifest: the backend serves INT2 layers only; serve this artifact "
                       "through transformers, whose cache serves each layer's scheme)")
    if keep_fraction:
        reasons.append(f"a BF16 keep budget (quant.keep.fraction {keep_fraction:g}: the kernels do not read the "
                       "kept tier; serve it through transformers with --backend reference)")
    if levels != UNIFORM_INNER:
        reasons.append(f"non-uniform INT2 levels (quant.levels {levels:g}: the kernels code and decode uniform levels "
                       "only; serve it through transformers with --backend reference)")
    if logit_correction != "none":
        reasons.append(f"a logit correction (quant.logit_correction {logit_correction}: the kernels add no per-key "
                       "logit bias; serve it through transformers with --backend reference)")
    if key_subspace:
        reasons.append(f"a BF16 key subspace (quant.key_subspace {key_subspace}: the kernels do not read it; serve it "
                       "through transformers with --backend reference)")
    if key_mean not in ("constant", "rope"):
        reasons.append(f"key mean {key_mean!r} (quant.key_mean: the backend centres keys by a constant mean or by "
                       "RoPE_p(m_pre))")
    if head_dim not in KERNEL_HEAD_DIMS:
        reasons.append(f"head_dim {head_dim} (the INT2 decode kernel supports {KERNEL_HEAD_DIMS})")
    if block_size not in BLOCK_SIZES:
        reasons.append(f"block size {block_size} (use --block-size 16, 32 or 64)")
    elif settings.sink % block_size:
        reasons.append(f"sink {settings.sink} is not a multiple of the block size {block_size}")
    if group_size not in (None, head_dim):
        reasons.append(f"quantization group {group_size} (the kernels need G = head_dim)")
    if settings.meta_dtype not in (torch.bfloat16, torch.float16, torch.uint8):
        reasons.append(f"metadata dtype {settings.meta_dtype} (pages hold 16-bit or formula 10's 8-bit scale/zero)")
    if sliding_window is not None:
        reasons.append("sliding-window attention")
    if logits_soft_cap:
        reasons.append("logits soft-capping")
    if alibi:
        reasons.append("ALiBi")
    if kv_sharing:
        reasons.append("cross-layer KV sharing")
    if reasons:
        raise UnsupportedModelError("oscar INT2 backend cannot serve this model: " + "; ".join(reasons))


def page_size_hint(block_size: int, sink: int) -> str | None:
    """One line for the engine log when a larger served page would decode faster, else None.

    The decode reads the INT2 history in 64-token tiles; with 64-token pages each tile is one block-table entry
    (docs/VLLM.md, "Pages of 64 tokens in the engine": on an H100 the 32K step at capacity took 27.18 against
    28.18 ms). vLLM's default is 16; 64 needs the sink to be whole 64-token blocks."""
    if block_size >= FAST_BLOCK_SIZE or not fast_pages_fit(sink):
        return None
    return (f"oscar: --block-size {FAST_BLOCK_SIZE} decodes faster than {block_size}-token pages (one block-table "
            f"entry per {FAST_BLOCK_SIZE}-token decode tile; the sink of {sink} tokens is whole blocks): docs/VLLM.md, "
            f"'Pages of 64 tokens in the engine'")


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    """``"model.layers.12.self_attn.attn"`` -> 12 (vLLM's attention layer prefix)."""
    m = _LAYER_RE.search(layer_name)
    if m is None:
        raise UnsupportedModelError(f"cannot tell the decoder layer of attention module {layer_name!r}")
    return int(m.group(1))


def page_offsets(block_size: int, h_kv: int, head_dim: int, meta: int, key_bits: int = 2) -> dict[str, int]:
    """Byte offsets inside one page: K codes, V codes (token quads), K scale, K zero, V scale, V zero, and with
    ``key_bits`` 4 the keys' low plane (laid out as the K codes) after them."""
    codes = block_size * h_kv * head_dim // 4
    md = block_size * h_kv * meta
    off = {"k": 0, "v": codes, "k_scale": 2 * codes, "k_zero": 2 * codes + md, "v_scale": 2 * codes + 2 * md,
           "v_zero": 2 * codes + 3 * md, "end": 2 * codes + 4 * md}
    if key_bits == 4:
        off["k_lo"], off["end"] = off["end"], off["end"] + codes
    return off


def _page_geometry(kv_cache: torch.Tensor, head_dim: int, meta_dtype: torch.dtype, key_bits: int
                   ) -> tuple[int, int, int, int, int, dict[str, int]]:
    """``(blocks, P, H_kv, page bytes, metadata bytes, page_offsets)`` of one layer's checked pages."""
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache: expected contiguous uint8 [blocks, P, H_kv, slot], got {kv_cache.dtype} "
                         f"{tuple(kv_cache.shape)}")
    nb, p, h, slot = (int(s) for s in kv_cache.shape)
    meta = torch.empty((), dtype=meta_dtype).element_size()
    off = page_offsets(p, h, head_dim, meta, key_bits)
    if off["end"] != p * h * slot:
        raise ValueError(f"kv_cache: slot {slot} does not hold INT2 K/V of head_dim {head_dim} with {meta}-byte "
                         f"metadata and {key_bits}-bit keys ({off['end'] // (p * h)} bytes)")
    return nb, p, h, p * h * slot, meta, off


def carve_low_plane(kv_cache: torch.Tensor, head_dim: int, meta_dtype: torch.dtype = torch.bfloat16
                    ) -> torch.Tensor:
    """The INT4 keys' low plane of one layer's pages (``key_bits`` 4): ``uint8 [blocks, H_kv, P, D/4]`` with the
    K codes' strides (``oscar_kernels.ops.LowPlane(codes)``, paged: the block table addresses it)."""
    nb, p, h, page, _, off = _page_geometry(kv_cache, head_dim, meta_dtype, 4)
    d4 = head_dim // 4
    return kv_cache.reshape(-1).as_strided((nb, h, p, d4), (page, p * d4, d4, 1), off["k_lo"])


def carve_pages(kv_cache: torch.Tensor, head_dim: int, meta_dtype: torch.dtype = torch.bfloat16,
                key_bits: int = 2) -> tuple[QuantizedRows, QuantizedRows]:
    """Views of one layer's pages ``uint8 [num_blocks, P, H_kv, slot]`` as the kernels' paged caches.

    Keys: ``packed [blocks, H_kv, P, D/4]``; values: token quads ``[blocks, H_kv, P/R·D, R/4]`` (R = min(P, 64));
    scale/zero ``[blocks, H_kv, P, 1]`` in ``meta_dtype``, all four with the same strides (what the decode kernel
    requires). The page bytes are laid out as :func:`page_offsets` says; ``key_bits`` 4: the page also holds the
    keys' low plane (:func:`carve_low_plane`), and the keys here are its high plane.
    """
    nb, p, h, page, meta, off = _page_geometry(kv_cache, head_dim, meta_dtype, key_bits)
    flat = kv_cache.reshape(-1)
    row = token_quad_row(p)
    d4 = head_dim // 4
    k = flat.as_strided((nb, h, p, d4), (page, p * d4, d4, 1), off["k"])
    v = flat.as_strided((nb, h, p // row * head_dim, row // 4), (page, p * d4, row // 4, 1), off["v"])
    md = flat.view(meta_dtype)

    def meta_view(name: str) -> torch.Tensor:
        return md.as_strided((nb, h, p, 1), (page // meta, p, 1, 1), off[name] // meta)

    return (QuantizedRows(k, meta_view("k_scale"), meta_view("k_zero")),
            QuantizedRows(v, meta_view("v_scale"), meta_view("v_zero")))


def token_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Request index and absolute position (int64 ``[N]``) of each of the batch's ``num_tokens`` query tokens.

    ``query_start_loc`` int32 ``[R+1]``, ``seq_lens`` ``[R]`` (lengths after this step's tokens). Padding tokens past
    ``query_start_loc[-1]`` get the last request and meaningless positions (their slot is -1: callers mask them).
    """
    r = int(seq_lens.shape[0])
    t = torch.arange(num_tokens, device=seq_lens.device, dtype=torch.int64)
    ends = query_start_loc[1:].to(torch.int64)
    req = torch.searchsorted(ends, t, right=True).clamp_(max=max(r - 1, 0))
    pos = seq_lens.to(torch.int64)[req] - (ends[req] - t)
    return req, pos


def next_recent_len(prev: torch.Tensor, query_lens: torch.Tensor, seq_lens: torch.Tensor, s: Int2Settings,
                    prefilling: torch.Tensor | None = None) -> torch.Tensor:
    """BF16 recent-tier length after this step, per request (the reference cache's placement rule).

    A prefill chunk (``q_len > 1``) keeps its last ``min(W, tokens past the sink)`` in the recent tier (a later chunk
    replaces that: earlier chunks are INT2 for it); a decode token past the sink grows the tier by one, and at
    ``W + B`` tokens the ``B`` oldest go to INT2 at once, so the tier holds ``W .. W + B - 1`` tokens. ``prefilling``
    (bool ``[R]``, vLLM's ``is_prefilling``: prompt tokens remain before this step) marks a one-token step that ends a
    prompt: it follows a non-final chunk, after which the reference holds no recent tier. (After a longer non-final
    chunk the value here is ``min(W, ...)``, not the reference's 0; nothing reads it: that sequence's next step is
    another chunk, which ignores it.)
    """
    q = query_lens.to(torch.int64)
    L = seq_lens.to(torch.int64)
    fresh = L == q  # a new sequence starts empty
    if prefilling is not None:
        fresh = fresh | (prefilling.to(torch.bool) & (q == 1))
    prev = torch.where(fresh, torch.zeros_like(q), prev.to(torch.int64))
    w, blk = s.recent, s.demotion_block
    chunk = torch.clamp(L - torch.clamp(L - q, min=s.sink), min=0).clamp(max=w)
    grown = prev + (L - 1 >= s.sink).to(torch.int64)
    grown = grown - torch.where(grown >= w + blk, torch.div(grown - w, blk, rounding_mode="floor") * blk,
                                torch.zeros_like(grown))
    out = torch.where(q > 1, chunk, grown)
    return torch.minimum(out, torch.clamp(L - s.sink, min=0)).to(torch.int32)


def advance_recent(state: torch.Tensor, rows: torch.Tensor, query_lens: torch.Tensor, seq_lens: torch.Tensor,
                   s: Int2Settings, prefilling: torch.Tensor | None = None) -> torch.Tensor:
    """Advance the per-row state ``int32 [rows + 1, 2]`` = (recent length, sequence length it is for) to this step
    and return the recent lengths ``[R]``. Idempotent: building the same step twice does not advance it twice."""
    last = state[rows]
    r = next_recent_len(last[:, 0], query_lens, seq_lens, s, prefilling)
    again = (seq_lens.to(torch.int32) == last[:, 1]) & (seq_lens.to(torch.int64) > query_lens.to(torch.int64))
    r = torch.where(again, last[:, 0], r)
    state[rows] = torch.stack([r, seq_lens.to(torch.int32)], 1)
    return r


def decode_lengths(seq_lens: torch.Tensor, recent_len: torch.Tensor, sink: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sink_len, hist_len)`` int32 ``[B]``: sink ``min(L, S0)``; INT2 history ``[S0, L - r)`` (the kernel reads it
    through the block table shifted by ``S0 / P`` blocks)."""
    L = seq_lens.to(torch.int32)
    sink_len = torch.clamp(L, max=sink)
    hist_len = torch.clamp(L - sink - recent_len.to(torch.int32), min=0)
    return sink_len.to(torch.int32), hist_len.to(torch.int32)


def ring_gather_index(seq_lens: torch.Tensor, recent_len: torch.Tensor, ring: int) -> torch.Tensor:
    """int64 ``[B, ring]``: ring slot of the recent tier's ``j``-th token (positions ``L - r .. L - 1``, oldest
    first; entries ``j >= r`` repeat valid slots, the kernel ignores them)."""
    L = seq_lens.to(torch.int64).unsqueeze(1)
    r = recent_len.to(torch.int64).unsqueeze(1)
    j = torch.arange(max(ring, 1), device=seq_lens.device, dtype=torch.int64).unsqueeze(0)
    return torch.remainder(L - r + j, max(ring, 1))


def tier_write_index(req: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
                     rows: torch.Tensor, s: Int2Settings, scratch_row: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each new token's rotated BF16 K/V goes: ``(sink_row, sink_pos, ring_row, ring_slot)`` int64 ``[N]``.

    Sink: positions ``< S0``. Ring: positions ``>= S0`` among the request's newest ``ring`` tokens (older ones of
    a long chunk would be overwritten in the same launch: they are skipped, so no two tokens share a slot). Tokens
    that go nowhere (padding: slot < 0) are sent to ``scratch_row``, slot 0.
    """
    valid = slots >= 0
    row = rows.to(torch.int64)[req]
    scratch = torch.full_like(row, scratch_row)
    zero = torch.zeros_like(pos)
    to_sink = valid & (pos < s.sink)
    to_ring = valid & (pos >= s.sink) & (pos >= seq_lens.to(torch.int64)[req] - s.ring) & (s.ring > 0)
    ring = max(s.ring, 1)
    return (torch.where(to_sink, row, scratch), torch.where(to_sink, pos, zero),
            torch.where(to_ring, row, scratch), torch.where(to_ring, torch.remainder(pos, ring), zero))


def _caller_locals(max_depth: int) -> Iterator[dict[str, Any]]:
    """The local variables of the frames above the caller of the function that calls this, nearest first."""
    frame = sys._getframe(2)
    for _ in range(max_depth):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return
        yield frame.f_locals


def host_first_blocks(num_reqs: int, max_depth: int = 8) -> list[int] | None:
    """First column of the calling vLLM GPU model runner's host block table, or None when no caller has one.

    vLLM 0.25's ``GPUModelRunner._build_attention_metadata`` (the caller of a metadata builder's ``build``) holds the
    runner as ``self`` and the KV-cache group as ``kv_cache_gid``; the runner's ``input_batch.block_table[gid]`` keeps
    the host array its device block table is copied from. Reading it costs no device sync.
    """
    for loc in _caller_locals(max_depth):
        batch, gid = getattr(loc.get("self"), "input_batch", None), loc.get("kv_cache_gid")
        if batch is not None and isinstance(gid, int):
            try:
                return [int(b) for b in batch.block_table[gid].get_numpy_array()[:num_reqs, 0]]
            except (AttributeError, IndexError, TypeError):
                return None
    return None


def host_request_slots(num_reqs: int, max_depth: int = 10) -> list[int] | None:
    """The batch's request-state slots from the calling vLLM V2 model runner, or None when no caller is one.

    vLLM 0.25's V2 runner (``vllm/v1/worker/gpu``) calls the metadata builders from
    ``model_state.prepare_attn(input_batch, ...)`` inside ``GPUModelRunner.execute_model(..., dummy_run)``;
    ``input_batch.idx_mapping_np[i]`` is batch row ``i``'s index into the runner's request states: a slot in
    ``[0, max_num_seqs)`` that a request keeps from admission to its end. Rows past ``input_batch.num_reqs`` (padding
    of a full-graph batch) and every row of a dummy batch (``dummy_run=True``: its slots are ``arange``, not requests)
    come back as -1. Both frames must be found (else None: the caller falls back to the device block table). Reading
    the slots costs no device sync.
    """
    batch = None
    for loc in _caller_locals(max_depth):
        if batch is None:
            cand = loc.get("input_batch")
            if hasattr(cand, "idx_mapping_np") and isinstance(getattr(cand, "num_reqs", None), int):
                batch = cand
            continue
        if "dummy_run" in loc and "scheduler_output" in loc:  # GPUModelRunner.execute_model
            if loc["dummy_run"]:
                return [-1] * num_reqs
            real = min(int(batch.num_reqs), num_reqs)
            return [int(x) for x in batch.idx_mapping_np[:real]] + [-1] * (num_reqs - real)
    return None


def rows_from_slots(slots: list[int], num_rows: int, scratch: int) -> list[int]:
    """Tier rows of a batch from :func:`host_request_slots` (-1: the scratch row); a slot past the tiers raises."""
    bad = [x for x in slots if x >= num_rows]
    if bad:
        raise OscarError(f"oscar: vLLM request slot {bad[0]} is beyond the {num_rows} rows of BF16 tiers",
                         hint="the tiers are sized by --max-num-seqs; this vLLM version is not supported")
    return [scratch if x < 0 else x for x in slots]


def check_slots_against_blocks(slots: list[int], first_blocks: list[int]) -> None:
    """One batch's request slots must identify the same requests as their first block ids: a row with a slot has a
    real first block (not vLLM's null block 0) and slots and first blocks pair one to one (rows without a slot,
    padding or dummy, are not checked)."""
    real = {(x, b) for x, b in zip(slots, first_blocks, strict=True) if x >= 0}
    if any(b == 0 for _, b in real) or not len(real) == len({x for x, _ in real}) == len({b for _, b in real}):
        raise OscarError(f"oscar: vLLM's request slots {slots} do not match the batch's block table "
                         f"(first blocks {first_blocks}); this vLLM version is not supported by the INT2 backend")


class SequenceRows:
    """Host-side owner table of the per-sequence BF16 tier rows, keyed by a request's first block id.

    vLLM gives a backend no request ids; a live request's first block is its own (prefix caching is off) and stays
    put until the request ends. A new request (no computed tokens yet) takes a free row, else the least recently
    seen row that is not in this batch; a continuing request whose row was taken raises instead of attending to
    another request's tokens. Block 0 is vLLM's null block (dummy and padded batches): it maps to the scratch row.
    """

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.scratch = num_rows  # one extra row for padding / dummy batches
        self._rows: OrderedDict[int, int] = OrderedDict()  # first block -> row, least recently seen first
        self._free = list(range(num_rows - 1, -1, -1))

    def assign(self, first_blocks: list[int], new: list[bool]) -> list[int]:
        batch = set(first_blocks)
        out = []
        for block, is_new in zip(first_blocks, new, strict=True):
            if block == 0:
                out.append(self.scratch)
                continue
            row = self._rows.get(block)
            if row is None:
                if not is_new:
                    raise OscarError(
                        f"oscar: the BF16 tiers of a running request were given to a newer one (more than "
                        f"{self.num_rows} requests seen since it last ran)",
                        hint="oscar keeps --max-num-seqs rows of BF16 tiers; lower the load or raise --max-num-seqs")
                row = self._take(batch)
            self._rows[block] = row
            self._rows.move_to_end(block)
            out.append(row)
        return out

    def _take(self, batch: set[int]) -> int:
        if self._free:
            return self._free.pop()
        for block in self._rows:
            if block not in batch:
                return self._rows.pop(block)
        raise OscarError(f"oscar: more than {self.num_rows} requests in one batch", hint="lower --max-num-seqs")
