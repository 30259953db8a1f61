"""The link model: what one transfer of ``n`` bytes costs, in one function for every user.

    time = latency + per_byte * n

The planner's and the simulator's collectives (``hspmd.cost.lines.LinkCost``: ``per_byte``
the fitted or file slope per ring bus byte, ``latency`` the per-call overhead), a switch's
BSR traffic (``hspmd.cost.traffic``: ``per_byte`` one over the link class's bandwidth; a
batched exchange's per-message latencies overlap, so none is charged) and ParDNN's
emulator (``hspmd.partition.emulate.CommModel``, in microseconds) all price a transfer
here. ``n`` may be a number or a numpy array (the emulator prices every edge at once).

>>> transfer_time(1e9, per_byte=1 / 50e9, latency=20e-6)  # 1 GB over 50 GB/s
0.02002
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np

__all__ = ["transfer_time"]

Bytes = TypeVar("Bytes", float, np.ndarray)


def transfer_time(nbytes: Bytes, *, per_byte: float, latency: float = 0.0) -> Bytes:
    """``latency + per_byte * nbytes``, in the unit of ``latency`` (module docstring)."""
    return latency + per_byte * nbytes
