"""``oscar bench`` results: one :class:`CellResult` per (batch, context), the :class:`BenchResult` record that
``oscar --json bench`` prints (and :func:`result_from_json` reads back), and its plot."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oscar_cli._files import atomic_output


@dataclass(frozen=True)
class CellResult:
    """One (batch, context) cell. Times in µs; ``None`` where a backend cannot run."""

    batch: int
    ctx: int
    splits: int
    int2_us: float
    int2_graph_us: float | None
    int2_bytes: int
    int2_gbps: float  # from the eager time (Python launches: launch-bound at small sizes)
    pct_copy: float
    bf16_us: dict[str, float | None]
    bf16_graph_us: dict[str, float | None]
    best_bf16: str
    best_bf16_us: float
    speedup: float
    speedup_graph: float | None
    pct_copy_graph: float | None = None  # from the CUDA-graph time (what a serving engine runs)
    int2_gbps_graph: float | None = None  # likewise

    @property
    def best_bf16_graph_us(self) -> float | None:
        """The fastest BF16 backend's CUDA-graph time (None where none was timed in a graph)."""
        return min((v for v in self.bf16_graph_us.values() if v is not None), default=None)


@dataclass(frozen=True)
class BenchResult:
    config: dict[str, Any]
    environment: dict[str, Any]
    copy_gbps: float
    cells: list[CellResult]
    quantize: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def result_from_json(record: dict[str, Any]) -> BenchResult:
    """A :class:`BenchResult` back from ``oscar --json bench`` output (``KeyError``/``TypeError`` on other JSON)."""
    return BenchResult(config=record["config"], environment=record["environment"], copy_gbps=record["copy_gbps"],
                       cells=[CellResult(**c) for c in record["cells"]], quantize=record["quantize"],
                       notes=list(record.get("notes", [])))


def plot_series(result: BenchResult) -> tuple[str, list[tuple[str, list[int], list[float]]]]:
    """(timing, [(label, contexts, µs)]) of :func:`save_plot`: per batch size INT2 and the best BF16 backend, from the
    CUDA-graph times when every cell has them (what serving runs and what the docs report; eager times of small
    cells are Python-launch-bound), else from the eager times."""
    graph = all(c.int2_graph_us is not None and c.best_bf16_graph_us is not None for c in result.cells)
    series = []
    for batch in sorted({c.batch for c in result.cells}):
        cs = sorted((c for c in result.cells if c.batch == batch), key=lambda c: c.ctx)
        xs = [c.ctx for c in cs]
        if graph:
            int2 = [float(c.int2_graph_us or 0.0) for c in cs]
            bf16 = [float(c.best_bf16_graph_us or 0.0) for c in cs]
        else:
            int2, bf16 = [c.int2_us for c in cs], [c.best_bf16_us for c in cs]
        series += [(f"INT2 B={batch}", xs, int2), (f"best BF16 B={batch}", xs, bf16)]
    return ("CUDA graph" if graph else "eager"), series


def save_plot(result: BenchResult, path: Path) -> Path:
    """PNG: decode time vs context, INT2 vs best BF16, one line pair per batch size (log scale; CUDA-graph times
    when measured, see :func:`plot_series`), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timing, series = plot_series(result)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    color = None
    for label, xs, ys in series:
        if label.startswith("INT2"):
            color = ax.plot(xs, ys, marker="o", label=label)[0].get_color()
        else:
            ax.plot(xs, ys, marker="s", ls="--", color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(f"decode attention, one layer (µs, median, {timing})")
    cfg = result.config
    pages = f"pages of {cfg.get('page_size')} tokens" if cfg.get("paged", True) else "non-paged"
    ax.set_title(f"{cfg['shape']['name']} on {result.environment['gpu']}, {pages}")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    path = Path(path)
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
