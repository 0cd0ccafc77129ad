"""ModelGeometry: read once from a config; the fingerprint dict and the support check are its views."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from oscar_cli.errors import UnsupportedModelError
from oscar_cli.model import ModelGeometry, architecture_fingerprint


@pytest.mark.unit
@pytest.mark.parametrize(
    ("heads", "kv", "hidden", "head_dim", "want_d", "want_g"),
    [(4, 2, 64, 32, 32, 2), (6, None, 96, None, 16, 1), (8, 1, 512, None, 64, 8)],
)
def test_geometry_from_config(heads, kv, hidden, head_dim, want_d, want_g) -> None:
    cfg = SimpleNamespace(
        model_type="llama", num_attention_heads=heads, num_key_value_heads=kv, hidden_size=hidden,
        head_dim=head_dim, num_hidden_layers=3, rope_theta=5e5, rope_scaling={"type": "yarn", "factor": 4.0},
        max_position_embeddings=4096,
    )  # fmt: skip
    geo = ModelGeometry.from_config(cfg)
    assert (geo.head_dim, geo.group_ratio, geo.num_layers) == (want_d, want_g, 3)
    assert (geo.rope_type, geo.rope_theta, geo.rope_scaling) == ("yarn", 5e5, (("factor", 4.0),))
    assert geo.supported and geo.fingerprint() == architecture_fingerprint(cfg)
    assert ModelGeometry.of(geo) is geo
    geo.check()


@pytest.mark.unit
def test_geometry_unsupported_names_every_reason() -> None:
    cfg = SimpleNamespace(
        model_type="odd", num_attention_heads=6, num_key_value_heads=4, hidden_size=36, num_hidden_layers=1,
        kv_lora_rank=8,
    )  # fmt: skip
    geo = ModelGeometry.from_config(cfg)
    assert len(geo.unsupported_reasons) == 3 and not geo.supported
    with pytest.raises(UnsupportedModelError, match="RoPE.*MLA.*head_dim 6"):
        geo.check()
