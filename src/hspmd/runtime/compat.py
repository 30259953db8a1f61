"""torch.distributed names that differ between the torch versions hspmd runs on (>= 2.11).

torch 2.13 renamed ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` to
``all_gather_single`` and ``reduce_scatter_single`` (same arguments; the old names warn
there), and 2.11 and 2.12 have only the old names. The runtime calls these two::

    all_gather_single(output, input, group=..., async_op=True)       # concatenated on dim 0
    reduce_scatter_single(output, input, group=..., async_op=True)   # input split on dim 0
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single"]

all_gather_single: Callable[..., Any] = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)
reduce_scatter_single: Callable[..., Any] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)
