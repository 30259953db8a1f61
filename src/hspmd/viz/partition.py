"""The picture of a placement: the emulated schedule per device and memory over time.

Top: one row per device, its busy intervals (ops running) from the emulation. Bottom: each
device's live bytes over the step (residual state plus live outputs, the memory model of
``hspmd.partition.emulate``) against its cap. The curves are exact: their maxima are the
emulation's ``peak_bytes``. Intervals closer than a pixel are merged, so a 200K-op graph
draws as fast as a small one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hspmd.partition.emulate import Emulation, memory_events
from hspmd.partition.graph import OpGraph
from hspmd.viz.common import PALETTE, check_picture_path, new_figure, save

__all__ = ["busy_intervals", "draw_partition", "memory_curve"]

_GIB = 2**30


def memory_curve(
    graph: OpGraph, placement: np.ndarray, emulation: Emulation, device: int
) -> tuple[np.ndarray, np.ndarray]:
    """(times in µs, live bytes after each event) of ``device``, allocations before releases
    at equal times, starting at 0 µs with the residual state of its ops.

    Its maximum is ``emulation.peak_bytes[device]``.
    """
    place = np.asarray(placement, dtype=np.int64)
    times, devices, deltas = memory_events(
        graph, place, start=emulation.start_us, finish=emulation.finish_us
    )
    mine = devices == device
    t, d = times[mine], deltas[mine]
    order = np.lexsort((-d, t))  # by time; at equal times, allocations (positive) first
    base = float(graph.residual_bytes[place == device].sum())
    live = base + np.cumsum(d[order], dtype=np.float64)
    return np.r_[0.0, t[order]], np.r_[base, live]


def busy_intervals(
    start: np.ndarray, finish: np.ndarray, *, resolution: float
) -> list[tuple[float, float]]:
    """(start, duration) of the busy spans of one device's ops, merging gaps shorter than
    ``resolution``.

    >>> busy_intervals(np.array([0.0, 2.0, 10.0]), np.array([2.0, 3.0, 11.0]), resolution=1.0)
    [(0.0, 3.0), (10.0, 1.0)]
    """
    if start.size == 0:
        return []
    order = np.argsort(start, kind="stable")
    s, f = start[order], np.maximum.accumulate(finish[order])
    breaks = np.flatnonzero(s[1:] > f[:-1] + resolution) + 1
    firsts = np.r_[0, breaks]
    lasts = np.r_[breaks - 1, s.size - 1]
    return [(float(s[a]), float(f[b] - s[a])) for a, b in zip(firsts, lasts, strict=True)]


def draw_partition(
    graph: OpGraph,
    placement: np.ndarray,
    emulation: Emulation,
    path: str | Path,
    *,
    caps: Sequence[int | None] | None = None,
    title: str = "",
) -> Path:
    """Draw the schedule per device and memory over time against ``caps`` to ``path``."""
    check_picture_path(path)
    place = np.asarray(placement, dtype=np.int64)
    k = len(emulation.peak_bytes)
    span = max(emulation.makespan_us, 1e-9)
    fig = new_figure(width=12.0, height=2.0 + 0.45 * k + 3.0)
    grid = fig.add_gridspec(2, 1, height_ratios=(0.45 * k + 0.6, 3.0))
    gantt, memory = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    for device in range(k):
        colour = PALETTE[device % len(PALETTE)]
        mine = place == device
        bars = busy_intervals(
            emulation.start_us[mine], emulation.finish_us[mine], resolution=span / 1500
        )
        busy = float((emulation.finish_us[mine] - emulation.start_us[mine]).sum())
        ms = [(a / 1e3, w / 1e3) for a, w in bars]
        gantt.broken_barh(ms, (device - 0.4, 0.8), facecolors=colour)
        gantt.text(span * 1.005 / 1e3, device, f"{busy / span:.0%} busy", va="center", fontsize=8)
        times, live = memory_curve(graph, place, emulation, device)
        memory.step(times / 1e3, live / _GIB, where="post", color=colour, label=f"device {device}")
        cap = None if caps is None else caps[device]
        if cap is not None:
            memory.axhline(cap / _GIB, color=colour, linestyle="--", linewidth=0.8)
    gantt.set_yticks(range(k), [f"device {d}" for d in range(k)])
    gantt.set_ylim(k - 0.5, -0.5)
    gantt.set_xlim(0, span * 1.08 / 1e3)
    gantt.set_xlabel("ms (emulated)")
    gantt.set_title("ops running per device", fontsize=9)
    memory.set_xlim(0, span * 1.08 / 1e3)
    memory.set_xlabel("ms (emulated)")
    memory.set_ylabel("live GiB")
    memory.set_title("memory per device (dashed: its cap)", fontsize=9)
    memory.legend(fontsize=7, loc="upper right")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return save(fig, path)
