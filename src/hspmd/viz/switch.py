"""A switch as a picture: the rank-pair traffic matrix and per-rank send/receive bars.

Left, one scheme's matrix: row = sender, column = receiver, each cell's colour its bytes on a
log scale, one colour map per link class (a pair has one class: NVLink inside a node, the
NIC between nodes). Right, for every scheme given (naive, fused, relay...), each rank's bytes
sent (bars up) and received (bars down), the legend giving each scheme's estimated time::

    GB  |  ▇ ▆       sent
      0 +--+--+--+-- rank
        |  ▂ ▃       received
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hspmd.switch.pairs import PairTraffic
from hspmd.viz.common import PALETTE, check_picture_path, new_figure, save

__all__ = ["draw_switch"]

_LINK_MAPS = ("Blues", "Oranges", "Greens", "Purples")
_GB = 1e9


def draw_switch(
    traffics: Sequence[PairTraffic],
    path: str | Path,
    *,
    matrix: str,
    num_ranks: int,
    link_classes: Sequence[str] = (),
    title: str = "",
) -> Path:
    """Draw the matrix of scheme ``matrix`` and the bars of all ``traffics`` to ``path``."""
    check_picture_path(path)
    chosen = next((t for t in traffics if t.algo == matrix), None)
    assert chosen is not None, f"matrix scheme {matrix} is not among {[t.algo for t in traffics]}"
    fig = new_figure(width=15.0, height=6.0)
    grid = fig.add_gridspec(1, 2, width_ratios=(1.0, 1.7))
    _matrix(fig, fig.add_subplot(grid[0]), chosen, num_ranks=num_ranks, links=link_classes)
    _bars(fig.add_subplot(grid[1]), traffics, num_ranks=num_ranks)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return save(fig, path)


def _matrix(
    fig: Any, ax: Any, traffic: PairTraffic, *, num_ranks: int, links: Sequence[str]
) -> None:
    import numpy as np
    from matplotlib.colors import LogNorm

    sizes = [size for *_, size in traffic.pairs if size > 0]
    norm = LogNorm(vmin=min(sizes) / _GB, vmax=max(sizes) / _GB) if sizes else None
    order = list(links) + sorted({link for _, _, link, _ in traffic.pairs} - set(links))
    for i, link in enumerate(order):
        cells = np.full((num_ranks, num_ranks), np.nan)
        for src, dst, name, size in traffic.pairs:
            if name == link and size > 0:
                cells[src, dst] = size / _GB
        if np.isnan(cells).all():
            continue
        image = ax.imshow(cells, cmap=_LINK_MAPS[i % len(_LINK_MAPS)], norm=norm,
                          interpolation="nearest", aspect="equal")  # fmt: skip
        bar = fig.colorbar(image, ax=ax, location="bottom", fraction=0.04, aspect=40, shrink=0.8,
                           pad=0.16)  # fmt: skip
        bar.set_label(f"GB over {link}", fontsize=8)
        bar.ax.tick_params(labelsize=7)
    if not sizes:
        ax.text(0.5, 0.5, "nothing moves", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlim(-0.5, num_ranks - 0.5)
    ax.set_ylim(num_ranks - 0.5, -0.5)
    step = max(1, round(num_ranks / 16))
    ticks = list(range(0, num_ranks, step))
    ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=7)
    ax.set_yticks(ticks, [str(t) for t in ticks], fontsize=7)
    ax.set_xlabel("receiver rank")
    ax.set_ylabel("sender rank")
    ax.set_title(
        f"{traffic.algo}: bytes per rank pair ({traffic.total() / _GB:.1f} GB)", fontsize=9
    )


def _bars(ax: Any, traffics: Sequence[PairTraffic], *, num_ranks: int) -> None:
    width = 0.8 / max(len(traffics), 1)
    for i, traffic in enumerate(traffics):
        colour = PALETTE[i % len(PALETTE)]
        sent, received = traffic.sent(), traffic.received()
        xs = [r - 0.4 + width * (i + 0.5) for r in range(num_ranks)]
        ax.bar(xs, [sent.get(r, 0.0) / _GB for r in range(num_ranks)], width, color=colour,
               label=f"{traffic.algo}: {traffic.time * 1e3:.1f} ms, {traffic.total() / _GB:.1f} GB")  # fmt: skip
        ax.bar(xs, [-received.get(r, 0.0) / _GB for r in range(num_ranks)], width,
               color=colour, alpha=0.55, hatch="//", edgecolor="white", linewidth=0)  # fmt: skip
    ax.axhline(0, color="black", linewidth=0.8)
    step = max(1, round(num_ranks / 32))
    ax.set_xticks(range(0, num_ranks, step), [str(r) for r in range(0, num_ranks, step)],
                  fontsize=7)  # fmt: skip
    ax.set_xlim(-0.6, num_ranks - 0.4)
    ax.set_xlabel("rank")
    ax.set_ylabel("GB sent (up) / received (down, hatched)")
    ax.set_title("per-rank traffic by scheme (legend: estimated switch time)", fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", linewidth=0.3)
