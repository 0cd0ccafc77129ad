"""scripts/copy_probe.py: the identifier probe's sequences and its per-layer copy counts, on a tiny model."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers.calib import RESOLVED, tiny_recipe
from helpers.scripts import load_script
from helpers.tiny import CharTokenizer, tiny_causal_lm

from oscar_cli.artifact import open_artifact
from oscar_cli.calibration.run import calibrate_model


def _find(seq: list[int], sub: list[int]) -> list[int]:
    return [i for i in range(len(seq) - len(sub) + 1) if seq[i : i + len(sub)] == sub]


@pytest.mark.parametrize(("seq_len", "n_ids", "seed"), [(2048, 1, 0), (2048, 12, 1), (3001, 10, 2), (4096, 5, 3)])
def test_probe_places_each_identifier_once_before_and_once_among_the_scored_queries(
        seq_len: int, n_ids: int, seed: int) -> None:
    probe = load_script("copy_probe")
    tok = CharTokenizer()
    prose = [ord(c) % 128 for c in ("the quiet house by the river " * 400)][: seq_len]
    seq, names = probe.probe_sequence(tok, prose, seq_len, n_ids, random.Random(seed))
    assert len(seq) == seq_len and len(names) == n_ids
    for name in names:
        at = _find(seq, tok("\n" + name + "\n")["input_ids"])
        assert len(at) == 2, name
        assert at[0] < seq_len - probe.SCORED <= at[1], (name, at)


@pytest.mark.parametrize(("seq_len", "prose_len", "n_ids", "why"),
                         [(2047, 4000, 4, "needs >= 2048"), (2048, 2000, 4, "prose"), (2048, 4000, 400, "too many")])
def test_probe_refuses_what_cannot_hold_the_identifiers(seq_len: int, prose_len: int, n_ids: int, why: str) -> None:
    probe = load_script("copy_probe")
    with pytest.raises(ValueError, match=why):
        probe.probe_sequence(CharTokenizer(), [7] * prose_len, seq_len, n_ids, random.Random(0))


def test_probe_counts_per_layer_under_int2_and_int4_keys(tmp_path: Path) -> None:
    """On a tiny calibrated model: one row per layer, each count bounded by the one before it (flips <= peaked <=
    rows), every scored query with INT2 history counted, and the rope mean's artifacts scored too."""
    probe = load_script("copy_probe")
    for key_mean in ("constant", "rope"):
        model = tiny_causal_lm("llama", heads=4, max_positions=2048)
        res = calibrate_model(model, None, tiny_recipe(quant={"sink": 8, "recent": 32, "key_mean": key_mean}),
                              reference="tiny", resolved=RESOLVED, out=tmp_path / key_mean)
        art = open_artifact(res.artifact_path, expect_architecture=res.manifest.architecture)
        g = torch.Generator().manual_seed(5)
        seq = torch.randint(5, 128, (2048,), generator=g).tolist()
        rows = probe.score_layers(model, art, [seq])
        assert [r["layer"] for r in rows] == list(range(len(art.layers)))
        for r in rows:
            for fmt in ("int2", "int4"):
                c = r[fmt]
                assert 0 <= c["flipped"] <= c["peaked"] <= c["rows"]
            # 4 query heads x the 1024 scored queries, all with INT2 history (sink 8, recent 32)
            assert r["int2"]["rows"] == r["int4"]["rows"] == 4 * probe.SCORED
