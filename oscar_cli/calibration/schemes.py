"""Per-layer fallback: score each layer's OSCAR transform against simple schemes on the held-out tokens.

A calibration can fail on a layer (a key channel with a huge outlier, a target that is not representative):
its held-out attention-output error is then far above what a data-free scheme gets on the same tokens. For
every layer, on the same held-out q/k/v and with the same metric as the clip search
(:mod:`oscar_cli.calibration.clipping`: ``Σ ‖Ô − O‖² / Σ ‖O‖²`` over the scored queries and heads), this
module measures:

- ``oscar``: the calibrated rotation, means and clip ratios (the clip search's own error);
- ``identity``: per-token INT2 with no rotation and no clip, in the artifact's tiers (sink, recent, G);
- ``hadamard``: the same after a natural-order Sylvester Hadamard (QuaRot-style; power-of-two head_dim);
- ``kivi``: KIVI's quantizer, keys per channel over blocks of 128 tokens and values per token, scored in the
  artifact's tiers (:class:`KiviProblem`) and served by the cache's :class:`~oscar_cli.quant.kivi.KiviLayer`;
  scored only when some key is quantized;
- ``bf16``: the layer unquantized (error 0, 16 bits per element).

The rule (:func:`choose_schemes`), with its constants:

1. a layer keeps ``oscar`` unless the best INT2 alternative has less than ``1 / SWITCH_RATIO`` of its error;
   then that alternative serves the layer;
2. a layer whose error (after 1) is above ``BF16_OUTLIER`` × the median of all layers and above
   ``BF16_MIN_ERROR`` is an outlier; outliers, worst first, are kept in BF16 while the artifact's bits per
   element at ``BPE_CONTEXT`` tokens rise by at most ``BF16_MAX_EXTRA_BPE`` over all-INT2.

The artifact's held-out error (mean over layers of the chosen schemes' errors) is then compared with the
baseline's (``kivi`` on every layer, the KIVI-2 method; ``identity`` where KIVI cannot be scored).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from oscar_cli.calibration.clipping import META_DTYPES, LayerClipProblem, evaluate_clip, fake_quantize, int2_pair_mask
from oscar_cli.calibration.copy_score import CopyScore
from oscar_cli.errors import CalibrationError
from oscar_cli.quant.key_subspace import rebase
from oscar_cli.transform import LAYER_SCHEMES, LayerTransform
from oscar_kernels.layout import UNIFORM_INNER

logger = logging.getLogger(__name__)

SWITCH_RATIO = 2.0
BF16_OUTLIER = 10.0
BF16_MIN_ERROR = 0.1
BF16_MAX_EXTRA_BPE = 0.5
BPE_CONTEXT = 32768
KIVI_BLOCK = 128
INT2_SCHEMES = ("oscar", "identity", "hadamard", "kivi")
RULE = (
    f"oscar unless an INT2 alternative has < 1/{SWITCH_RATIO:g} of its held-out error; BF16 for layers above "
    f"{BF16_OUTLIER:g}x the median error and {BF16_MIN_ERROR:g}, worst first, within +{BF16_MAX_EXTRA_BPE:g} "
    f"bits per element at {BPE_CONTEXT} tokens"
)


@dataclass
class LayerScheme:
    """One layer's held-out errors per scheme and the scheme chosen to serve it."""

    index: int
    errors: dict[str, float]  # scheme -> held-out error; schemes that cannot be scored are absent
    scheme: str = "oscar"
    reason: str = ""
    copy: CopyScore | None = None  # the layer's copy score (oscar_cli.calibration.copy_score); None: not measured

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "scheme": self.scheme, "reason": self.reason,
                "errors": {k: round(v, 6) for k, v in self.errors.items()},
                **({"copy": self.copy.to_dict()} if self.copy is not None else {})}


@dataclass
class SchemeReport:
    """The per-layer choice and how the artifact compares with the baseline (``manifest.calibration.schemes``)."""

    layers: list[LayerScheme]
    baseline: str
    artifact_error: float
    baseline_error: float
    oscar_error: float
    bits_per_element: dict[str, float] = field(default_factory=dict)  # "artifact" / "all_int2" at BPE_CONTEXT

    @property
    def fixed(self) -> list[LayerScheme]:
        return [s for s in self.layers if s.scheme != "oscar"]

    @property
    def worse_than_baseline(self) -> bool:
        return self.artifact_error > self.baseline_error

    def to_dict(self) -> dict[str, Any]:
        return {"rule": RULE, "baseline": self.baseline, "artifact_error": round(self.artifact_error, 6),
                "baseline_error": round(self.baseline_error, 6), "oscar_error": round(self.oscar_error, 6),
                "bits_per_element": {k: round(v, 4) for k, v in self.bits_per_element.items()},
                "bpe_context": BPE_CONTEXT, "fixed_layers": [s.index for s in self.fixed]}


