"""The training state's memory on one rank, measured as tracked tensor bytes.

State = parameters (the bytes their storage holds now: a ZeRO-3 parameter between uses holds
none), their gradients, the fp32 masters and Adam moments, the masters' gradients and what a
Post keeps besides (``Post.extra_tensors()``: ZeRO's gradient shards in the making, ZeRO-3's
stored compute-dtype shards). Storages are counted once (an fp32 ZeRO-3 master is its stored
parameter). ``sample()`` is called at the points where the state grows (each gather, each
gradient, the sync, the optimizer); ``peak`` is the largest sum seen. On CUDA the allocator's
``max_memory_allocated`` says more (activations too); this is the part ZeRO changes, on any
device (benchmarks/zero.py)::

    meter = StateMeter(lambda: state_tensors(exe.params, post))
    meter.sample(); meter.peak
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

__all__ = ["StateMeter", "state_tensors"]


def state_tensors(params: Mapping[str, torch.Tensor], post: Any) -> Iterable[torch.Tensor]:
    """The tensors of the training state of a rank: its parameters and their gradients,
    and its Post's masters, moments, their gradients and extras."""
    for p in params.values():
        yield p
        if p.grad is not None:
            yield p.grad
    if post is None:
        return
    for master, exp_avg, exp_avg_sq in post.state().values():
        yield from (master, exp_avg, exp_avg_sq)
        if master.grad is not None:
            yield master.grad
    yield from getattr(post, "extra_tensors", lambda: ())()


class StateMeter:
    """Peak tracked bytes of ``tensors()`` over the ``sample()`` calls (module docstring)."""

    def __init__(self, tensors: Callable[[], Iterable[torch.Tensor]]) -> None:
        self.tensors = tensors
        self.peak = 0
        self.now = 0

    def sample(self) -> None:
        seen: dict[int, int] = {}
        for t in self.tensors():
            storage = t.untyped_storage()
            if storage.nbytes():
                seen[storage.data_ptr()] = storage.nbytes()
        self.now = sum(seen.values())
        self.peak = max(self.peak, self.now)
