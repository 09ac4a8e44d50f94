"""``loss_curves.png``: lm loss, grad norm and memory per step, upstream vs patched vs golden.

Three panels side by side (x: training step; y: 'lm loss' in nats, 'grad-norm' unitless,
memory in MiB). The memory panel draws each run's ``memory.json`` series
(``memory_report``): the step peak (thick), the megatron tensors of the layer-wise param
sync (dots) and the NCCL temporaries the collective model gives for the same calls
(crosses), in the run's colour and dash; upstream and patched on one axis, so the param-sync gap and
whether it moves the step peak read off directly.
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
#: Memory panel: per memory.json field, its legend text and line weight; per run, its
#: colour and dash (patched dashed over upstream, as in the other panels).
MEMORY_LINES = (
    ("step_peak_bytes", "step peak", dict(linewidth=2.8)),
    ("megatron_bytes", "param sync, megatron", dict(linewidth=1.4, marker=".", markersize=4)),
    ("nccl_temporary_bytes", "param sync, NCCL model", dict(linewidth=1.0, marker="x", markersize=3)),
)
MEMORY_RUN_STYLES = {
    "upstream": dict(color="tab:blue", linestyle="-", alpha=0.8),
    "patched": dict(color="tab:orange", linestyle="--"),
}
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
    memory: Mapping[str, Mapping | None] | None = None,
) -> Path:
    """Write the PNG and return its path.

    Args:
        path: output file (parent folders are created).
        curves: label ("upstream", "patched", "golden") -> that side's metrics, or None
            when the side is absent (e.g. no golden file yet). Other labels get default
            matplotlib styles.
        first_divergent_step: marked with a vertical line, or None.
        title: figure title (e.g. the case name and verdict line).
        memory: run label -> its ``memory.json`` dict (``memory_report``), or None; the
            third panel says so where no run has one.

    Raises:
        ValueError: no curve has either panel's metric (an empty plot would hide a bug).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    present = [m for m, _ in PANELS if any(c and m in c for c in curves.values())]
    if not present:
        raise ValueError(f"no curve has any of {[m for m, _ in PANELS]}")
    fig = Figure(figsize=(17, 4.8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(PANELS) + 1)
    _memory_panel(axes[-1], memory or {}, first_divergent_step)
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
        _mark_divergence(ax, first_divergent_step)
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


def _mark_divergence(ax, step: int | None) -> None:
    if step is None:
        return
    ax.axvline(step, color="red", linewidth=1.0, alpha=0.8)
    ax.annotate(
        f"first divergence: step {step}",
        xy=(step, 0.0),
        xycoords=("data", "axes fraction"),
        xytext=(4, 6),
        textcoords="offset points",
        color="red",
        fontsize=9,
        bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="none", alpha=0.8),
    )


def memory_lines(memory: Mapping[str, Mapping | None]) -> list:
    """The memory panel's lines: [(legend label, steps, MiB per step)], per run with a
    ``memory.json`` and per ``MEMORY_LINES`` field, in that order."""
    from .memory_report import MIB, series

    lines = []
    for label, summary in memory.items():
        if not summary or not summary.get("steps"):
            continue
        for field, text, _ in MEMORY_LINES:
            points = series(summary, field)
            lines.append((f"{label}: {text}", list(points), [v / MIB for v in points.values()]))
    return lines


def _memory_panel(ax, memory: Mapping[str, Mapping | None], first_divergent_step: int | None) -> None:
    """Per-step memory of each run (MiB); a note instead of lines where none was recorded."""
    lines = memory_lines(memory)
    styles = {text: style for _, text, style in MEMORY_LINES}
    for label, steps, mib in lines:
        run, _, text = label.partition(": ")
        ax.plot(steps, mib, label=label, **{**MEMORY_RUN_STYLES.get(run, {}), **styles[text]})
    if not lines:
        ax.text(0.5, 0.5, "no param-sync records", ha="center", va="center", transform=ax.transAxes)
    _mark_divergence(ax, first_divergent_step)
    ax.set_xlabel("step")
    ax.set_ylabel("MiB (max over ranks)")
    ax.set_title("memory per step")
    ax.grid(True, alpha=0.3)
    if lines:
        ax.set_ylim(bottom=0)
        ax.legend(loc="center right", fontsize=7)
