"""KV-cache sizes of the oscar INT2 backend in vLLM (pure arithmetic; no vLLM, no torch tensors).

What one layer stores (head_dim ``D``, ``H_kv`` KV heads, quantization group ``G = D``, metadata of ``m`` bytes):

- **in vLLM's pages**, for every token at arrival: K and V codes (``D/4`` bytes each) plus K and V scale and zero
  (``m`` bytes each; 2 for bf16/fp16, 1 for formula 10's 8-bit metadata): ``slot_bytes = D/2 + 4m`` bytes per token
  and KV head (72 at ``D = 128``, bf16 metadata; 68 with 8-bit metadata; against 512 for BF16 K and V); a layer with
  INT4 keys (recipe ``quant.int4_keys``) also stores the keys' low plane, ``D/4`` more (100 at ``D = 128``, 8-bit
  metadata). A page of ``P`` tokens is ``P · H_kv · slot_bytes`` bytes: layers differ in page size when some have
  INT4 keys (vLLM then keeps one block table and sizes each layer's pool by its own page);
- **per sequence**, outside the pages: the BF16 sink (``S0`` tokens) and a BF16 ring of the newest
  ``W + B - 1`` tokens (``B`` = demotion block), K and V: ``(S0 + ring) · H_kv · D · 2 · act_bytes`` per layer.

vLLM sizes its block pool from the page size, so at equal memory it fits ``512 / 72 = 7.1`` times as many tokens
as with BF16 pages; the per-sequence tiers are allocated once at engine start (``max_num_seqs`` rows) and lower the
memory left for pages by that fixed amount (:func:`capacity_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from oscar_kernels.layout import DEFAULT_RECENT, DEFAULT_SINK, DEMOTION_BLOCK

# The page size the backend decodes fastest: one block-table entry per 64-token decode tile (docs/VLLM.md, "Pages of
# 64 tokens in the engine"); vLLM's default is 16.
FAST_BLOCK_SIZE = 64


def fast_pages_fit(sink: int) -> bool:
    """Whether ``--block-size FAST_BLOCK_SIZE`` can serve an artifact with this BF16 sink (the backend refuses pages
    that split the sink)."""
    return sink % FAST_BLOCK_SIZE == 0


def meta_bytes(meta_dtype: str) -> int:
    """Bytes of one scale or zero: 1 for uint8 (formula 10), 2 for bfloat16/float16, 4 for float32."""
    sizes = {"uint8": 1, "bfloat16": 2, "float16": 2, "float32": 4}
    if meta_dtype not in sizes:
        raise ValueError(f"meta_dtype: expected one of {sorted(sizes)}, got {meta_dtype!r}")
    return sizes[meta_dtype]


def slot_bytes(head_dim: int, meta: int = 2, key_bits: int = 2) -> int:
    """Bytes per token and KV head in a page: K and V codes (``D/4`` each) + K and V scale and zero (G = D), + the
    keys' low plane (``D/4``) with ``key_bits`` 4."""
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16, got {head_dim}")
    if key_bits not in (2, 4):
        raise ValueError(f"key_bits must be 2 or 4, got {key_bits}")
    return head_dim // 2 + 4 * meta + (head_dim // 4 if key_bits == 4 else 0)


def ring_tokens(recent: int, demotion_block: int = DEMOTION_BLOCK) -> int:
    """BF16 ring slots per sequence: the recent tier holds at most ``W + B - 1`` tokens (``B = 1`` when W = 0)."""
    block = demotion_block if recent > 0 else 1
    return recent + block - 1


@dataclass(frozen=True)
class Int2KVSpec:
    """One attention layer's INT2 KV layout, as vLLM's block manager sees it."""

    num_kv_heads: int
    head_dim: int
    block_size: int
    meta: int = 2  # bytes per scale / zero
    sink: int = DEFAULT_SINK
    recent: int = DEFAULT_RECENT
    act_bytes: int = 2  # bf16 / fp16 tiers
    key_bits: int = 2  # 4: INT4 keys (the low plane in the same page)

    @property
    def slot_bytes(self) -> int:
        return slot_bytes(self.head_dim, self.meta, self.key_bits)

    @property
    def token_bytes(self) -> int:
        """Page bytes per token of this layer (all KV heads)."""
        return self.num_kv_heads * self.slot_bytes

    @property
    def page_bytes(self) -> int:
        """vLLM page size of this layer: ``block_size`` tokens."""
        return self.block_size * self.token_bytes

    @property
    def ring(self) -> int:
        return ring_tokens(self.recent)

    @property
    def sequence_tier_bytes(self) -> int:
        """BF16 sink + ring bytes per sequence of this layer (K and V)."""
        return (self.sink + self.ring) * self.num_kv_heads * self.head_dim * 2 * self.act_bytes


def bf16_token_bytes(num_kv_heads: int, head_dim: int, act_bytes: int = 2) -> int:
    """vLLM's BF16 page bytes per token and layer (K and V)."""
    return 2 * num_kv_heads * head_dim * act_bytes


def bits_per_stored_element(head_dim: int, meta: int = 2, key_bits: int = 2) -> float:
    """Bits per K or V element in the pages: ``2 + 2·b_meta/G`` with ``G = D`` (the BPE formula's INT2 term), one
    more on average with INT4 keys (``(2 + 4)/2 + 2·b_meta/G``)."""
    return slot_bytes(head_dim, meta, key_bits) * 8 / (2 * head_dim)


def model_token_bytes(num_layers: int, spec: Int2KVSpec, int4_layers: int = 0) -> int:
    """Page bytes per token over the whole model: ``int4_layers`` of the ``num_layers`` with INT4 keys (the low plane
    in their pages), the others as ``spec`` (whose ``key_bits`` is ignored here)."""
    if not 0 <= int4_layers <= num_layers:
        raise ValueError(f"int4_layers must be in 0..{num_layers}, got {int4_layers}")
    two = replace(spec, key_bits=2).token_bytes
    return num_layers * two + int4_layers * spec.num_kv_heads * (spec.head_dim // 4)


def capacity_tokens(memory_bytes: int, num_layers: int, spec: Int2KVSpec, max_num_seqs: int = 0,
                    int4_layers: int = 0) -> int:
    """Tokens vLLM's pool holds in ``memory_bytes`` once ``max_num_seqs`` rows of BF16 tiers are set aside
    (``int4_layers`` of the layers with INT4 keys: :func:`model_token_bytes`)."""
    free = memory_bytes - max_num_seqs * num_layers * spec.sequence_tier_bytes
    if not int4_layers:
        return max(0, free // (num_layers * spec.token_bytes))
    return max(0, free // model_token_bytes(num_layers, spec, int4_layers))


def bf16_capacity_tokens(memory_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """Tokens vLLM's BF16 pool holds in ``memory_bytes``."""
    return memory_bytes // (num_layers * bf16_token_bytes(num_kv_heads, head_dim))


def capacity_ratio(memory_bytes: int, num_layers: int, spec: Int2KVSpec, max_num_seqs: int = 0,
                   int4_layers: int = 0) -> float:
    """INT2 over BF16 token capacity at equal memory."""
    bf16 = bf16_capacity_tokens(memory_bytes, num_layers, spec.num_kv_heads, spec.head_dim)
    return capacity_tokens(memory_bytes, num_layers, spec, max_num_seqs, int4_layers) / max(bf16, 1)
