"""Planning the next steps while this one trains: a background worker (paper section 7).

Under length plans (``hspmd train --plans``) each step's strategy choice and dispatch
(``hspmd.train.packing.planned_steps``: ``choose`` over every strategy, the documents
packed into the chosen one's micro-batches) is CPU work that does not depend on the step
before it trains: only on the data and the choice before it. ``PlanAhead`` runs that
iterator on a thread of the rank's process, ``depth`` steps ahead of the training loop,
and hands over each planned step as data (a ``PackedStep``: the chosen strategy's index,
its predicted time, the packed micro-batches). One producer, one FIFO queue: the steps
come out in the order, and with the choices, of the synchronous iterator (``same
choices``, ``tests/train/test_plan_ahead.py``); every rank plans the same steps from the
same data, so no rank waits for another's plan. An error in planning (a step that fits no
strategy) is raised by ``next`` at the step it belongs to.

    >>> ahead = PlanAhead(iter(range(5)), depth=2)
    >>> list(ahead), ahead.planned
    ([0, 1, 2, 3, 4], 5)

Torch releases the GIL in its kernels, so the thread plans while the step computes;
the training loop itself is unchanged but for reading its steps from the queue. Without
length plans the loop draws its data through a ``PlanAhead`` too (fixed batches and packed
steps: a step's data depends on its number only, not on when it is drawn), so drawing it
is off the step's critical path (docs/data.md).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["PlanAhead"]

T = TypeVar("T")
_END = object()


class PlanAhead(Generic[T]):
    """``steps`` iterated on a daemon thread, at most ``depth`` items ahead of ``next``."""

    def __init__(self, steps: Iterator[T], *, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"depth={depth}: plan at least one step ahead")
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self.planned = 0  # steps the worker has finished planning
        self._thread = threading.Thread(
            target=self._work, args=(steps,), name="hspmd-plan-ahead", daemon=True
        )
        self._thread.start()

    def _work(self, steps: Iterator[T]) -> None:
        try:
            for item in steps:
                self.planned += 1
                if not self._put(item):
                    return
        except BaseException as error:  # delivered to the consumer at its step
            self._put(error)
            return
        self._put(_END)

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> PlanAhead[T]:
        return self

    def __next__(self) -> T:
        item = self._queue.get()
        if item is _END:
            self._queue.put(_END)  # later calls end too
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item  # type: ignore[return-value]

    def ready(self) -> int:
        """Planned steps waiting in the queue now."""
        return self._queue.qsize()

    def close(self) -> None:
        """Stop the worker (it finishes the step it is planning) and wait for it."""
        self._stop.set()
        self._thread.join()
