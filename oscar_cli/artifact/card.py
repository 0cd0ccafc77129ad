"""The model card (``README.md``) of a published oscar artifact, rendered from its manifest.

The card is a pure function of the manifest and the repo id, so re-exporting an identical artifact renders a
byte-identical card (and the Hub sees no change). It carries YAML metadata the Hub indexes
(``library_name: oscar-kv``, ``base_model``, ``tags``, ``model-index`` when the artifact carries evaluation
results, and an ``oscar:`` block with the quantization settings and bits per element), then a human body:
what the artifact is, how to pull it pinned, the quantization table, evaluation results, provenance and
file hashes. No token, path or host name ever enters it.

``ModelCard.validate()`` is deliberately not called: it POSTs to the Hub (``/api/validate-yaml``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from oscar_cli.artifact.manifest import model_slug
from oscar_cli.vllm.spec import FAST_BLOCK_SIZE, fast_pages_fit
from oscar_kernels.layout import DEFAULT_RECENT, DEFAULT_SINK

if TYPE_CHECKING:
    from huggingface_hub import ModelCardData

LIBRARY_NAME = "oscar-kv"
BASE_TAGS = ["oscar", "kv-cache", "kv-cache-quantization", "int2", "2-bit"]
# Upstream Hub repos of oscar's built-in model aliases (the embedded GGUF is a conversion of this model).
ALIAS_BASE_MODELS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
# Context lengths at which the card states bits per element.
BPE_CONTEXTS = (4096, 32768, 131072)
_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def base_model_of(manifest: Mapping[str, Any]) -> str | None:
    """The Hub repo id of the model the artifact was calibrated for, or None when it has none.

    ``model.resolved`` is ``"ORG/NAME@sha"`` for Hub models and ``"sha256:<hex>"`` for local files and folders;
    built-in aliases (a conversion of a Hub model) map to their upstream repo.
    """
    model = manifest.get("model") or {}
    resolved = str(model.get("resolved") or "")
    repo, sep, _ = resolved.partition("@")
    if sep and _REPO_RE.match(repo):
        return repo
    return ALIAS_BASE_MODELS.get(str(model.get("reference") or "").lower())


def _block_flag(quant: Mapping[str, Any]) -> str:
    """`` --block-size 64`` for the card's `vllm serve` line when the backend's fastest pages can hold the sink,
    else nothing (vLLM's 16)."""
    return f" --block-size {FAST_BLOCK_SIZE}" if fast_pages_fit(int(quant.get("sink", DEFAULT_SINK))) else ""


def bpe_table(manifest: Mapping[str, Any]) -> dict[str, float]:
    """Bits per K/V element at 4k, 32k and 128k tokens as the artifact is served: its quant settings (sink/recent
    in BF16, the BF16 keep budget with its side and layers, a BF16 key subspace, INT4 keys) and its per-layer schemes
    (``calibration.layers``: a layer kept in BF16 costs 16, one served by KIVI KIVI's layout), the mean over layers
    (:func:`oscar_cli.quant.bits.storage_bits`, what eval-ruler and eval-kl report).

    Returns ``{"4k": 2.9, ...}`` rounded to 4 decimals; empty when the manifest lacks ``head_dim``.
    """
    from oscar_cli.quant.bits import META_BITS, mean_bits
    from oscar_cli.transform import LAYER_SCHEMES

    quant = manifest.get("quant") or {}
    arch = manifest.get("architecture") or {}
    head_dim = arch.get("head_dim") or quant.get("head_dim")
    if not head_dim:
        return {}
    keep = quant.get("keep") or {}
    rows = (manifest.get("calibration") or {}).get("layers")
    if isinstance(rows, list) and rows and all(isinstance(r, dict) and r.get("scheme") in LAYER_SCHEMES for r in rows):
        kinds = [LAYER_SCHEMES[r["scheme"]] for r in rows]
    else:
        kinds = ["int2"] * max(int(arch.get("num_layers") or 0), 1)
    return {f"{ctx // 1024}k": round(mean_bits(
        kinds, ctx, int(head_dim), group_size=quant.get("group_size") or None,
        meta_bits=META_BITS.get(str(quant.get("meta_dtype")), 16), sink=int(quant.get("sink", DEFAULT_SINK)),
        recent=int(quant.get("recent", DEFAULT_RECENT)), keep_fraction=float(keep.get("fraction") or 0.0),
        keep_side=str(keep.get("side", "both")), keep_layers=keep.get("layers"),
        key_subspace=int(quant.get("key_subspace") or 0), int4_key_layers=quant.get("int4_keys") or ()), 4)
        for ctx in BPE_CONTEXTS}


def evaluation_rows(manifest: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The artifact's evaluation results as flat rows ``{task, metric, value, ...}`` (may be empty).

    Accepts ``evaluation`` as a list of result dicts, or a dict whose ``results`` is such a list, or a plain
    ``{task: score}`` mapping. A row needs a numeric ``value`` (``score`` / ``accuracy`` are accepted too).
    """
    ev = manifest.get("evaluation")
    if not ev:
        return []
    items: list[Any]
    if isinstance(ev, Mapping) and isinstance(ev.get("results"), list):
        items = list(ev["results"])
    elif isinstance(ev, list):
        items = ev
    elif isinstance(ev, Mapping):
        items = [{"task": k, "value": v} for k, v in ev.items() if isinstance(v, int | float)]
    else:
        return []
    rows = []
    for item in items:
        if not isinstance(item, Mapping):
            continue
        value = next((item[k] for k in ("value", "score", "accuracy") if isinstance(item.get(k), int | float)), None)
        if value is None:
            continue
        row = {"task": str(item.get("task") or item.get("name") or "eval"),
               "metric": str(item.get("metric") or "score"), "value": float(value)}
        for key in ("ctx", "context", "method", "dataset", "samples"):
            if key in item:
                row[key] = item[key]
        rows.append(row)
    return rows


def card_data(manifest: Mapping[str, Any], repo_id: str | None = None) -> ModelCardData:
    """The YAML metadata block (``ModelCardData``) of the card."""
    from huggingface_hub import EvalResult, ModelCardData

    arch = manifest.get("architecture") or {}
    method = str(manifest.get("method") or "oscar")
    tags = BASE_TAGS + [t for t in (method, arch.get("model_type")) if t and t not in BASE_TAGS]
    # only the artifact's own rows are claimed ("oscar" is eval-ruler's name for the artifact method)
    rows = [r for r in evaluation_rows(manifest) if r.get("method", method) in (method, "oscar")]
    evals = [
        EvalResult(
            task_type="text-generation",
            dataset_type=str(r.get("dataset") or r["task"]),
            dataset_name=_row_label(r),
            metric_type=r["metric"],
            metric_value=r["value"],
        )
        for r in rows
    ]
    oscar_block = {
        "format_version": manifest.get("format_version"),
        "oscar_version": manifest.get("oscar_version"),
        "method": method,
        "grouping": manifest.get("grouping"),
        "model": (manifest.get("model") or {}).get("resolved"),
        "digest": manifest.get("digest"),
        "quant": dict(manifest.get("quant") or {}),
        "bits_per_element": bpe_table(manifest),
    }
    return ModelCardData(
        library_name=LIBRARY_NAME,
        base_model=base_model_of(manifest),
        tags=tags,
        license=manifest.get("license") or None,
        model_name=_title(manifest, repo_id) if evals else None,
        eval_results=evals or None,
        oscar={k: v for k, v in oscar_block.items() if v not in (None, {}, "")},
    )


def _row_label(row: Mapping[str, Any]) -> str:
    ctx = row.get("ctx", row.get("context"))
    return f"{row['task']} @ {ctx}" if ctx is not None else str(row["task"])


def _title(manifest: Mapping[str, Any], repo_id: str | None) -> str:
    if repo_id:
        return repo_id.split("/", 1)[1]
    return f"{model_slug(str((manifest.get('model') or {}).get('reference') or 'model'))}-{manifest.get('method', 'oscar')}"


def render_model_card(manifest: Mapping[str, Any], repo_id: str | None = None) -> str:
    """The whole ``README.md``: ``---`` YAML metadata ``---`` then the Markdown body (deterministic).

    ``repo_id`` (``ORG/NAME``) is where the card is published; without it (a local artifact) the card shows
    how to load and publish the folder instead of how to pull it.
    """
    meta = card_data(manifest, repo_id).to_yaml()
    model = manifest.get("model") or {}
    quant = manifest.get("quant") or {}
    data = manifest.get("data") or {}
    base = base_model_of(manifest)
    lines = [
        "---", meta, "---", "",
        f"# {_title(manifest, repo_id)}: OSCAR 2-bit KV-cache artifact",
        "",
        f"Calibrated rotations, means and clip ratios that let [oscar](https://pypi.org/project/{LIBRARY_NAME}/) "
        f"store the KV cache of `{model.get('reference', base or 'the model')}` in INT2 "
        f"(method `{manifest.get('method', 'oscar')}`). It holds no model weights: load the base model as usual.",
        "",
    ]
    if repo_id:
        lines += [
            "## Use it (pin a revision)",
            "",
            "```bash",
            f"pip install {LIBRARY_NAME}",
            f"oscar pull hf://{repo_id}@<tag-or-commit-sha>     # prints {repo_id}@<sha> and the local path",
            "```",
            "",
            "```python",
            "import oscar_cli as oscar   # model: the base model loaded with transformers",
            f'cache = oscar.kv_cache(model, "hf://{repo_id}@<tag-or-commit-sha>")   # validated; modifies model in place',
            "out = model.generate(**inputs, past_key_values=cache)",
            "```",
            "",
            "Tags name releases; a 40-hex commit sha is immutable and is what reproducible pipelines should pin.",
            "",
            "Serve it in vLLM 0.25 (`pip install 'oscar-kv[vllm]'`; the plugin registers the INT2 attention backend):",
            "",
            "```bash",
            f"vllm serve {base or 'MODEL'} --attention-backend CUSTOM --max-num-seqs 64{_block_flag(quant)} \\",
            f"    --additional-config '{{\"oscar_artifact\": \"hf://{repo_id}@<tag-or-commit-sha>\"}}'",
            "```",
            "",
        ]
    else:
        lines += [
            "## Use it",
            "",
            "```bash",
            "oscar eval-ruler MODEL --artifact THIS_FOLDER                   # RULER NIAH through the INT2 cache",
            "oscar export THIS_FOLDER --repo-id ORG/NAME --tag v0.1.0        # publish it (this card is re-rendered)",
            "```",
            "",
        ]
    lines += [
        "## Quantization",
        "",
        "| setting | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | `{v}` |" for k, v in quant.items()]
    bpe = bpe_table(manifest)
    if bpe:
        lines += ["", "Bits per K/V element (INT2 history, BF16 sink + recent windows):", "",
                  "| context | " + " | ".join(bpe) + " |", "|---|" + "---|" * len(bpe),
                  "| bits/element | " + " | ".join(f"{v:.3f}" for v in bpe.values()) + " |"]
    rows = evaluation_rows(manifest)
    if rows:
        ev = manifest.get("evaluation")
        partial = isinstance(ev, Mapping) and ev.get("complete") is False
        lines += ["", "## Evaluation", ""]
        if partial:
            lines += ["Partial run (stopped by its time budget): not every requested sample was evaluated.", ""]
        lines += ["| method | task | metric | value | samples |", "|---|---|---|---|---|"]
        lines += [f"| {r.get('method', manifest.get('method', 'oscar'))} | {_row_label(r)} | {r['metric']} | "
                  f"{r['value']:.4f} | {r.get('samples', '')} |" for r in rows]
    lines += [
        "", "## Provenance", "",
        f"- model: `{model.get('resolved', model.get('reference', '?'))}`",
        f"- calibration data: `{data.get('source', '?')}` ({data.get('tokens', '?')} tokens, "
        f"sha256 `{str(data.get('sha256', '?'))[:16]}`), seed {manifest.get('seed', '?')}",
        f"- oscar {manifest.get('oscar_version', '?')}, artifact format v{manifest.get('format_version', '?')}, "
        f"created {manifest.get('created', '?')}",
        f"- content digest: `{manifest.get('digest', '?')}` (over the manifest and every file it lists; "
        "`oscar pull REF --expect-digest DIGEST` checks it)",
        "", "## Files", "", "| file | sha256 |", "|---|---|",
    ]
    lines += [f"| `{name}` | `{digest}` |" for name, digest in sorted((manifest.get("files") or {}).items())]
    return "\n".join(lines) + "\n"