class KiviProblem:
    """Held-out error of KIVI's quantizer for one sequence, in the artifact's tiers.

    Keys per channel over blocks of 128 tokens, values per token in groups of ``min(D, 128)`` (no clip). A pair
    (query ``i``, key ``j``) is INT2 where the artifact's tiers put it (:func:`~oscar_cli.calibration.clipping.
    int2_pair_mask`: ``sink ≤ j ≤ i − recent``) and, for keys, ``j`` lies in a complete block. Every INT2
    scheme is so scored on the same tokens, as at long context where the BF16 windows are a small part; the
    cache's KIVI layer then serves the layer with KIVI's own layout (no sink, a BF16 residual of 128).
    """

    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, sink: int, recent: int,
        meta_dtype: str,
    ) -> None:
        from oscar_cli.quant.kivi import dequantize_channels, quantize_channels

        b, hq, tq, d = q.shape
        h_kv, t = k.shape[1], k.shape[2]
        g = hq // h_kv
        dev, meta = q.device, META_DTYPES[meta_dtype]
        if meta == torch.uint8:  # the cache serves a KIVI layer with 16-bit metadata (QuantMethod.for_layer)
            meta = torch.bfloat16
        qg = q.float().reshape(b, h_kv, g * tq, d)
        kf, vf = k.float(), v.float()
        n_blocks = t // KIVI_BLOCK
        k_hat = kf.clone()
        if n_blocks:
            blocks = kf[..., : n_blocks * KIVI_BLOCK, :].reshape(b, h_kv * n_blocks, KIVI_BLOCK, d)
            packed, scale, zero = quantize_channels(blocks, None, meta)
            k_hat[..., : n_blocks * KIVI_BLOCK, :] = dequantize_channels(packed, scale, zero).reshape(
                b, h_kv, n_blocks * KIVI_BLOCK, d)
        v_hat = fake_quantize(vf, 0.0, min(d, KIVI_BLOCK), meta)
        i = torch.arange(t - tq, t, device=dev)[:, None]
        j = torch.arange(t, device=dev)[None, :]
        v_int2 = int2_pair_mask(t, tq, sink, recent, dev).repeat(g, 1)
        k_int2 = v_int2 & (j < n_blocks * KIVI_BLOCK)
        neg = torch.zeros(tq, t, device=dev).masked_fill(~(j <= i), float("-inf")).repeat(g, 1)
        exact = (qg @ kf.transpose(-1, -2)) * scaling + neg
        quant = (qg @ k_hat.transpose(-1, -2)) * scaling + neg
        out = torch.softmax(exact, -1) @ vf
        p = torch.softmax(torch.where(k_int2, quant, exact), -1)
        out_hat = (p * v_int2) @ v_hat + (p * ~v_int2) @ vf
        self.has_int2 = bool(k_int2.any())
        self.sq_error = float((out_hat - out).square().sum())
        self.norm = float(out.square().sum())

    def error(self) -> float:
        return self.sq_error / max(self.norm, 1e-30)


def alternative_transform(scheme: str, head_dim: int) -> LayerTransform:
    """The transform an INT2 alternative serves with: identity, or the Hadamard on K and V (no means, no clip)."""
    if scheme == "hadamard":
        from oscar_kernels.reference import hadamard

        h = hadamard(head_dim, torch.float32).unsqueeze(0)
        return LayerTransform(k_rotation=h, v_rotation=h)
    return LayerTransform()


def score_layer(
    index: int,
    held_out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    oscar_error: float,
    scaling: float,
    sink: int,
    recent: int,
    group_size: int | None,
    meta_dtype: str,
    inner: float = UNIFORM_INNER,
) -> LayerScheme:
    """Errors of every scheme on one layer's held-out sequences (mean over sequences, like the clip search); the
    INT2 schemes use the inner level ``inner`` (recipe ``quant.levels``), KIVI its uniform levels."""
    d = held_out[0][1].shape[-1]
    errors = {"oscar": oscar_error}
    for scheme in ("identity", "hadamard"):
        if scheme == "hadamard" and d & (d - 1):
            continue
        t = alternative_transform(scheme, d)
        problems = [LayerClipProblem(q, k, v, t.k_rotation, t.v_rotation, None, None, scaling, sink, recent,
                                     group_size, meta_dtype, inner=inner) for q, k, v in held_out]
        problems = [p for p in problems if p.has_int2]
        if problems:
            err = evaluate_clip(problems, 0.0, 0.0).error
            if err is not None:
                errors[scheme] = err
    kivi = [KiviProblem(q, k, v, scaling, sink, recent, meta_dtype) for q, k, v in held_out]
    kivi = [p for p in kivi if p.has_int2]
    if kivi:
        errors["kivi"] = sum(p.error() for p in kivi) / len(kivi)
    errors["bf16"] = 0.0
    return LayerScheme(index, errors)


