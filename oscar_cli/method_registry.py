"""The KV-cache methods by name: one registry that validates names, lists them and builds each method.

Torch-free at import (the CLI lists and validates names without loading torch); :meth:`KVMethod.build`
imports the builders of :mod:`oscar_cli.quant.methods` when a method is actually made.

Example::

    from oscar_cli.method_registry import METHOD_NAMES, build_method, parse_methods
    names = parse_methods("bf16,oscar")                      # validated, deduplicated
    meth = build_method("oscar", model.config, artifact="artifacts/...")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from oscar_cli.errors import EvalError

if TYPE_CHECKING:
    from oscar_cli.model.geometry import ModelGeometry
    from oscar_cli.quant.methods import QuantMethod


class KVMethod:
    """A named KV-cache method: builds its :class:`~oscar_cli.quant.methods.QuantMethod` for one model.

    The method's ``kind`` (``dense``, ``int2``, ``kivi``) picks the cache layers that serve it.

    Attributes:
        name: the ``--methods`` name.
        summary: one line for help texts.
        needs_artifact: True when :meth:`build` needs a calibration artifact.
        own_layout: True when the method keeps its own BF16 windows (``--bf16-windows`` does not apply).
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    needs_artifact: ClassVar[bool] = False
    own_layout: ClassVar[bool] = False

    def build(self, geo: ModelGeometry, artifact: str | None) -> QuantMethod:
        raise NotImplementedError


class Bf16(KVMethod):
    name, summary, own_layout = "bf16", "uncompressed reference (every token in the activation dtype)", True

    def build(self, geo: ModelGeometry, artifact: str | None) -> QuantMethod:
        from oscar_cli.quant.methods import bf16_method

        return bf16_method()


class NaiveInt2(KVMethod):
    name, summary = "naive-int2", "per-token INT2, no rotation, no BF16 windows"

    def build(self, geo: ModelGeometry, artifact: str | None) -> QuantMethod:
        from oscar_cli.quant.methods import naive_int2_method

        return naive_int2_method()


class QuarotInt2(KVMethod):
    name, summary = "quarot-int2", "per-token INT2 after a Hadamard rotation (QuaRot-style, data-free)"

    def build(self, geo: ModelGeometry, artifact: str | None) -> QuantMethod:
        from oscar_cli.quant.methods import quarot_int2_method

        return quarot_int2_method(geo)


class Kivi2(KVMethod):
    name, summary, own_layout = "kivi-2", "KIVI: keys per channel, values per token, BF16 residual of 128", True

    def build(self, geo: ModelGeometry, artifact: str | None) -> QuantMethod:
        from oscar_cli.quant.methods import kivi2_method

        return kivi2_method()


class Oscar(KVMethod):
    name, summary, needs_artifact = "oscar", "calibrated rotations and clips from an artifact, BF16 sink/recent", True

    def build(self, geo: ModelGeometry, artifact: str | None) -> QuantMethod:
        from oscar_cli.quant.methods import oscar_from_artifact

        if artifact is None:
            raise EvalError(
                "method oscar needs --artifact (a calibration artifact: local path or hf://ORG/NAME@REV)",
                hint="run: oscar calibrate MODEL, or drop oscar from --methods",
            )
        return oscar_from_artifact(artifact, geo)


REGISTRY: dict[str, KVMethod] = {m.name: m for m in (Bf16(), NaiveInt2(), QuarotInt2(), Kivi2(), Oscar())}
METHOD_NAMES: tuple[str, ...] = tuple(REGISTRY)


def get_method(name: str) -> KVMethod:
    """The registered method ``name``; EvalError listing the valid names otherwise (the one name check)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise EvalError(f"unknown method {name!r}; valid methods: {', '.join(METHOD_NAMES)}") from None


def parse_methods(text: str | list[str]) -> list[str]:
    """``"bf16,oscar"`` -> ``["bf16", "oscar"]`` (deduplicated, in order); unknown names raise with the valid list."""
    items = text.split(",") if isinstance(text, str) else [p for t in text for p in t.split(",")]
    names = [i.strip() for i in items if i.strip()]
    if not names:
        raise EvalError(f"no methods given; valid methods: {', '.join(METHOD_NAMES)}")
    for n in names:
        get_method(n)
    return list(dict.fromkeys(names))


def parse_windows(text: str | None) -> tuple[int, int] | None:
    """``"64,256"`` -> ``(64, 256)``; None/empty -> None."""
    if not text:
        return None
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise EvalError(f"--bf16-windows {text!r}: expected SINK,RECENT such as 64,256")
    return int(parts[0]), int(parts[1])


def build_method(
    name: str, config: Any, artifact: str | None = None, windows: tuple[int, int] | None = None
) -> QuantMethod:
    """A method by name for a model (transformers config or :class:`ModelGeometry`); ``oscar`` needs ``artifact``.

    ``windows = (S0, W)`` overrides the BF16 sink and recent window of the per-token INT2 methods
    (``naive-int2``, ``quarot-int2``, ``oscar``) — an equal-window ablation; methods with their own layout
    (``bf16``, ``kivi-2``) keep it. The override is recorded in ``source`` (resumed results never mix layouts).
    """
    from dataclasses import replace

    from oscar_cli.model.geometry import ModelGeometry

    spec = get_method(name)
    meth = spec.build(ModelGeometry.of(config), artifact)
    if windows is None or spec.own_layout:
        return meth
    sink, recent = windows
    if sink < 0 or recent < 0 or sink % 8 or recent % 8:
        raise EvalError(f"--bf16-windows {sink},{recent}: sink and recent must be non-negative multiples of 8")
    return replace(meth, sink=sink, recent=recent, source=f"{meth.source} +windows S0={sink} W={recent}")


def methods_help() -> str:
    """``name: summary`` for every registered method, for ``--methods`` help texts."""
    return "; ".join(f"{m.name}: {m.summary}" for m in REGISTRY.values())
