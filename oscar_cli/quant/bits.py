"""Stored bits per K/V element of one layer's storage (and their mean over layers), the formulas behind
:meth:`oscar_cli.quant.methods.QuantMethod.bits_per_element` and the model card's table
(:func:`oscar_cli.artifact.card.bpe_table`). A module of its own so the card, which the artifact writer renders,
reads them without importing the methods (which open artifacts).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from oscar_cli.quant.keep import keep_bits
from oscar_cli.quant.key_subspace import subspace_bits
from oscar_kernels.reference import bits_per_element

KIVI_GROUP = 128
META_BITS = {"bfloat16": 16, "float16": 16, "float32": 32, "uint8": 8}  # recipe quant.meta_dtype -> bits per scale/zero
KIVI_RESIDUAL = 128


def storage_bits(
    kind: str, context_len: int, head_dim: int, *, group_size: int | None, meta_bits: int, sink: int, recent: int,
    keep_fraction: float = 0.0, keep_side: str = "both", key_subspace: int = 0, key_bits: int = 2,
) -> float:
    """Bits per K/V element at ``context_len`` tokens (batch 1, recent window exactly ``W``) of one layer stored as
    ``kind``: ``int2``: docs/METHOD.md §9 ``BPE(L)``, plus :func:`~oscar_cli.quant.keep.keep_bits` for a keep
    budget and :func:`~oscar_cli.quant.key_subspace.subspace_bits` for a key subspace, plus, with INT4 keys
    (``key_bits`` 4: a second 2-bit plane, recipe ``quant.int4_keys``), 2 bits on every history key, i.e.
    ``(L - S0 - W) / L`` per K/V element; ``kivi``: keys
    ``(L - L mod 128)`` tokens at ``2 + 2·b/128`` plus ``L mod 128`` BF16, values ``L - 128`` tokens at
    ``2 + 2·b/G`` plus 128 BF16 (``b`` at least 16), averaged over K and V (``sink`` / ``recent`` unused);
    ``dense``: 16."""
    if kind == "dense":
        return 16.0
    if kind == "int2":
        return (bits_per_element(context_len, head_dim, group_size, meta_bits, sink, recent)
                + keep_bits(context_len, head_dim, keep_fraction, sink, recent, side=keep_side)
                + subspace_bits(context_len, head_dim, key_subspace, sink, recent)
                + (key_bits - 2) / 2 * max(0, context_len - sink - recent) / context_len)
    g = group_size or min(head_dim, KIVI_GROUP)
    meta_bits = max(meta_bits, 16)  # a KIVI layer keeps 16-bit metadata (8-bit is formula 10, per-token rows only)
    k_res = context_len % KIVI_GROUP
    k_bits = (context_len - k_res) * (2 + 2 * meta_bits / KIVI_GROUP) + k_res * 16
    v_res = min(context_len, KIVI_RESIDUAL)
    v_bits = (context_len - v_res) * (2 + 2 * meta_bits / g) + v_res * 16
    return (k_bits + v_bits) / (2 * context_len)


def mean_bits(
    kinds: Sequence[str], context_len: int, head_dim: int, *, group_size: int | None, meta_bits: int, sink: int,
    recent: int, keep_fraction: float = 0.0, keep_side: str = "both", keep_layers: Collection[int] | None = None,
    key_subspace: int = 0, int4_key_layers: Collection[int] = (),
) -> float:
    """The mean of :func:`storage_bits` over layers stored as ``kinds`` (each layer stores as many elements): a
    ``kivi`` layer in KIVI-2's own layout (value groups of ``min(D, 128)``), the keep budget on the ``int2`` layers
    of ``keep_layers`` (None: every one), INT4 keys on the ``int2`` layers of ``int4_key_layers``."""
    def layer(i: int, kind: str) -> float:
        kept = keep_fraction if keep_layers is None or i in keep_layers else 0.0
        return storage_bits(kind, context_len, head_dim, group_size=None if kind == "kivi" else group_size,
                            meta_bits=meta_bits, sink=sink, recent=recent, keep_fraction=kept, keep_side=keep_side,
                            key_subspace=key_subspace, key_bits=4 if i in int4_key_layers else 2)

    return sum(layer(i, k) for i, k in enumerate(kinds)) / len(kinds)
