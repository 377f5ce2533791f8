"""PNG plots of one or more stages, drawn with matplotlib's Agg canvas (no display needed).

Each figure puts every stage on the shared step axis in its own colour, with a dashed line and
the stage's name where it begins. The object-oriented API (Figure + FigureCanvasAgg) is used
instead of pyplot so that nothing depends on, or changes, a global backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ds_trhash.report.series import StageSeries, smooth

if TYPE_CHECKING:  # matplotlib is imported where a figure is drawn
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

WIDTH_IN, HEIGHT_IN, DPI = 9.0, 4.0, 100  # 900 x 400 pixels
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")  # matplotlib tab10


@dataclass(frozen=True)
class Plot:
    name: str       # file stem
    title: str
    columns: tuple[str, ...]
    ylabel: str
    log_y: bool = False


PLOTS = (
    Plot("loss", "Loss: train (raw, smoothed) and held-out eval", ("train_loss", "eval_loss"), "loss"),
    Plot("lr", "Learning rate", ("lr",), "learning rate"),
    Plot("tokens_per_s", "Throughput", ("tok_s",), "tokens / s"),
    Plot("grad_norm", "Gradient norm", ("grad_norm",), "grad norm", log_y=True),
)


def colour(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def has_data(plot: Plot, stages: list[StageSeries]) -> bool:
    return any(s.values[c] for s in stages for c in plot.columns)


def _draw(ax: Axes, plot: Plot, stages: list[StageSeries]) -> None:
    for i, s in enumerate(stages):
        c = colour(i)
        if plot.name == "loss":
            x, y = s.steps["train_loss"], s.values["train_loss"]
            if y:
                ax.plot(x, y, color=c, alpha=0.3, linewidth=1, label=f"{s.stage} train (raw)")
                ax.plot(x, smooth(y), color=c, linewidth=2, label=f"{s.stage} train (smoothed)")
            if s.values["eval_loss"]:
                ax.plot(s.steps["eval_loss"], s.values["eval_loss"], color=c, marker="o", linestyle=":",
                        label=f"{s.stage} eval")
        else:
            column = plot.columns[0]
            if s.values[column]:
                ax.plot(s.steps[column], s.values[column], color=c, linewidth=1.5, label=s.stage)


def new_figure() -> Figure:
    """A 900 x 400 figure on its own Agg canvas. matplotlib is imported here, not at module level:
    every `ds-trhash` command imports the report package through the CLI, and only `report` draws
    (about 0.4 s of start-up otherwise)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, out: Path, name: str) -> Path:
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=DPI)
    return path


def mark_stages(ax: Axes, stages: list[StageSeries]) -> None:
    """Stage boundaries on a shared-step-axis plot: a dashed line and the stage's name."""
    for i, s in enumerate(stages):
        ax.axvline(s.offset, color=colour(i), linestyle="--", linewidth=1, alpha=0.8)
        ax.annotate(s.stage, xy=(s.offset, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", color=colour(i), fontsize=8)
    ax.set_xlabel("optimizer step (stages end to end)")
    ax.grid(True, alpha=0.3)


def render_plot(plot: Plot, stages: list[StageSeries], out: Path) -> Path:
    fig = new_figure()
    ax = fig.add_subplot(1, 1, 1)
    _draw(ax, plot, stages)
    mark_stages(ax, stages)
    if plot.log_y and all(v > 0 for s in stages for c in plot.columns for v in s.values[c]):
        ax.set_yscale("log")
    ax.set_title(plot.title)
    ax.set_ylabel(plot.ylabel)
    ax.legend(fontsize=7, loc="best")
    return save(fig, out, plot.name)
