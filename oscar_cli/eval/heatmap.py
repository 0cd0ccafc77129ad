"""PNG heatmap of RULER scores: task × length, one panel per method (matplotlib, Agg backend)."""

from __future__ import annotations

import math
from pathlib import Path

from oscar_cli._files import atomic_output


def plot_heatmap(
    scores: dict[str, dict[str, dict[int, float]]],
    tasks: list[str],
    lengths: list[int],
    methods: list[str],
    path: str | Path,
    title: str = "",
    counts: dict[str, dict[str, dict[int, int]]] | None = None,
    samples: int | None = None,
) -> Path:
    """Write the heatmap atomically to ``path``; cells show the score (0-100), empty cells are grey.

    With ``counts`` and ``samples``, a cell scored on fewer samples than asked shows ``score*`` (partial run);
    the legend for ``*`` is drawn only when some cell carries it. The figure uses matplotlib's constrained
    layout, which keeps the figure title above the panel titles at any size.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import numpy as np

    from oscar_cli._options import format_ctx

    n = len(methods)
    fig, axes = plt.subplots(
        1,
        n,
        figsize=(1.2 + 0.9 * len(lengths) * n + 1.6, 0.45 * len(tasks) + 1.9),
        squeeze=False,
        layout="constrained",
    )
    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="#dddddd")
    image = None
    marked = False
    for ax, m in zip(axes[0], methods, strict=True):
        data = np.array([[scores.get(m, {}).get(t, {}).get(L, math.nan) for L in lengths] for t in tasks], dtype=float)
        image = ax.imshow(np.ma.masked_invalid(data), vmin=0, vmax=100, cmap=cmap, aspect="auto")
        ax.set_title(m, fontsize=10)
        ax.set_xticks(range(len(lengths)), [format_ctx(L) for L in lengths], fontsize=8)
        ax.set_yticks(range(len(tasks)), tasks if ax is axes[0][0] else [""] * len(tasks), fontsize=8)
        for i in range(len(tasks)):
            for j in range(len(lengths)):
                if not math.isnan(data[i, j]):
                    cnt = (counts or {}).get(m, {}).get(tasks[i], {}).get(lengths[j], samples)
                    mark = "*" if samples is not None and cnt is not None and cnt < samples else ""
                    marked = marked or bool(mark)
                    ax.text(j, i, f"{data[i, j]:.0f}{mark}", ha="center", va="center", fontsize=7)
    if image is not None:
        fig.colorbar(image, ax=list(axes[0]), shrink=0.8, label="string_match_all")
    if title or marked:
        legend = "(* = fewer samples than asked)" if marked else ""
        fig.suptitle("   ".join(t for t in (f"RULER NIAH — {title}" if title else "", legend) if t), fontsize=11)
    path = Path(path)
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
