"""Emulated slow devices: a rank sleeps ``(factor - 1)`` times each compute it ran.

``TrainConfig.faults.slowdown = ((2, 3.0),)`` makes rank 2 behave like a device three times
slower than its peers without using the shared cores: after each timed compute region it
sleeps twice the region's wall time. The numbers it computes do not change::

    >>> slow = Slowdown(3.0)
    >>> with slow:
    ...     pass                      # the compute; then a sleep of 2 x its time
    >>> Slowdown(1.0).active
    False

The training loop (``hspmd.train.loop``) wraps three calls: the stage's forward of a
micro-batch (``program.forward``, after the activation was received), its backward
(``out.backward``, after the gradient was received) and ``Post.step`` (the gradient sync
results still in flight, then Adam). On a CUDA rank the kernels run asynchronously, so a
slowed rank waits for its device at both ends of a region (only when it is slowed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from types import TracebackType

import torch

__all__ = ["Slowdown", "slowdown_of"]


@dataclass(slots=True)
class Slowdown:
    """A context manager: time the body, then sleep ``(factor - 1)`` times that."""

    factor: float = 1.0
    slept_s: float = 0.0  # total sleep so far
    sync: Callable[[], None] | None = None  # waits for the device (CUDA ranks)
    _start: float = field(default=0.0, repr=False)

    @property
    def active(self) -> bool:
        return self.factor > 1.0

    def __enter__(self) -> Slowdown:
        if self.active and self.sync is not None:
            self.sync()
        self._start = time.perf_counter()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if kind is not None or not self.active:
            return
        if self.sync is not None:
            self.sync()
        pause = (self.factor - 1.0) * (time.perf_counter() - self._start)
        time.sleep(pause)
        self.slept_s += pause


def slowdown_of(
    slowdown: tuple[tuple[int, float], ...], rank: int, *, device: torch.device | None = None
) -> Slowdown:
    """This rank's ``Slowdown`` from ``TrainConfig.faults.slowdown`` (factor 1: none); on a CUDA
    ``device`` it times the device's work, not only the host's."""
    sync = None
    if device is not None and device.type == "cuda":
        sync = partial(torch.cuda.synchronize, device)
    return Slowdown(dict(slowdown).get(rank, 1.0), sync=sync)
