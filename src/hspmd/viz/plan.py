"""A plan as a picture: ranks down, layers across, one block per pipeline stage.

::

    gradient sync   |<---- all-reduce ---->|<- split-AR ->|
    R0  H800        [ pipeline 0, TP4 ][ TP4 ][ TP4 ]...
    ...
    R16 H20         [ pipeline 1, TP4  ][ TP4 ] ... [TP2][TP1]

Each stage is one block spanning its tensor-parallel ranks (rows) and its layers (columns),
filled with its pipeline's colour; the legend gives each pipeline's micro-batches
(COUNTxSIZE). With GPU kinds (``kinds``, rank -> name) a column left of the grid shows each
rank's kind. The band above the grid names the cross-pipeline gradient sync (all-reduce,
split-all-reduce) of each layer range (``Explanation.layer_sync``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hspmd.plan.strategy import Stage, Strategy
from hspmd.specialize.explain import Explanation
from hspmd.viz.common import PALETTE, check_picture_path, new_figure, save

__all__ = ["draw_plan", "plan_rows"]

_SHORT = {"all-reduce": "AR", "split-all-reduce": "split-AR"}
_SYNC_COLOURS = {"AR": "#bcd6ee", "split-AR": "#f5cfa0", "AR + split-AR": "#d9e8c4"}
_KIND_COLOURS = ("#4d4d4d", "#a6a6a6", "#7f6d5f", "#c2b280")
_POINTS_ACROSS = 560  # about the grid's width in points, to decide which labels fit


def plan_rows(strategy: Strategy) -> tuple[int, ...]:
    """Ranks in drawing order: pipeline by pipeline, stage by stage, a stage's TP order.

    >>> from hspmd.plan.strategy import parse_strategy
    >>> plan_rows(parse_strategy("1x1: R2-3:L0-1 R0:L2-3; 1x1: R1:L0-3"))
    (2, 3, 0, 1)
    """
    return tuple(r for p in strategy.pipelines for st in p.stages for r in st.ranks)


def _sync_label(kinds: tuple[str, ...]) -> str:
    return " + ".join(_SHORT.get(k, k) for k in kinds) or "no sync"


def draw_plan(
    explanation: Explanation,
    path: str | Path,
    *,
    kinds: Mapping[int, str] | None = None,
    title: str = "",
) -> Path:
    """Draw ``explanation``'s strategy to ``path`` (``.png`` or ``.svg``); return the path."""
    check_picture_path(path)
    from matplotlib.patches import Patch

    strategy = explanation.strategy
    rows = plan_rows(strategy)
    row_of = {r: i for i, r in enumerate(rows)}
    num_layers = max(st.last_layer for p in strategy.pipelines for st in p.stages) + 1
    fig = new_figure(width=11.0, height=2.2 + 0.24 * len(rows))
    ax = fig.add_subplot()
    handles: list[Any] = []
    for p, pipeline in enumerate(strategy.pipelines):
        colour = PALETTE[p % len(PALETTE)]
        for stage in pipeline.stages:
            _draw_stage(ax, stage, top=row_of[stage.ranks[0]], colour=colour, num_layers=num_layers)
        last = row_of[pipeline.stages[-1].ranks[-1]] + 1
        if p < len(strategy.pipelines) - 1:
            ax.axhline(last, color="black", linewidth=1.5)
        handles.append(
            Patch(color=colour, label=f"pipeline {p}: {pipeline.num_micro_batches}x"
                  f"{pipeline.micro_batch_size} micro-batches")
        )  # fmt: skip
    strip = max(1.0, num_layers / 25)
    if kinds:
        handles += _kind_column(ax, rows, kinds, strip=strip)
    handles += _sync_band(ax, explanation.layer_sync, num_layers=num_layers)
    labels = [f"R{r}" + (f" {kinds[r]}" if kinds and r in kinds else "") for r in rows]
    _dress_axes(ax, labels, kinds=bool(kinds), strip=strip, num_layers=num_layers)
    ax.set_title(title or f"{strategy}", fontsize=8, wrap=True)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7,
              frameon=False)  # fmt: skip
    fig.tight_layout()
    return save(fig, path)


