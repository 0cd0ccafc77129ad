"""The KV-cache methods oscar evaluates, all served by the one cache in :mod:`oscar_cli.quant.cache`.

| name          | history quantizer                         | rotation            | BF16 sink / recent     |
|---------------|-------------------------------------------|---------------------|------------------------|
| ``bf16``      | none (everything stays in the act. dtype) | none                | all                    |
| ``naive-int2``| per token asymmetric min-max INT2, G = D  | none                | 0 / 0                  |
| ``quarot-int2``| per token asymmetric min-max INT2, G = D | Sylvester Hadamard  | 0 / 0                  |
| ``kivi-2``    | K per channel over blocks of 128 tokens,  | none                | 0 / residual of 128    |
|               | V per token (own quantizer, :mod:`kivi`)  |                     |                        |
| ``oscar``     | per token INT2 with clip (artifact)       | artifact ``R_K, R_V`` | S0 = 64 / W = 256    |

``naive-int2`` uses the asymmetric min-max quantizer of :mod:`oscar_kernels.reference` (docs/METHOD.md §6), the
same one OSCAR uses, so the comparison isolates the rotation and the windows. The published "naive" baseline is
described as symmetric; the asymmetric one is the stronger of the two, so reported naive numbers are, if
anything, optimistic. ``quarot-int2`` uses the deterministic natural-order Sylvester Hadamard (no random
signs, no clip), the data-free baseline OSCAR compares against.

A method is a frozen :class:`QuantMethod`; per-layer transforms are :class:`oscar_cli.transform.LayerTransform`. The ``oscar``
method comes from an artifact (``oscar_cli.artifact.open_artifact``) or from an in-memory list of
``LayerTransform`` (tests, or before an artifact exists).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from oscar_cli.errors import ArtifactError, EvalError
from oscar_cli.model.geometry import ModelGeometry
from oscar_cli.quant.bits import KIVI_RESIDUAL, mean_bits, storage_bits
from oscar_cli.transform import LAYER_SCHEMES, LayerStorage, LayerTransform
from oscar_kernels.layout import DEFAULT_RECENT, DEFAULT_SINK, DEMOTION_BLOCK, UNIFORM_INNER
from oscar_kernels.reference import META8, meta_bits

MethodKind = LayerStorage



@dataclass(frozen=True)
class QuantMethod:
    """A KV-cache method: how the cache stores each tier and which transforms it applies.

    Attributes:
        name: a name of :data:`oscar_cli.method_registry.METHOD_NAMES` (or a custom label).
        kind: ``dense`` (no quantization), ``int2`` (per-token INT2 via the reference), ``kivi``.
        sink: BF16 sink tokens ``S0`` (absolute positions ``[0, S0)``).
        recent: BF16 recent window ``W`` (demotion in blocks of :data:`DEMOTION_BLOCK` when ``W > 0``).
        group_size: ``G`` along head_dim (None = D).
        meta_dtype: scale/zero storage dtype (16-bit by default; ``torch.uint8``: formula 10's 8-bit metadata of
            ``oscar_kernels.reference``, ``int2`` layers only: a ``kivi`` layer of such a method keeps bfloat16).
        layers: per-layer transforms (empty tuple = identity everywhere).
        source: where the transforms came from (artifact path, "hadamard", ...), for reports.
        digest: what decides how the cache serves the method's artifact, hashed (:func:`serving_digest`; ``""``
            for methods without an artifact): results resume only for the same served artifact.
        layer_kinds: per-layer storage overriding ``kind`` (empty = ``kind`` everywhere): an artifact may keep
            a layer in BF16 (``dense``) or serve it KIVI-style (``kivi``) where OSCAR's INT2 failed on it;
            see :meth:`for_layer`.
        keep_fraction, keep_score, keep_side: the per-token BF16 keep budget of ``int2`` layers (recipe
            ``quant.keep``, :mod:`oscar_cli.quant.keep`; 0 = off; side ``both``, ``keys`` or ``values``).
        keep_layers: the layers the keep budget applies to (recipe ``quant.keep.layers``; empty = every layer).
        levels: the inner INT2 level ``a`` of ``int2`` layers (recipe ``quant.levels``): levels
            ``zero + scale·3·(0, a, 1 - a, 1)``; ``1/3`` = uniform (reference path only otherwise).
        logit_correction: ``none`` or ``scale`` (recipe ``quant.logit_correction``): ``scale`` subtracts each INT2
            key's estimated logit-error variance over 2 from its logits (:func:`oscar_cli.quant.attention.logit_bias`;
            reference path only).
        key_subspace: ``m`` (recipe ``quant.key_subspace``): ``int2`` layers keep each key's coordinates along the
            layer's ``k_subspace`` directions in BF16 (:mod:`oscar_cli.quant.key_subspace`; reference path only);
            0 = off.
        key_mean: ``constant`` or ``rope`` (recipe ``quant.key_mean``): ``rope`` centres ``int2`` layers' INT2 keys
            at position ``p`` by ``RoPE_p(k_mean_pre)·R_K`` (:mod:`oscar_cli.quant.key_mean`; both paths).
        key_bits: 2, or 4 for history keys stored as two INT2 planes (``oscar_kernels.reference`` formula 9,
            unclipped; both transformers paths, not the vLLM backend).
        int4_key_layers: the layers whose keys :meth:`for_layer` serves at 4 bits (recipe ``quant.int4_keys``).
    """

    name: str
    kind: MethodKind
    sink: int = 0
    recent: int = 0
    group_size: int | None = None
    meta_dtype: torch.dtype = torch.bfloat16
    layers: tuple[LayerTransform, ...] = ()
    source: str = ""
    digest: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    layer_kinds: tuple[MethodKind, ...] = ()
    keep_fraction: float = 0.0
    keep_score: str = "qerr"
    keep_side: str = "both"
    keep_layers: tuple[int, ...] = ()
    levels: float = UNIFORM_INNER
    logit_correction: str = "none"
    key_subspace: int = 0
    key_mean: str = "constant"
    key_bits: int = 2
    int4_key_layers: tuple[int, ...] = ()

    def layer(self, idx: int) -> LayerTransform:
        """The transforms of decoder layer ``idx`` (identity when the method has none)."""
        if not self.layers:
            return LayerTransform()
        return self.layers[idx]

    def for_layer(self, idx: int) -> QuantMethod:
        """The method as decoder layer ``idx`` is served: itself, or (with ``layer_kinds``) a ``dense`` copy, or a
        ``kivi`` copy with KIVI-2's own layout (no sink, a BF16 residual of :data:`KIVI_RESIDUAL`, value groups of
        ``min(D, 128)``: what calibration scored)."""
        if self.keep_layers:
            kept = self.keep_fraction if idx in self.keep_layers else 0.0
            return replace(self, keep_layers=(), keep_fraction=kept).for_layer(idx)
        if self.int4_key_layers:
            bits = 4 if idx in self.int4_key_layers else 2
            return replace(self, int4_key_layers=(), key_bits=bits).for_layer(idx)
        if not self.layer_kinds:
            return self
        kind = self.layer_kinds[idx]
        if kind == self.kind:
            return replace(self, layer_kinds=())
        if kind == "kivi":
            meta = torch.bfloat16 if self.meta_dtype == META8 else self.meta_dtype
            return replace(self, kind="kivi", sink=0, recent=KIVI_RESIDUAL, group_size=None, layers=(), layer_kinds=(),
                           meta_dtype=meta,
                           keep_fraction=0.0, levels=UNIFORM_INNER, logit_correction="none", key_subspace=0,
                           key_mean="constant", key_bits=2)
        return replace(self, kind=kind, layer_kinds=(), keep_fraction=0.0, levels=UNIFORM_INNER,
                       logit_correction="none", key_subspace=0, key_mean="constant", key_bits=2)

    @property
    def demotion_block(self) -> int:
        """Tokens demoted from recent to INT2 at once: 8 with a recent window, 1 without."""
        return DEMOTION_BLOCK if self.recent > 0 else 1

    def bits_per_element(self, context_len: int, head_dim: int) -> float:
        """Stored bits per K/V element at ``context_len`` tokens (batch 1, recent window exactly ``W``).

        ``int2``: docs/METHOD.md §9 ``BPE(L)``; ``kivi``: keys ``(L - L mod 128)`` tokens at
        ``2 + 2·b/128`` plus ``L mod 128`` BF16, values ``L - 128`` tokens at ``2 + 2·b/G`` plus 128 BF16,
        averaged over K and V; ``dense``: 16. With ``layer_kinds`` (or per-layer keep / INT4 keys): the mean over
        layers (each layer stores as many elements). INT4 keys add 2 bits per history key. A keep budget adds
        :func:`oscar_cli.quant.keep.keep_bits` to ``int2`` layers, a key subspace
        :func:`oscar_cli.quant.key_subspace.subspace_bits`.
        """
        bits = meta_bits(self.meta_dtype)
        if not (self.layer_kinds or self.keep_layers or self.int4_key_layers):
            return storage_bits(self.kind, context_len, head_dim, group_size=self.group_size, meta_bits=bits,
                                sink=self.sink, recent=self.recent, keep_fraction=self.keep_fraction,
                                keep_side=self.keep_side, key_subspace=self.key_subspace, key_bits=self.key_bits)
        n = len(self.layer_kinds) or len(self.layers)
        if not n:
            raise ValueError("keep_layers / int4_key_layers need the method's per-layer transforms or layer_kinds "
                             "(the layer count)")
        return mean_bits(self.layer_kinds or (self.kind,) * n, context_len, head_dim, group_size=self.group_size,
                         meta_bits=bits, sink=self.sink, recent=self.recent, keep_fraction=self.keep_fraction,
                         keep_side=self.keep_side, keep_layers=self.keep_layers or None, key_subspace=self.key_subspace,
                         int4_key_layers=self.int4_key_layers)


def _per_layer(n_layers: int, t: LayerTransform) -> tuple[LayerTransform, ...]:
    return tuple(t for _ in range(n_layers))


def bf16_method() -> QuantMethod:
    """Uncompressed reference: the cache keeps every token in the activation dtype."""
    return QuantMethod(name="bf16", kind="dense", source="none")


def naive_int2_method() -> QuantMethod:
    """Per-token asymmetric INT2 (G = D), no rotation, no BF16 windows."""
    return QuantMethod(name="naive-int2", kind="int2", source="none")


def quarot_int2_method(config: Any) -> QuantMethod:
    """QuaRot-style INT2: natural-order Sylvester Hadamard on K (online) and V (folded), no windows, no clip.

    ``config``: a transformers config or its :class:`~oscar_cli.model.geometry.ModelGeometry`.
    """
    from oscar_kernels.reference import hadamard

    geo = ModelGeometry.of(config)
    d = geo.head_dim
    if d & (d - 1):
        raise EvalError(f"quarot-int2 needs a power-of-two head_dim, the model has {d}")
    h = hadamard(d, torch.float32).unsqueeze(0)
    t = LayerTransform(k_rotation=h, v_rotation=h)
    return QuantMethod(
        name="quarot-int2", kind="int2", layers=_per_layer(geo.num_layers, t), source="hadamard"
    )


def kivi2_method() -> QuantMethod:
    """KIVI-2: keys per channel over blocks of 128 tokens, values per token, BF16 residual of 128."""
    return QuantMethod(name="kivi-2", kind="kivi", recent=KIVI_RESIDUAL, source="none")


def oscar_method(
    layers: list[LayerTransform] | tuple[LayerTransform, ...],
    *,
    sink: int = DEFAULT_SINK,
    recent: int = DEFAULT_RECENT,
    group_size: int | None = None,
    meta_dtype: torch.dtype = torch.bfloat16,
    source: str = "in-memory",
) -> QuantMethod:
    """OSCAR from per-layer transforms (rotations, means, clip ratios) with the BF16 sink and recent window."""
    if sink % 8 or recent % 8:
        raise EvalError(f"sink ({sink}) and recent ({recent}) must be multiples of 8 (tokens move to INT2 in blocks "
                        "of 8; docs/METHOD.md §7)")
    return QuantMethod(
        name="oscar",
        kind="int2",
        sink=sink,
        recent=recent,
        group_size=group_size,
        meta_dtype=meta_dtype,
        layers=tuple(layers),
        source=source,
    )


_META = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "uint8": META8}


def oscar_from_artifact(ref: str, config: Any) -> QuantMethod:
    """Build the ``oscar`` method from an artifact (local path or ``hf://ORG/NAME@REV``).

    ``open_artifact`` validates the artifact and refuses it (ArtifactError naming the differing fields) when
    its architecture fingerprint differs from ``config``'s. The INT2 layout (sink, recent, G, metadata dtype)
    is the one the artifact's clips were chosen for (``manifest.quant``), with its BF16 keep budget if any.
    """
    from oscar_cli.artifact import open_artifact

    geo = ModelGeometry.of(config)
    art = open_artifact(ref, expect_architecture=geo.fingerprint())
    n_layers = geo.num_layers
    if len(art.layers) != n_layers:
        raise ArtifactError(f"artifact {ref} has {len(art.layers)} layers, the model {n_layers}")
    quant = dict(art.manifest.quant)
    schemes = artifact_schemes(art.manifest.calibration, n_layers, ref)
    kinds = tuple(LAYER_SCHEMES[s] for s in schemes)
    layers = [t if LAYER_SCHEMES[s] == "int2" and s != "identity" else LayerTransform()
              for t, s in zip(art.layers, schemes, strict=True)]
    fixed = sum(s != "oscar" for s in schemes)
    meth = oscar_method(
        layers,
        sink=int(quant.get("sink", DEFAULT_SINK)),
        recent=int(quant.get("recent", DEFAULT_RECENT)),
        group_size=quant.get("group_size"),
        meta_dtype=_META[str(quant.get("meta_dtype", "bfloat16"))],  # the manifest's schema allows only these
        source=f"{ref} ({art.manifest.method}, rotations {_short_hash(art.manifest.files)})",
    )
    keep = quant.get("keep") or {}
    return replace(meth, digest=serving_digest(art.manifest, schemes), layer_kinds=kinds if any(k != "int2" for k in kinds) else (),
                   extra={"schemes": schemes} if fixed else {}, keep_fraction=float(keep.get("fraction", 0.0)),
                   keep_score=str(keep.get("score", "qerr")), keep_side=str(keep.get("side", "both")),
                   keep_layers=tuple(int(i) for i in keep.get("layers") or ()), levels=float(quant.get("levels", UNIFORM_INNER)),
                   logit_correction=str(quant.get("logit_correction") or "none"),
                   key_subspace=int(quant.get("key_subspace") or 0),
                   key_mean=str(quant.get("key_mean") or "constant"),
                   int4_key_layers=tuple(int(i) for i in quant.get("int4_keys") or ()))


def serving_digest(manifest: Any, schemes: list[str]) -> str:
    """``sha256:`` over what decides how an artifact is served: ``method``, ``grouping``, ``quant``, the per-layer
    schemes and the sha256 of every file (tensors, recipe). Unlike the content digest it ignores documentation
    fields (``evaluation``, ``environment``, ``created``), which change nothing the cache does."""
    import hashlib
    import json

    doc = {"method": manifest.method, "grouping": manifest.grouping, "quant": manifest.quant, "schemes": schemes,
           "files": manifest.files}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def artifact_schemes(calibration: dict[str, Any], n_layers: int, ref: str) -> list[str]:
    """Per-layer schemes of an artifact's ``calibration.layers`` (absent: ``oscar`` everywhere)."""
    rows = calibration.get("layers")
    if rows is None:
        return ["oscar"] * n_layers
    if not isinstance(rows, list) or len(rows) != n_layers:
        raise ArtifactError(f"artifact {ref}: calibration.layers must list {n_layers} layers")
    out = []
    for i, row in enumerate(rows):
        scheme = row.get("scheme") if isinstance(row, dict) else None
        if scheme not in LAYER_SCHEMES:
            raise ArtifactError(f"artifact {ref}: calibration.layers[{i}].scheme {scheme!r} is not one of "
                                f"{', '.join(LAYER_SCHEMES)}")
        out.append(str(scheme))
    return out


def _short_hash(files: dict[str, str]) -> str:
    """The first 12 hex digits of the rotations file's sha256 (results resume only for the same tensors)."""
    sha = files.get("rotations.safetensors") or next(iter(sorted(files.values())), "")
    return sha[:12] or "unhashed"
