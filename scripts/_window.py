"""What the one-window probes (``meta_precision.py``, ``logit_variance.py``) share: their command line for a prose
window of a model with an oscar artifact, and loading that window.

Imported by those scripts from their own folder (``python scripts/NAME.py`` puts ``scripts/`` on ``sys.path``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch


def window_parser(doc: str, artifact_help: str) -> argparse.ArgumentParser:
    """The shared arguments: MODEL (the embedded one by default), --artifact, --text, --ctx, --offset, --queries;
    ``doc`` is the script's docstring (first paragraph: description, the rest: epilog)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="smollm2-135m")
    p.add_argument("--artifact", required=True, help=artifact_help)
    p.add_argument("--text", required=True, help="prose to take the window from")
    p.add_argument("--ctx", type=int, default=2048, help="window length in tokens")
    p.add_argument("--offset", type=int, default=0, help="first token of the window in the tokenized text")
    p.add_argument("--queries", type=int, default=64, help="last queries of the window scored")
    return p


def load_window(args: argparse.Namespace, device: str = "cpu",
                dtype: torch.dtype | None = None) -> tuple[Any, Any, torch.Tensor]:
    """(loaded model, the artifact's method, ``input_ids [1, ctx]`` of the window) for parsed ``args``."""
    from oscar_cli.model.load import load_model
    from oscar_cli.quant.methods import oscar_from_artifact

    lm = load_model(args.model, device=device, **({"dtype": dtype} if dtype is not None else {}))
    meth = oscar_from_artifact(args.artifact, lm.model.config)
    ids = lm.tokenizer(Path(args.text).read_text(encoding="utf-8"), return_tensors="pt").input_ids
    ids = ids[:, args.offset : args.offset + args.ctx]
    if ids.shape[1] < args.ctx:
        raise SystemExit(f"the text has {ids.shape[1]} tokens from offset {args.offset}, need {args.ctx}")
    return lm, meth, ids