def _draw_stage(ax: Any, stage: Stage, *, top: int, colour: str, num_layers: int) -> None:
    """One stage as a box over its layers and ranks (rows from ``top``), labelled if it fits."""
    from matplotlib.patches import Rectangle

    height = len(stage.ranks)  # TP x CP ranks
    width = stage.last_layer - stage.first_layer + 1
    ax.add_patch(
        Rectangle((stage.first_layer, top), width, height, facecolor=colour,
                  edgecolor="black", linewidth=1.0, alpha=0.85)
    )  # fmt: skip
    for i in range(1, height):  # faint lines between the ranks of one TP group
        ax.plot([stage.first_layer, stage.first_layer + width], [top + i] * 2,
                color="white", linewidth=0.4, alpha=0.6)  # fmt: skip
    if width * _POINTS_ACROSS / num_layers >= 20:  # "TP4" fits
        label = f"TP{stage.tp}" + (f"xCP{stage.cp}" if stage.cp > 1 else "")
        ax.text(stage.first_layer + width / 2, top + height / 2, label,
                ha="center", va="center", fontsize=8, color="white", weight="bold")  # fmt: skip


def _dress_axes(ax: Any, labels: list[str], *, kinds: bool, strip: float, num_layers: int) -> None:
    """Ticks (ranks down, layers across), limits and spines."""
    ax.set_yticks([-0.9] + [i + 0.5 for i in range(len(labels))], ["gradient sync", *labels],
                  fontsize=7)  # fmt: skip
    ax.set_ylim(len(labels), -1.6)
    ax.set_xlim(-(strip + 0.3) if kinds else 0, num_layers)
    step = max(1, round(num_layers / 20))
    ax.set_xticks([x + 0.5 for x in range(0, num_layers, step)],
                  [str(x) for x in range(0, num_layers, step)], fontsize=7)  # fmt: skip
    ax.set_xlabel("layer")
    ax.tick_params(length=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _kind_column(
    ax: Any, rows: tuple[int, ...], kinds: Mapping[int, str], *, strip: float
) -> list[Any]:
    """A column left of layer 0, one cell per rank in its GPU kind's colour."""
    from matplotlib.patches import Patch, Rectangle

    colours: dict[str, str] = {}
    for i, r in enumerate(rows):
        name = kinds.get(r, "?")
        colour = colours.setdefault(name, _KIND_COLOURS[len(colours) % len(_KIND_COLOURS)])
        ax.add_patch(Rectangle((-(strip + 0.3), i), strip, 1, facecolor=colour,
                               edgecolor="white", linewidth=0.5))  # fmt: skip
    return [Patch(color=c, label=f"GPU {name}") for name, c in colours.items()]


def _sync_band(
    ax: Any, layer_sync: tuple[tuple[int, int, tuple[str, ...]], ...], *, num_layers: int
) -> list[Any]:
    """Above the grid: one box per layer range, named by its cross-pipeline gradient sync."""
    from matplotlib.patches import Patch, Rectangle

    seen: dict[str, str] = {}
    for first, last, kinds in layer_sync:
        label = _sync_label(kinds)
        colour = seen.setdefault(label, _SYNC_COLOURS.get(label, "#e0e0e0"))
        width = last - first + 1
        ax.add_patch(Rectangle((first, -1.4), width, 1.0, facecolor=colour, edgecolor="black",
                               linewidth=0.6))  # fmt: skip
        fits = width * _POINTS_ACROSS / num_layers >= 4.5 * len(label)
        ax.text(first + width / 2, -0.9, label if fits else "…",
                ha="center", va="center", fontsize=7)  # fmt: skip
        if first > 0:
            ax.axvline(first, color="black", linestyle=":", linewidth=0.8, zorder=0.5)
    return [Patch(facecolor=c, edgecolor="black", label=f"gradient sync: {name}")
            for name, c in seen.items()]  # fmt: skip
