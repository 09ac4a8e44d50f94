"""``loss_curves.png``: lm loss and grad norm per step, upstream vs patched vs golden.

Two panels side by side (x: training step; y: 'lm loss' in nats, 'grad-norm' unitless).
Golden is a wide light-grey band at the bottom of the stack, upstream a solid blue line on
it, patched an orange dashed line with dots on top (when upstream and patched are
identical, the dashes run exactly over the blue line). The first divergent step, if any,
is a red vertical line in both panels with an annotation at the bottom.
Steps without a value (nan) are gaps. Uses matplotlib's Agg canvas directly, no pyplot
global state, so it works headless and from several threads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from .golden_schema import MetricSeries

PANELS = (("lm loss", "lm loss"), ("grad-norm", "grad norm"))
STYLES = {
    "golden": dict(color="0.55", linestyle="-", linewidth=6.0, alpha=0.4, zorder=1),
    "upstream": dict(color="tab:blue", linestyle="-", linewidth=2.0, zorder=2),
    "patched": dict(
        color="tab:orange", linestyle="--", linewidth=1.4, marker=".", markersize=4, zorder=3
    ),
}


def plot_loss_curves(
    path: str | Path,
    curves: Mapping[str, Mapping[str, MetricSeries] | None],
    first_divergent_step: int | None = None,
    title: str = "",
) -> Path:
    """Write the PNG and return its path.

    Args:
        path: output file (parent folders are created).
        curves: label ("upstream", "patched", "golden") -> that side's metrics, or None
            when the side is absent (e.g. no golden file yet). Other labels get default
            matplotlib styles.
        first_divergent_step: marked with a vertical line, or None.
        title: figure title (e.g. the case name and verdict line).

    Raises:
        ValueError: no curve has either panel's metric (an empty plot would hide a bug).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    present = [m for m, _ in PANELS if any(c and m in c for c in curves.values())]
    if not present:
        raise ValueError(f"no curve has any of {[m for m, _ in PANELS]}")
    fig = Figure(figsize=(12, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(PANELS))
    for ax, (metric, ylabel) in zip(axes, PANELS):
        drawn = False
        for label, metrics in curves.items():
            if not metrics or metric not in metrics:
                continue
            series = metrics[metric]
            steps = list(series.steps)
            values = [series.values[t] for t in steps]
            ax.plot(steps, values, label=label, **STYLES.get(label, {}))
            drawn = True
        if not drawn:
            ax.text(
                0.5, 0.5, f"no '{metric}' logged", ha="center", va="center", transform=ax.transAxes
            )
        if first_divergent_step is not None:
            ax.axvline(first_divergent_step, color="red", linewidth=1.0, alpha=0.8)
            ax.annotate(
                f"first divergence: step {first_divergent_step}",
                xy=(first_divergent_step, 0.0),
                xycoords=("data", "axes fraction"),
                xytext=(4, 6),
                textcoords="offset points",
                color="red",
                fontsize=9,
                bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="none", alpha=0.8),
            )
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(metric)
        ax.grid(True, alpha=0.3)
        if drawn:
            ax.legend(loc="best")
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
