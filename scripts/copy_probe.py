#!/usr/bin/env python3
"""Copy score per layer on an identifier-copying probe, next to the artifact's own (prose) copy score.

    python3 scripts/copy_probe.py ARTIFACT --text PROSE.txt [--model smollm2-135m] [--seq-len 2048] [--sequences 4]
        [--identifiers 24] [--seed 1] [--device cpu] [--out scores.json]

``oscar calibrate`` ranks layers for ``quant.int4_keys`` by the copy score (``oscar_cli.calibration.copy_score``)
on its held-out prose, where few rows are peaked (a few hundred per model). This probe makes copying frequent and
general, with no task template: each sequence is ``--seq-len`` tokens of the given prose with ``--identifiers``
random identifiers (half UUIDs, half 7-digit numbers), each on its own line at a random depth in the first part,
and the same identifiers again, shuffled, each on its own line among the last 1,024 tokens (the scored queries).
Writing a repeated identifier is copying: the heads that attend from each of its tokens to the one after the same
token's earlier occurrence are the ones INT2 keys can mislead.

For every layer, with the artifact's rotation, key mean (constant or by position), clip and format, it reports the
peaked rows and the flips under INT2 keys (what the calibration's score counts) and under INT4 keys (formula 9,
the format of ``quant.int4_keys`` layers), and the flips left under the artifact's own format (its INT4 layers
INT4, the rest INT2). Model and artifact must match (the artifact's fingerprint is checked when it loads).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from oscar_cli.calibration.copy_score import COPY_QUERIES  # noqa: E402

SCORED = COPY_QUERIES  # the last queries of each sequence, as the calibration scores them


def identifier(rng: random.Random) -> str:
    """A UUID or a 7-digit number, half and half."""
    return str(uuid.UUID(int=rng.getrandbits(128))) if rng.random() < 0.5 else str(rng.randrange(10**6, 10**7))


def probe_sequence(tokenizer: Any, prose: list[int], seq_len: int, n_ids: int, rng: random.Random
                   ) -> tuple[list[int], list[str]]:
    """``seq_len`` token ids: ``prose`` (at least ``seq_len`` ids) with ``n_ids`` identifiers placed once in the part
    before the last :data:`SCORED` tokens and once more, shuffled, among them (module docstring)."""
    if seq_len < 2 * SCORED or len(prose) < seq_len:
        raise ValueError(f"seq_len {seq_len}: needs >= {2 * SCORED} tokens and that much prose ({len(prose)} given)")
    names = [identifier(rng) for _ in range(n_ids)]
    enc = [tokenizer("\n" + s + "\n", add_special_tokens=False)["input_ids"] for s in names]
    body = sum(len(e) for e in enc)
    if body > 3 * SCORED // 4:
        raise ValueError(f"{n_ids} identifiers take {body} tokens: too many for the {SCORED} scored queries")
    head = prose[: seq_len - SCORED - body]
    cuts = sorted(rng.sample(range(1, len(head)), n_ids))
    out: list[int] = []
    last = 0
    for c, e in zip(cuts, enc, strict=True):
        out += head[last:c] + e
        last = c
    out += head[last:]
    tail_prose = prose[seq_len - SCORED - body : seq_len - body]
    order = list(range(n_ids))
    rng.shuffle(order)
    step = (len(tail_prose) - body) // (n_ids + 1)
    tail: list[int] = []
    for j, i in enumerate(order):
        tail += tail_prose[j * step : (j + 1) * step] + enc[i]
    tail += tail_prose[n_ids * step : len(tail_prose) - body]
    seq = out + tail
    if len(seq) != seq_len:
        raise AssertionError(f"probe sequence of {len(seq)} tokens, expected {seq_len}")
    return seq, names


def score_layers(model: Any, artifact: Any, sequences: list[list[int]]) -> list[dict[str, Any]]:
    """Per layer: the copy counts of the probe's last :data:`SCORED` queries under INT2 keys and under INT4 keys."""
    from oscar_cli.calibration.capture import HoldoutStore, capture_attention, run_forward
    from oscar_cli.calibration.copy_score import CopyScore, copy_flips, served_keys
    from oscar_cli.calibration.run import held_out_key_mean
    from oscar_cli.quant.key_mean import RopeTable
    from oscar_cli.recipe import recipe_from_dict

    q = recipe_from_dict(artifact.recipe).quant  # the artifact's own format (group, metadata, levels, tiers)
    device = next(model.parameters()).device
    store = HoldoutStore(len(artifact.layers), SCORED)
    with torch.no_grad(), capture_attention(model, store):
        for seq in sequences:
            run_forward(model, torch.tensor(seq, device=device)[None])
    table = RopeTable(model) if q.key_mean == "rope" else None
    rows = []
    for i, lt in enumerate(artifact.layers):
        int2 = served_keys(float(lt.k_clip), q, lt.k_subspace)
        int4 = served_keys(float(lt.k_clip), q, key_bits=4)
        two, four = CopyScore(), CopyScore()
        for qq, k, _ in store.layers[i]:
            args = (qq[:, :, -SCORED:], k, lt.k_rotation, held_out_key_mean(lt, k, table), store.scaling, q.sink,
                    q.recent)
            two = two.add(copy_flips(*args, int2))
            four = four.add(copy_flips(*args, int4))
        store.layers[i] = []
        rows.append({"layer": i, "int2": two.to_dict(), "int4": four.to_dict()})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--text", type=Path, required=True, help="prose (.txt) the identifiers are placed in")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--identifiers", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, help="also write the table as JSON")
    args = ap.parse_args(argv)
    from oscar_cli.artifact.io import load_artifact
    from oscar_cli.model import load_model
    from oscar_cli.model.geometry import ModelGeometry

    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    art = load_artifact(args.artifact, expect_architecture=ModelGeometry.from_config(lm.model.config).fingerprint())
    ids = lm.tokenizer(args.text.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    rng = random.Random(args.seed)
    seqs = []
    for s in range(args.sequences):  # disjoint stretches of the prose
        start = s * args.seq_len
        seqs.append(probe_sequence(lm.tokenizer, ids[start : start + args.seq_len], args.seq_len,
                                   args.identifiers, rng)[0])
    rows = score_layers(lm.model, art, seqs)
    int4_layers = set(art.manifest.quant.get("int4_keys") or [])
    prose = [x.get("copy") or {} for x in art.manifest.calibration.get("layers", [])]
    print("layer | peaked | flips, INT2 keys | flips, INT4 keys | prose: peaked, flips (the artifact's score)")
    for r in rows:
        p = prose[r["layer"]] if r["layer"] < len(prose) else {}
        mark = " (INT4)" if r["layer"] in int4_layers else ""
        print(f"{r['layer']}{mark} | {r['int2']['peaked']} | {r['int2']['flipped']} | {r['int4']['flipped']} | "
              f"{p.get('peaked', '-')}, {p.get('flipped', '-')}")
    rank = sorted(range(len(rows)), key=lambda i: (-rows[i]["int2"]["score"], i))
    left = sum(r["int4" if r["layer"] in int4_layers else "int2"]["flipped"] for r in rows)
    summary = {"probe_top8": rank[:8], "artifact_int4_layers": sorted(int4_layers),
               "flips_all_int2": sum(r["int2"]["flipped"] for r in rows), "flips_artifact_format": left,
               "peaked": sum(r["int2"]["peaked"] for r in rows)}
    print(json.dumps(summary))
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                        "layers": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
