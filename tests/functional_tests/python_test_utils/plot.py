"""``loss_curves.png``: one figure that says what a functional case compared and what it found.

Read without the README: the title names the case, the megatron-core base (its version), the
two trees ("pristine" = the base as released, "series" = it + its series), the ranks and the device,
and the verdict with what it means ("identical" = bit for bit equal, both within the golden
tolerance). Four panels, x: training step:

* **lm loss** (nats) and **grad norm** (unitless): golden values as a grey band of the
  golden tolerance (``tolerances.GOLDEN_RULES``: ``|actual - golden| <= atol + rtol *
  |golden|``), pristine a solid line, series a dashed line with dots on top (when the two
  are identical the dashes run exactly over the solid line).
* **param sync memory** (MiB per step, max over ranks, ``memory_report``): tensors megatron
  allocates inside the layer-wise param sync and the NCCL temporaries the collective model
  gives for the same calls, one marker per step so that a series at 0 stays visible (the y
  axis starts below 0, markers of different shapes and sizes); forced syncs between steps
  (eval, checkpoint save) as stars (megatron) and triangles (NCCL) at step + 0.5. Each legend entry gives the series'
  maximum, the figure the main job's memory table prints.
* **step peak** (MiB above the step's start, max over ranks): per run, with its maximum
  drawn as a dotted line and given in the legend, the table's "step peak" row.

The first divergent step, if any, is a red vertical line in every panel. Each base has its
own colours (0.17.1 blue/orange, 0.19 green/purple), so the two bases' plots differ at a
glance. Steps without a value (nan) are gaps. Uses matplotlib's Agg canvas directly, no
pyplot global state, so it works headless and from several threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

from .checks import VARIANTS
from .golden_schema import MetricSeries
from .memory_report import MIB, series, step_maxima
from .tolerances import GOLDEN_RULES, Approximate, Exact, MetricRule

PANELS = (("lm loss", "lm loss (nats)"), ("grad-norm", "grad norm"))
#: Line colours per megatron-core base (``harness.trees.BASES`` keys): pristine, series.
BASE_COLOURS = {
    "0.17.1": {"pristine": "tab:blue", "series": "tab:orange"},
    "0.19": {"pristine": "tab:green", "series": "tab:purple"},
}
_LINE = {
    "pristine": dict(linestyle="-", linewidth=2.0, zorder=3),
    "series": dict(linestyle="--", linewidth=1.4, marker=".", markersize=4, zorder=4),
}
GOLDEN_STYLE = dict(color="0.35", linestyle="-", linewidth=0.8, zorder=2)
BAND_STYLE = dict(color="0.6", alpha=0.35, linewidth=0, zorder=1)
#: Param-sync panel: memory.json field -> (legend text, marker style per variant).
#: Pristine's markers are large and hollow, series' small and filled, so the two stay
#: visible where they coincide (at 0, typically).
SYNC_SERIES = (
    ("megatron_bytes", "megatron tensors", {"pristine": dict(marker="o", markersize=7, fillstyle="none"),
                                            "series": dict(marker="o", markersize=3)}),
    ("nccl_temporary_bytes", "NCCL temporaries", {"pristine": dict(marker="s", markersize=9, fillstyle="none"),
                                                  "series": dict(marker="x", markersize=5)}),
)
LEGEND_FONT = 9


@dataclass(frozen=True)
class RunInfo:
    """What the title and legends say about a comparison.

    Attributes:
        case: test case name.
        base: megatron-core base, a key of ``BASE_COLOURS`` ("0.17.1", "0.19").
        version: the pristine tree's megatron-core version ("0.19.2").
        series: the series applied to make the series tree ("patches/0.19").
        trees: variant -> tree label (``harness.trees`` label, or "mutant <name>").
        ranks: training ranks.
        device: "cpu" (gloo ranks) or "cuda" (GPUs; NCCL, or gloo on one GPU in the GPU check).
        verdict: a key of ``verdicts.VERDICT_MEANING``.
        verdict_line: ``comparison["verdict_line"]`` (e.g. "diverged at step 6 (...)").
        released: the pristine tree is a release (False: a user's own tree, ``--checkout``).
        golden_note: ``comparison["golden_note"]`` where the golden values are for information.
    """

    case: str
    base: str
    version: str
    series: str
    ranks: int
    device: str
    verdict: str
    verdict_line: str
    trees: Mapping[str, str] = field(default_factory=lambda: {v: v for v in VARIANTS})
    released: bool = True
    golden_note: str = ""


def figure_title(info: RunInfo) -> str:
    """Three lines: case, base, ranks, device; the two trees; the verdict and its meaning."""
    from .verdicts import VERDICT_MEANING

    device = {"cpu": "CPU, gloo", "cuda": "GPU"}.get(info.device, info.device)
    meaning = VERDICT_MEANING.get(info.verdict, "")
    if info.golden_note and info.verdict == "identical":
        meaning = f"series equals pristine bit for bit in every logged metric at every step; {info.golden_note}"
    line = info.verdict_line if info.verdict_line.startswith(info.verdict) else f"{info.verdict}: {info.verdict_line}"
    return (
        f"{info.case}: megatron-core {info.version}, {info.ranks} ranks ({device})\n"
        f"pristine = {info.trees['pristine']} (megatron-core {info.version} "
        f"{'as released' if info.released else 'as it is, not a release'}), "
        f"series = {info.trees['series']} ({info.version} + {info.series})\n"
        f"verdict: {line}" + (f" = {meaning}" if meaning else "")
    )


def build_figure(
    curves: Mapping[str, Mapping[str, MetricSeries] | None],
    first_divergent_step: int | None = None,
    memory: Mapping[str, Mapping | None] | None = None,
    rules: Mapping[str, MetricRule] | None = None,
    info: Optional[RunInfo] = None,
):
    """The figure (a matplotlib ``Figure`` on an Agg canvas), not yet written.

    Args:
        curves: "pristine", "series", "golden" -> that side's metrics, or None when the
            side is absent (e.g. no golden file yet).
        first_divergent_step: marked with a red vertical line, or None.
        memory: variant -> its ``memory.json`` dict (``memory_report``), or None; the memory
            panels say so where no run has one.
        rules: metric -> golden rule (``tolerances.rules_for``); default ``GOLDEN_RULES``.
            An ``Approximate`` rule draws its band around the golden values.
        info: what the title (``figure_title``) and legends name (``RunInfo``); None: bare
            variant names, no title.

    Raises:
        ValueError: no curve has either panel's metric (an empty plot would hide a bug).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    present = [m for m, _ in PANELS if any(c and m in c for c in curves.values())]
    if not present:
        raise ValueError(f"no curve has any of {[m for m, _ in PANELS]}")
    rules = GOLDEN_RULES if rules is None else rules
    colours = BASE_COLOURS.get(info.base if info else "0.17.1", BASE_COLOURS["0.17.1"])
    names = dict(info.trees) if info else {v: v for v in VARIANTS}
    fig = Figure(figsize=(15, 10), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    for ax, (metric, ylabel) in zip(axes[0], PANELS):
        _metric_panel(ax, metric, ylabel, curves, rules.get(metric), colours, names)
        _mark_divergence(ax, first_divergent_step)
    _sync_panel(axes[1][0], memory or {}, colours, names)
    _peak_panel(axes[1][1], memory or {}, colours, names)
    for ax in axes[1]:
        _mark_divergence(ax, first_divergent_step)
    if info:
        fig.suptitle(figure_title(info), fontsize=11)
    return fig


def plot_loss_curves(
    path: str | Path,
    curves: Mapping[str, Mapping[str, MetricSeries] | None],
    first_divergent_step: int | None = None,
    memory: Mapping[str, Mapping | None] | None = None,
    rules: Mapping[str, MetricRule] | None = None,
    info: Optional[RunInfo] = None,
) -> Path:
    """Write ``build_figure(...)`` as a PNG (1500 x 1000 pixels) and return its path; the
    parent folders are created. Arguments and errors as ``build_figure``."""
    fig = build_figure(curves, first_divergent_step, memory, rules, info)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def tolerance_band(series: MetricSeries, rule: MetricRule | None):
    """(steps, low, high) of the golden tolerance around ``series``, or None where the rule
    draws no band (``Exact``: the golden line itself; ``Informational``: nothing checked)."""
    if rule is None or not isinstance(rule.tolerance, Approximate):
        return None
    tol = rule.tolerance
    steps = list(series.steps)
    golden = [series.values[t] for t in steps]
    width = [tol.atol + tol.rtol * abs(g) for g in golden]
    return steps, [g - w for g, w in zip(golden, width)], [g + w for g, w in zip(golden, width)]


def _metric_panel(ax, metric, ylabel, curves, rule, colours, names) -> None:
    golden = (curves.get("golden") or {}).get(metric)
    if golden is not None:
        band = tolerance_band(golden, rule)
        if band is not None:
            steps, low, high = band
            half = (high[0] - low[0]) / 2
            ax.fill_between(steps, low, high, **BAND_STYLE,
                            label=f"golden ± tolerance ({rule.tolerance.describe()}: ±{half:.2g} at step {steps[0]})")  # fmt: skip
        exact = rule is not None and isinstance(rule.tolerance, Exact)
        ax.plot(list(golden.steps), [golden.values[t] for t in golden.steps],
                label="golden (exact)" if exact else "golden", **GOLDEN_STYLE)  # fmt: skip
    drawn = golden is not None
    for variant in VARIANTS:
        metrics = curves.get(variant)
        if not metrics or metric not in metrics:
            continue
        series = metrics[metric]
        steps = list(series.steps)
        ax.plot(steps, [series.values[t] for t in steps], label=names[variant], color=colours[variant],
                **_LINE[variant])  # fmt: skip
        drawn = True
    _frame(ax, drawn, f"no '{metric}' logged", metric, ylabel)
    if drawn:
        ax.legend(loc="best", fontsize=LEGEND_FONT)


def _frame(ax, drawn: bool, empty: str, title: str, ylabel: str, **title_style) -> None:
    """Axis labels, title and grid of a panel; ``empty`` in its middle when nothing was drawn."""
    if not drawn:
        ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, **title_style)
    ax.grid(True, alpha=0.3)


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
        fontsize=LEGEND_FONT,
        bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="none", alpha=0.8),
    )


