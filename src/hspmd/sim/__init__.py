"""Discrete-event simulation of a training step: tasks on per-rank in-order streams,
collectives over several ranks, capacity-1 shared resources (links, NICs), processor
pools shared by the tasks running at once (local processes on a host's cores).

``simulate`` runs a task list into a ``Result``; ``chrome_trace`` / ``write_trace`` and
``draw_timeline`` show it. No torch here; matplotlib only inside ``draw_timeline``.
"""

from hspmd.sim.engine import COMM_CATEGORIES, Pool, Result, SimError, Span, Task, simulate
from hspmd.sim.trace import chrome_trace, draw_timeline, write_trace

__all__ = [
    "COMM_CATEGORIES",
    "Pool",
    "Result",
    "SimError",
    "Span",
    "Task",
    "chrome_trace",
    "draw_timeline",
    "simulate",
    "write_trace",
]
