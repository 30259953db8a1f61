"""Progress of a training run as plain lines (stdout is not a terminal: a log, a pipe).

One line per step, with the steps done of the total, the loss, the step's tokens/s and
the time left at the pace of this run's steps so far, and one per held-out evaluation::

    step  3/10  loss 5.561234  8,123 tokens/s  eta 0:00:04
    eval after step 4: loss 5.123456  perplexity 167.89  (4 batches, 0.12 s)

>>> from hspmd.train.config import StepRecord
>>> line = PlainProgress(total=4, done=0, clock=iter([0.0, 2.0]).__next__)
>>> line(StepRecord(step=1, loss=5.5, tokens=1024, seconds=0.5))
step 1/4  loss 5.500000  2,048 tokens/s  eta 0:00:06
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hspmd.train.config import EvalRecord, Record, StepRecord

__all__ = ["PlainProgress", "eval_line", "switch_line"]


def eval_line(record: EvalRecord) -> str:
    """``eval after step 4: loss 5.123456  perplexity 167.89  (4 batches, 0.1 s)``.

    >>> eval_line(EvalRecord(step=4, loss=2.0, batches=4, tokens=512, seconds=0.125))
    'eval after step 4: loss 2.000000  perplexity 7.39  (4 batches, 0.12 s)'
    """
    return (
        f"eval after step {record.step}: loss {record.loss:.6f}  perplexity "
        f"{record.perplexity:,.2f}  ({record.batches} batches, {record.seconds:.2f} s)"
    )


def switch_line(record: StepRecord) -> str:
    """``switch before step 3 to '...': 12.3 ms``."""
    assert record.switch_seconds is not None
    return (
        f"switch before step {record.step} to {record.strategy!r}: "
        f"{record.switch_seconds * 1e3:.1f} ms"
    )


def _clock_text(seconds: float) -> str:
    whole = max(0, round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class PlainProgress:
    """The step callback that prints one line per step (module docstring); ``done``: the
    step the run starts after (a resumed run), ``clock``: seconds, for tests."""

    def __init__(
        self, *, total: int, done: int = 0, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.total, self.first, self.clock = total, done, clock
        self.begin = clock()

    def __call__(self, record: Record) -> None:
        if isinstance(record, EvalRecord):
            print(eval_line(record), flush=True)
            return
        if record.switch_seconds is not None:
            print(switch_line(record), flush=True)
        ran = record.step - self.first
        per_step = (self.clock() - self.begin) / max(ran, 1)
        eta = per_step * max(self.total - record.step, 0)
        rate = record.tokens / max(record.seconds, 1e-9)
        width = len(str(self.total))
        print(
            f"step {record.step:>{width}}/{self.total}  loss {record.loss:.6f}  "
            f"{rate:,.0f} tokens/s  eta {_clock_text(eta)}",
            flush=True,
        )