def memory_lines(memory: Mapping[str, Mapping | None]) -> list:
    """The param-sync panel's per-step series: [(variant, field, steps, MiB per step)], per
    run with a ``memory.json`` and per ``SYNC_SERIES`` field, in that order."""
    lines = []
    for variant, summary in memory.items():
        if not summary or not summary.get("steps"):
            continue
        for fld, _, _ in SYNC_SERIES:
            points = series(summary, fld)
            lines.append((variant, fld, list(points), [v / MIB for v in points.values()]))
    return lines


def _bottom_below_zero(ax) -> None:
    """Start the y axis below 0 so that a series at 0 is drawn above the x axis."""
    top = max(ax.get_ylim()[1], 1e-3)
    ax.set_ylim(-0.08 * top, top * 1.05)


def _sync_panel(ax, memory: Mapping[str, Mapping | None], colours, names) -> None:
    """Param-sync memory per step and per forced sync between steps (MiB), one marker per
    value; the legend gives each series' maximum, as ``memory_report.format_memory``."""
    drawn = False
    for variant, fld, steps, mib in memory_lines(memory):
        text, styles = next((t, s) for f, t, s in SYNC_SERIES if f == fld)
        top = step_maxima(memory[variant])[fld] / MIB
        ax.plot(steps, mib, linestyle="none", color=colours.get(variant),
                label=f"{names.get(variant, variant)}: {text}, per step (max {top:.3f})",
                **styles.get(variant, {}))  # fmt: skip
        drawn = True
    for variant, summary in memory.items():
        between = (summary or {}).get("between_steps") or {}
        for fld, text, marker in (("megatron_bytes", "megatron tensors", "*"), ("nccl_temporary_bytes", "NCCL temporaries", "^")):
            if not between:
                continue
            ys = [row[fld] / MIB for row in between.values()]
            big = variant == "pristine"
            ax.plot([int(s) + 0.5 for s in between], ys, linestyle="none", marker=marker,
                    markersize=13 if big else 6, fillstyle="none" if big else "full", color=colours.get(variant),
                    label=f"{names.get(variant, variant)}: {text}, forced sync after the step (max {max(ys):.3f})")  # fmt: skip
    _frame(ax, drawn, "no param-sync records",
           "layer-wise param sync: megatron tensors it allocates, NCCL temporaries (collective model)",
           "MiB (max over ranks)", fontsize=10)  # fmt: skip
    if drawn:
        _bottom_below_zero(ax)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.9)  # room for the legend above the markers
        ax.legend(loc="upper left", fontsize=LEGEND_FONT - 0.5)


def _peak_panel(ax, memory: Mapping[str, Mapping | None], colours, names) -> None:
    """Step peak per step (MiB above the step's start) and its maximum, per run."""
    drawn = False
    for variant, summary in memory.items():
        if not summary or not summary.get("steps"):
            continue
        points = series(summary, "step_peak_bytes")
        top = step_maxima(summary)["step_peak_bytes"] / MIB
        ax.plot(list(points), [v / MIB for v in points.values()], color=colours.get(variant),
                label=f"{names.get(variant, variant)} (max {top:.3f})", **_LINE.get(variant, {}))  # fmt: skip
        ax.axhline(top, color=colours.get(variant), linestyle=":", linewidth=1.0)
        drawn = True
    _frame(ax, drawn, "no param-sync records", "step peak: most bytes alive at once inside train_step (dotted: max)",
           "MiB above the step's start (max over ranks)")
    if drawn:
        _bottom_below_zero(ax)
        ax.legend(loc="lower right", fontsize=LEGEND_FONT)
