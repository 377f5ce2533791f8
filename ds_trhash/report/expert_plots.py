"""Per-expert token load plots, from each stage's ``expert_load.csv``.

Two figures, because the question has two halves: *which* experts of which layer carry more
than their share (``expert_load.png``: per stage, a layer x expert map of the routes over the
whole stage, as a multiple of an even split), and *when* (``expert_balance.png``: over the
shared step axis, each layer's busiest expert as a multiple of an even split, per logged
interval, one colour per stage with the stage boundaries marked). TR-HASH routes are fixed by
the token-id hash, so a layer's map changes only with the token mix of the data.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ds_trhash.report.plots import colour, mark_stages, new_figure, save
from ds_trhash.report.series import ExpertLoad, StageSeries, even_split_multiple

LOAD_PLOT, BALANCE_PLOT = "expert_load", "expert_balance"
LOAD_TITLE = "Per-expert token load per layer (whole stage, 1.0 = an even split)"
BALANCE_TITLE = "Busiest expert per layer over training (1.0 = an even split)"
ANNOTATE_CELLS = 64  # write the value into each cell up to this many cells per map


def with_load(stages: list[StageSeries]) -> list[tuple[int, StageSeries, ExpertLoad]]:
    """(colour index, stage) of the stages that recorded expert load."""
    return [(i, s, s.expert_load) for i, s in enumerate(stages) if s.expert_load is not None]


def busiest(stage: StageSeries) -> str:
    """The key fact: the layer and expert with the largest share over the stage."""
    load = stage.expert_load
    if load is None:
        return "not recorded"
    relative = even_split_multiple(load.total)
    layer, expert = np.unravel_index(int(relative.argmax()), relative.shape)
    return f"layer {layer} expert {expert}: {relative[layer, expert]:.3f} x an even split"


def render_load_maps(stages: list[StageSeries], out: Path) -> Path:
    shown = with_load(stages)
    fig = new_figure()
    maps = [even_split_multiple(load.total) for _, _, load in shown]
    spread = max(float(np.abs(m - 1.0).max()) for m in maps) or 0.05
    image = None
    for k, ((i, s, _), m) in enumerate(zip(shown, maps)):
        ax = fig.add_subplot(1, len(shown), k + 1)
        image = ax.imshow(m, cmap="coolwarm", vmin=1.0 - spread, vmax=1.0 + spread, aspect="auto",
                          interpolation="nearest")
        ax.set_title(s.stage, color=colour(i), fontsize=9)
        ax.set_xlabel("expert")
        ax.set_xticks(range(m.shape[1]))
        ax.set_yticks(range(m.shape[0]))
        ax.tick_params(labelsize=7)
        if k == 0:
            ax.set_ylabel("layer")
        if m.size <= ANNOTATE_CELLS:
            for (layer, expert), value in np.ndenumerate(m):
                ax.text(expert, layer, f"{value:.2f}", ha="center", va="center", fontsize=7)
    if image is not None:  # there is a map: the callers draw only stages that recorded expert load
        fig.colorbar(image, ax=fig.axes, shrink=0.9, label="share x experts")
    fig.suptitle(LOAD_TITLE, fontsize=10)
    path = out / f"{LOAD_PLOT}.png"
    fig.savefig(path)  # no tight_layout: the colour bar spans every map
    return path


def render_balance(stages: list[StageSeries], out: Path) -> Path:
    fig = new_figure()
    ax = fig.add_subplot(1, 1, 1)
    for i, s, load in with_load(stages):
        peak = even_split_multiple(load.counts).max(axis=2)  # [rows, layers]
        for layer in range(peak.shape[1]):
            ax.plot(load.steps, peak[:, layer], color=colour(i), linewidth=1, alpha=0.6,
                    marker="." if len(peak) < 20 else None, label=s.stage if layer == 0 else None)
    ax.axhline(1.0, color="black", linewidth=0.8, alpha=0.5)
    mark_stages(ax, stages)
    ax.set_title(BALANCE_TITLE)
    ax.set_ylabel("busiest expert / even split")
    ax.legend(fontsize=7, loc="best")
    return save(fig, out, BALANCE_PLOT)