def choose_schemes(layers: list[LayerScheme], bpe: Callable[[list[str]], float]) -> SchemeReport:
    """Apply the module's rule to scored layers (``bpe(schemes)``: the artifact's BPE at ``BPE_CONTEXT``)."""
    for s in layers:
        alts = {k: e for k, e in s.errors.items() if k in INT2_SCHEMES and k != "oscar"}
        best = min(alts, key=lambda k: alts[k]) if alts else None
        if best is not None and alts[best] * SWITCH_RATIO < s.errors["oscar"]:
            s.scheme = best
            s.reason = f"{best} {alts[best]:.4f} < oscar {s.errors['oscar']:.4f} / {SWITCH_RATIO:g}"
    chosen = [s.errors[s.scheme] for s in layers]
    median = statistics.median(chosen) if chosen else 0.0
    all_int2 = bpe([s.scheme for s in layers])
    outliers = sorted((s for s in layers if s.errors[s.scheme] > max(BF16_OUTLIER * median, BF16_MIN_ERROR)),
                      key=lambda s: -s.errors[s.scheme])
    for s in outliers:
        trial = [("bf16" if x is s else x.scheme) for x in layers]
        if bpe(trial) - all_int2 > BF16_MAX_EXTRA_BPE + 1e-9:
            break
        s.reason = (f"{s.scheme} error {s.errors[s.scheme]:.4f} > {BF16_OUTLIER:g}x median {median:.4f}"
                    + (f" ({s.reason})" if s.reason else ""))
        s.scheme = "bf16"
    baseline = "kivi" if all("kivi" in s.errors for s in layers) else "identity"
    base_err = [s.errors.get(baseline, s.errors["oscar"]) for s in layers]
    n = max(len(layers), 1)
    return SchemeReport(
        layers=layers,
        baseline=baseline,
        artifact_error=sum(s.errors[s.scheme] for s in layers) / n,
        baseline_error=sum(base_err) / n,
        oscar_error=sum(s.errors["oscar"] for s in layers) / n,
        bits_per_element={"artifact": bpe([s.scheme for s in layers]), "all_int2": all_int2},
    )


def served_transform(scheme: str, calibrated: LayerTransform, head_dim: int) -> LayerTransform:
    """What the artifact stores for a layer served by ``scheme`` (every field present, as the format needs)."""
    if scheme == "oscar":
        return calibrated
    if LAYER_SCHEMES[scheme] != "int2" or scheme == "identity":
        base = LayerTransform()
    else:
        base = alternative_transform(scheme, head_dim)
    assert calibrated.k_rotation is not None and calibrated.k_mean is not None
    n, h = calibrated.k_rotation.shape[0], calibrated.k_mean.shape[0]
    def rot(r: torch.Tensor | None) -> torch.Tensor:
        return (torch.eye(head_dim) if r is None else r[0]).expand(n, head_dim, head_dim).clone()

    k_rot = rot(base.k_rotation)
    sub = None if calibrated.k_subspace is None else rebase(calibrated.k_subspace, calibrated.k_rotation, k_rot)
    return LayerTransform(k_rotation=k_rot, v_rotation=rot(base.v_rotation),
                          k_mean=torch.zeros(h, head_dim), v_mean=torch.zeros(h, head_dim),
                          k_eigenvalues=calibrated.k_eigenvalues, v_eigenvalues=calibrated.v_eigenvalues,
                          k_subspace=sub,
                          k_mean_pre=None if calibrated.k_mean_pre is None else torch.zeros_like(calibrated.k_mean_pre))


def scheme_bpe(recipe: Any, head_dim: int) -> Callable[[list[str]], float]:
    """``schemes -> bits per element at BPE_CONTEXT`` for the recipe's INT2 layout (sink, recent, G, metadata,
    BF16 keep budget)."""
    from oscar_cli.quant.methods import QuantMethod

    q = recipe.quant
    base = QuantMethod(name="oscar", kind="int2", sink=q.sink, recent=q.recent, group_size=q.group_size,
                       meta_dtype=META_DTYPES[q.meta_dtype], keep_fraction=q.keep.fraction, keep_score=q.keep.score,
                       keep_side=q.keep.side, keep_layers=tuple(q.keep.layers or ()), levels=q.levels,
                       key_subspace=q.key_subspace)

    def bpe(schemes: list[str]) -> float:
        kinds = tuple(LAYER_SCHEMES[s] for s in schemes)
        meth = replace(base, layer_kinds=kinds) if any(k != "int2" for k in kinds) or q.keep.layers else base
        return meth.bits_per_element(BPE_CONTEXT, head_dim)

    return bpe


def check_fallback(report: SchemeReport | None, strict: bool) -> None:
    """Log each fixed layer; warn (``strict``: raise CalibrationError) when the artifact is worse than the baseline."""
    if report is None:
        return
    for s in report.fixed:
        logger.info("layer %d served as %s: %s", s.index, s.scheme, s.reason)
    if not report.worse_than_baseline:
        return
    msg = (f"the artifact's held-out attention error {report.artifact_error:.4f} is worse than the "
           f"{report.baseline} baseline's {report.baseline_error:.4f} (mean over layers)")
    if strict:
        raise CalibrationError(msg, hint="calibrate with more or longer data, or drop --strict to write it anyway")
    logger.warning("CALIBRATION IS WORSE THAN THE BASELINE: %s; serving this artifact may score below %s "
                   "(oscar calibrate --strict refuses it)", msg, report.baseline)
