"""Python's cyclic garbage collector paused around a burst of metadata work.

The collector runs a full collection each time enough objects survive younger ones, and a
full collection visits every tracked object of the process (torch's import alone leaves
about 300,000). Building metadata creates millions of small objects that live on (a
capture's 6,000 fx nodes, a 4096-rank switch's 740,352 transfers) and almost no cycles of
garbage, so those collections are pure cost that grows with the heap: a quarter of
llama-70b's capture, a fifth of a 4096-rank switch plan (benchmarks/metadata_scale.py).

    >>> import gc
    >>> with paused_gc():
    ...     gc.isenabled()
    False
    >>> gc.isenabled()
    True
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["paused_gc"]


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Automatic collection off inside, back as it was after (nested pauses leave it off
    until the outermost ends). Nothing is collected on the way out: the next automatic
    collection frees any cycle made inside."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
