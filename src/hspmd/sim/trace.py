"""Showing a ``Result``: Chrome / Perfetto trace-event JSON and a Gantt picture.

Trace layout: one process per rank (``pid`` = rank, named by ``rank_names`` or
``rank 3``), one thread per stream (``tid`` = a small integer per stream name, named by a
``thread_name`` metadata event, since trace viewers want integer tids). A collective shows
as one event on each participant. Span events come sorted by start time. Times are seconds in the result, microseconds in the
trace (``ts``, ``dur``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hspmd.sim.engine import Result, SimError

__all__ = ["chrome_trace", "draw_timeline", "write_trace"]

_US = 1e6
_COLOURS = {"compute": "#4c72b0", "comm": "#dd8452", "optimizer": "#55a868"}
_OTHER_COLOURS = ("#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974")
_MAX_LABELS = 4000


def _stream_ids(result: Result) -> dict[str, int]:
    ids: dict[str, int] = {}
    for s in result.spans:
        ids.setdefault(s.stream, len(ids))
    return ids


def chrome_trace(result: Result, *, rank_names: Mapping[int, str] | None = None) -> dict[str, Any]:
    """Trace-event JSON (``{"traceEvents": [...]}``) for chrome://tracing or Perfetto."""
    names = rank_names or {}
    tids = _stream_ids(result)
    events: list[dict[str, Any]] = []
    ranks = sorted(result.busy)
    for r in ranks:
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": r,
                "tid": 0,
                "args": {"name": names.get(r, f"rank {r}")},
            }
        )
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}}
        )
        for stream, tid in tids.items():
            events.append(
                {"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": stream}}
            )
    # by start time (input order breaks ties), so each rank's events come in time order
    for s in sorted(result.spans, key=lambda s: s.start):
        args = {"category": s.category, "task_id": s.task_id}
        if len(s.ranks) > 1:
            args["ranks"] = ",".join(map(str, s.ranks))
        if s.cause:
            args["waited_for"] = f"{s.cause} ({s.cause_kind})"
        for r in s.ranks:
            events.append({
                "ph": "X", "name": s.label or s.task_id, "cat": s.category, "pid": r,
                "tid": tids[s.stream], "ts": s.start * _US, "dur": s.duration * _US, "args": args,
            })  # fmt: skip
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"makespan_s": result.makespan},
    }


def write_trace(
    result: Result, path: str | Path, *, rank_names: Mapping[int, str] | None = None
) -> Path:
    """Write ``chrome_trace(result)`` as JSON to ``path``; return the path."""
    out = Path(path)
    out.write_text(json.dumps(chrome_trace(result, rank_names=rank_names)))
    return out


def _colour(category: str, seen: dict[str, str]) -> str:
    if category not in seen:
        seen[category] = _COLOURS.get(category) or _OTHER_COLOURS[len(seen) % len(_OTHER_COLOURS)]
    return seen[category]


def draw_timeline(result: Result, path: str | Path, *, title: str = "") -> Path:
    """A Gantt chart: one row per (rank, stream), one colour per category, labels (F, B..)
    inside bars wide enough to hold them. ``.png`` or ``.svg`` by the suffix of ``path``."""
    out = Path(path)
    fmt = out.suffix.lower().lstrip(".")
    if fmt not in ("png", "svg"):
        raise SimError(
            f"draw_timeline writes .png or .svg, got path={str(out)!r}; name it {out.stem}.png or {out.stem}.svg"
        )
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise SimError(
            "draw_timeline needs matplotlib; install it: pip install matplotlib"
        ) from None

    rows = sorted({(r, s.stream) for s in result.spans for r in s.ranks})
    row_of = {key: i for i, key in enumerate(rows)}
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for s in result.spans:
        for r in s.ranks:
            bars.setdefault((row_of[r, s.stream], s.category), []).append((s.start, s.duration))

    width_in = 12.0
    fig = Figure(figsize=(width_in, 1.0 + 0.4 * max(len(rows), 1)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colours: dict[str, str] = {}
    for (row, category), xs in sorted(bars.items()):
        ax.broken_barh(
            xs,
            (row - 0.4, 0.8),
            facecolors=_colour(category, colours),
            edgecolor="white",
            linewidth=0.3,
        )
    _labels(ax, result, row_of, width_in)
    ax.set_yticks(range(len(rows)), [f"rank {r} {stream}" for r, stream in rows])
    ax.set_ylim(max(len(rows), 1) - 0.5, -0.5)  # an empty result still gets one blank row
    ax.set_xlim(0, result.makespan or 1.0)
    ax.set_xlabel("time (s)")
    ax.set_title(title or f"makespan {result.makespan:g} s")
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in colours.items()],
        loc="upper left",  # outside, right of the axes: the last tasks end at the right edge
        bbox_to_anchor=(1.0, 1.0),
        fontsize="small",
    )
    fig.tight_layout()
    fig.savefig(out, format=fmt, dpi=120)
    return out


def _labels(ax: Any, result: Result, row_of: dict[tuple[int, str], int], width_in: float) -> None:
    """Put each span's label (or id) inside its bar when the text fits, at most a few thousand."""
    span_units = result.makespan or 1.0
    points_per_unit = width_in * 72 * 0.8 / span_units
    placed = 0
    for s in result.spans:
        text = s.label or s.task_id
        if s.duration * points_per_unit < 6.0 * len(text) + 4:
            continue
        for r in s.ranks:
            ax.text(
                s.start + s.duration / 2,
                row_of[r, s.stream],
                text,
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
            placed += 1
        if placed >= _MAX_LABELS:
            return
