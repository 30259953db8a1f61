"""One ``batch_isend_irecv`` with one packed buffer per peer and direction.

Executors queue tensors (often views of a region) per peer; ``run`` packs each peer's sends
contiguously in queue order, receives into one buffer per peer, waits, and unpacks in the
same order. Both sides queue a pair's tensors in the same (plan) order, so the layouts agree::

    exchange = Exchange(world)
    exchange.send(1, [x[0:2], x[4:6]])    # packed: 2 regions, 1 buffer to rank 1
    exchange.recv(1, [out[0:2]])          # received from rank 1 straight into a view
    new = exchange.recv_new(1, (2, 3), {"dtype": torch.float32, "device": "cpu"})
    exchange.run()                        # new.value: a view of rank 1's receive buffer

A single contiguous tensor is sent or received in place (no copy). ``tag`` keeps streams of
exchanges that may be in flight at once between the same two ranks apart (ZeRO's gradient
reduces and parameter gathers, hspmd.train.zero_shards): gloo pairs messages per peer and
tag, in issue order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hspmd.runtime.world import World


class Received:
    """A tensor ``Exchange.recv_new`` receives: ``value`` is set when the batch is issued
    (a view of the peer's receive buffer, no unpacking copy) and holds the data once it
    is done."""

    __slots__ = ("shape", "like", "value")

    def __init__(self, shape: tuple[int, ...], like: dict[str, Any]) -> None:
        self.shape, self.like = shape, like
        self.value: torch.Tensor | None = None

    def numel(self) -> int:
        return math.prod(self.shape)


class Exchange:
    """Sends and receives queued per peer, issued as one batch by ``run``."""

    __slots__ = ("world", "sends", "recvs", "tag")

    def __init__(self, world: World, *, tag: int = 0) -> None:
        self.world, self.tag = world, tag
        self.sends: dict[int, list[torch.Tensor]] = {}
        self.recvs: dict[int, list[torch.Tensor | Received]] = {}

    def send(self, peer: int, tensors: list[torch.Tensor]) -> None:
        self.sends.setdefault(peer, []).extend(tensors)

    def recv(self, peer: int, tensors: list[torch.Tensor]) -> None:
        """``tensors`` (views allowed) are overwritten with what ``peer`` sends, in order."""
        self.recvs.setdefault(peer, []).extend(tensors)

    def recv_new(self, peer: int, shape: tuple[int, ...], like: dict[str, Any]) -> Received:
        """A new tensor of ``shape`` (``like``: dtype and device) that ``peer`` sends, in
        the same order as ``recv``'s."""
        received = Received(shape, like)
        self.recvs.setdefault(peer, []).append(received)
        return received

    def run(self) -> None:
        """Issue every queued transfer as one batch and wait for it."""
        works, then = self.start()
        self.world.wait(works)
        then()

    def start(self) -> tuple[list[Any], Callable[[], None]]:
        """Issue the batch; returns the operations in flight and the unpacking to run once
        they are done (``run`` without the wait)."""
        ops = []
        unpack: list[tuple[torch.Tensor, list[torch.Tensor | Received]]] = []
        packed: dict[tuple[object, ...], torch.Tensor] = {}  # peers sent the same views
        for peer in sorted(self.sends):
            key = tuple((t.data_ptr(), t.shape, t.stride()) for t in self.sends[peer])
            buffer = packed.get(key)
            if buffer is None:  # a split-all-gather sends one owner's region to every rank
                buffer = packed[key] = _pack(self.sends[peer])
            self.world.record("send", group=(self.world.rank, peer), nbytes=_nbytes(buffer))
            ops.append(dist.P2POp(dist.isend, buffer, peer, tag=self.tag))
        for peer in sorted(self.recvs):
            targets = self.recvs[peer]
            first = targets[0]
            if len(targets) == 1 and isinstance(first, torch.Tensor) and first.is_contiguous():
                buffer = first
            else:
                buffer = _empty_flat(targets)
                _bind(buffer, targets)
                unpack.append((buffer, targets))
            self.world.record("recv", group=(peer, self.world.rank), nbytes=_nbytes(buffer))
            ops.append(dist.P2POp(dist.irecv, buffer, peer, tag=self.tag))
        if not ops:
            return [], lambda: None
        self.world.record("batch", group=(self.world.rank,), nbytes=0)
        works = self.world.post(lambda: list(dist.batch_isend_irecv(ops)))

        def then() -> None:
            for buffer, targets in unpack:
                offset = 0
                for target in targets:
                    size = target.numel()
                    if isinstance(target, torch.Tensor):
                        target.copy_(buffer[offset : offset + size].view(target.shape))
                    offset += size

        return works, then


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous buffer holding ``tensors`` in order, with a single copy of each."""
    if len(tensors) == 1:
        return tensors[0].contiguous()
    buffer = _empty_flat(tensors)
    offset = 0
    for t in tensors:
        buffer[offset : offset + t.numel()].view(t.shape).copy_(t)
        offset += t.numel()
    return buffer


def _empty_flat(tensors: list[torch.Tensor] | list[torch.Tensor | Received]) -> torch.Tensor:
    first = tensors[0]
    like = (
        first.like
        if isinstance(first, Received)
        else {"dtype": first.dtype, "device": first.device}
    )
    return torch.empty(sum(t.numel() for t in tensors), **like)


def _bind(buffer: torch.Tensor, targets: list[torch.Tensor | Received]) -> None:
    """Each ``Received`` of ``targets`` becomes its view of ``buffer``."""
    offset = 0
    for target in targets:
        size = target.numel()
        if isinstance(target, Received):
            target.value = buffer[offset : offset + size].view(target.shape)
        offset += size
