"""What ``oscar info`` reports about a model: identity, architecture, support, and the INT2 memory table.

The bits-per-element figures come from :func:`oscar_kernels.reference.bits_per_element` (the format spec), so
this table and the kernels cannot disagree. KV bytes count K and V over every layer and KV head:
``bytes(L) = 2 · layers · H_kv · D · L · BPE(L) / 8``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oscar_cli.model import DEFAULT_MODEL, ModelGeometry, load_config, load_model
from oscar_kernels.layout import DEFAULT_RECENT, DEFAULT_SINK

DEFAULT_CTX = (4096, 8192, 32768, 131072)
# The serving defaults of the INT2 format (docs/DESIGN.md): BF16 sink and recent tiers, 16-bit scale/zero.
SINK, RECENT, META_BITS = DEFAULT_SINK, DEFAULT_RECENT, 16


@dataclass(frozen=True)
class BpeRow:
    """One cell group of the table: a context length and a quantization group size."""

    ctx: int
    group_size: int
    bits_per_element: float
    kv_bytes_int2: int
    kv_bytes_bf16: int


def default_group_sizes(head_dim: int) -> list[int]:
    """``[D, D/2, D/4]``, keeping those that divide D and are at least 16."""
    return [g for g in (head_dim, head_dim // 2, head_dim // 4) if g >= 16 and head_dim % g == 0]


def bpe_table(fingerprint: dict[str, Any], ctxs: list[int], group_sizes: list[int]) -> list[BpeRow]:
    """BPE and whole-model KV bytes for every (context length, group size) pair, in that order.

    Raises:
        ValueError: a group size does not divide the model's head_dim.
    """
    from oscar_kernels.reference import bits_per_element

    d = fingerprint["head_dim"]
    elems_per_token = 2 * fingerprint["num_layers"] * fingerprint["num_key_value_heads"] * d
    rows = []
    for ctx in ctxs:
        for g in group_sizes:
            bpe = bits_per_element(ctx, head_dim=d, group_size=g, meta_bits=META_BITS, sink=SINK, recent=RECENT)
            rows.append(
                BpeRow(ctx, g, bpe, round(elems_per_token * ctx * bpe / 8), elems_per_token * ctx * 2)
            )
    return rows


def model_report(
    ref: str = DEFAULT_MODEL,
    *,
    revision: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    load: bool = True,
    ctxs: list[int] | None = None,
    group_sizes: list[int] | None = None,
) -> dict[str, Any]:
    """Resolve (and by default load) a model and describe it; the JSON document of ``oscar info``.

    Returns:
        ``{"model": identity, "architecture": fingerprint, "supported", "unsupported_reasons",
        "loaded": {device, dtype, seconds, source, parameters} | None, "bpe": {sink, recent, meta_bits, rows}}``.
    """
    loaded = None
    if load:
        lm = load_model(ref, device=device, dtype=dtype, revision=revision)
        identity, geo = lm.identity, lm.geometry
        loaded = {
            "device": str(lm.device),
            "dtype": str(lm.dtype).removeprefix("torch."),
            "seconds": round(lm.load_seconds, 2),
            "source": lm.source,
            "parameters": sum(p.numel() for p in lm.model.parameters()),
        }
    else:
        identity, config = load_config(ref, revision=revision)
        geo = ModelGeometry.from_config(config)
    fp = geo.fingerprint()
    groups = group_sizes or default_group_sizes(fp["head_dim"])
    bad = [g for g in groups if g <= 0 or fp["head_dim"] % g]
    if bad:
        from oscar_cli.errors import OscarError

        raise OscarError(
            f"group size {bad[0]} does not divide head_dim {fp['head_dim']}",
            hint=f"use one of {[g for g in range(1, fp['head_dim'] + 1) if fp['head_dim'] % g == 0]}",
        )
    rows = bpe_table(fp, list(ctxs or DEFAULT_CTX), groups)
    reasons = list(geo.unsupported_reasons)
    return {
        "model": identity.to_dict(),
        "architecture": fp,
        "supported": not reasons,
        "unsupported_reasons": reasons,
        "loaded": loaded,
        "bpe": {
            "sink": SINK,
            "recent": RECENT,
            "meta_bits": META_BITS,
            "rows": [row.__dict__ for row in rows],
        },
    }
