"""Memory of a placement: lower bounds that every placement must meet.

Tracking: the emulated schedule gives every output copy a lifetime on a device
(:func:`hspmd.partition.emulate.buffers`); with the residual bytes (always live) that
gives each device's peak (:func:`hspmd.partition.emulate.memory_peaks`). The repair
that moves ops off overflowing devices is :mod:`hspmd.partition.repair`.
"""

from __future__ import annotations

import numpy as np

from hspmd.errors import PartitionError
from hspmd.partition.graph import OpGraph


def gib(num_bytes: float) -> str:
    """A byte count for people: ``gib(3 * 2**29) == '1.50 GiB'``, ``gib(2048) == '2.00 KiB'``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{int(num_bytes)} B"


def check_residual_fits(graph: OpGraph, caps: np.ndarray) -> None:
    """Raise if the caps are provably too small, naming the missing bytes.

    Three lower bounds that hold for every placement: all residual state fits in the
    sum of the caps; a colocation group's residual state fits in one device; and an op,
    when it starts, holds its output and every input on its device at once (the
    emulator frees an input only when its last consumer there starts, after the
    consumer's output is allocated), next to its group's residual state.
    """
    total = int(graph.residual_bytes.sum())
    if total > int(caps.sum()):
        raise PartitionError(
            f"total residual {gib(total)} exceeds the sum of caps {gib(caps.sum())} by "
            f"{gib(total - caps.sum())}; raise --memory or add devices"
        )
    largest = int(caps.max())
    per_group = np.bincount(graph.group_of, weights=graph.residual_bytes)
    worst = int(np.argmax(per_group)) if per_group.size else 0
    if per_group.size and per_group[worst] > largest:
        raise PartitionError(
            f"op {graph.names[worst]!r} and the ops colocated with it hold "
            f"{gib(per_group[worst])} of residual state, more than the largest cap "
            f"{gib(largest)} by {gib(per_group[worst] - largest)}; raise --memory"
        )
    output, inputs = op_working_set(graph)
    need = output + inputs + per_group[graph.group_of] if per_group.size else output + inputs
    v = int(np.argmax(need)) if need.size else 0
    if need.size and need[v] > largest:
        raise PartitionError(
            f"op {graph.names[v]!r} needs {gib(need[v])} at once on its device (output "
            f"{gib(output[v])}, inputs {gib(inputs[v])}, residual {gib(need[v] - output[v] - inputs[v])}), "
            f"more than the largest cap {gib(largest)} by {gib(need[v] - largest)}; raise --memory"
        )


def op_working_set(graph: OpGraph) -> tuple[np.ndarray, np.ndarray]:
    """Per op: bytes of its own output and of its inputs, all live when it starts.

    Residual producers are left out (their state is counted where they live).
    """
    output = np.where(graph.residual_bytes > 0, 0, graph.out_bytes).astype(np.float64)
    inputs = np.bincount(graph.dst, weights=output[graph.src], minlength=graph.num_nodes)
    return output, inputs
