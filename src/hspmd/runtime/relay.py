"""Run a relay plan (``hspmd.comm.relay``): its rounds in order, each one
``batch_isend_irecv`` with one packed buffer per pair of ranks (``Exchange``). A rank waits
only where it must: before a round in which it forwards a relayed chunk, for the receives
of the earlier rounds; every other round is issued at once, so the owner's direct chunk
crosses the slow link while round 0 is still handing the others to its node's ranks, and a
needer's node forwards one chunk while the next still arrives. Messages between one pair
in different rounds are matched in the order both issue them (round order).

A transfer reads from the sender's source piece or from one of its relay buffers, and
writes into the receiver's destination piece or into a relay buffer it allocates, keyed by
``(tensor, region)``. The buffers live only inside ``run_relay``::

    plan = plan_relay(tables, schedule(tables, topology=topo), topology=topo)
    out = run_relay(plan, tensors, {0: w} if rank == 0 else {}, world)
    # every rank: its destination pieces, as run_fused_bsr would return them

Every tensor of one call has the same dtype (one buffer per pair).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from hspmd.comm.plan import local_box
from hspmd.comm.relay import BufferKey, RelayPlan, RelayTransfer
from hspmd.runtime.fused import FusedTensor, rank_ends
from hspmd.runtime.p2p import Exchange
from hspmd.runtime.trace import comm_span
from hspmd.runtime.world import World

__all__ = ["run_relay"]


class _Ends:
    """This rank's source pieces, destination pieces and relay buffers during one run."""

    def __init__(
        self,
        tensors: Sequence[FusedTensor],
        local: Mapping[int, torch.Tensor],
        world: World,
        dtype: torch.dtype,
    ) -> None:
        self.local, self.dtype, self.device = local, dtype, world.device
        ends = rank_ends(tensors, local, world.rank, dtype=dtype, device=world.device)
        self.old, self.new, self.out = ends.old, ends.new, ends.out
        self.buffers: dict[BufferKey, torch.Tensor] = {}

    def read(self, t: RelayTransfer) -> torch.Tensor:
        if t.from_relay:
            return self.buffers[(t.tensor, t.region)]
        return self.local[t.tensor][local_box(self.old[t.tensor], t.region)]

    def write(self, t: RelayTransfer) -> torch.Tensor:
        if not t.to_relay:
            return self.out[t.tensor][local_box(self.new[t.tensor], t.region)]
        key = (t.tensor, t.region)
        if key not in self.buffers:
            shape = tuple(hi - lo for lo, hi in t.region)
            self.buffers[key] = torch.empty(shape, dtype=self.dtype, device=self.device)
        return self.buffers[key]


def run_relay(
    plan: RelayPlan,
    tensors: Sequence[FusedTensor],
    local: Mapping[int, torch.Tensor],
    world: World,
    *,
    dtype: torch.dtype = torch.float32,
) -> dict[int, torch.Tensor]:
    """This rank's piece of every tensor it holds after the move, by tensor index.

    ``local`` maps the index of every tensor whose source piece this rank holds to that
    piece. Per round, one message per (sender, receiver) pair of that round.
    """
    rank = world.rank
    ends = _Ends(tensors, local, world, dtype)
    pending: list[tuple[list[Any], Callable[[], None]]] = []  # receives still in flight
    in_flight: list[Any] = []  # every operation issued, waited for at the end
    for round_ in plan.rounds:
        mine = [t for t in round_ if rank in (t.src, t.dst)]
        if any(t.from_relay and t.src == rank for t in mine):
            # this round forwards relayed chunks: they must have arrived (earlier rounds'
            # receives); everything else overlaps the earlier rounds still in flight
            with comm_span(world, "relay-round"):
                world.wait([w for works, _ in pending for w in works])
            for _, unpack in pending:
                unpack()
            pending = []
        exchange = Exchange(world)
        for t in mine:
            if t.src == t.dst == rank:
                ends.write(t).copy_(ends.read(t))
            elif t.src == rank:
                exchange.send(t.dst, [ends.read(t)])
            else:
                exchange.recv(t.src, [ends.write(t)])
        with comm_span(world, "relay-round"):
            sends, recvs, unpack = _start(exchange)
        in_flight += sends
        pending.append((recvs, unpack))
    with comm_span(world, "relay-round"):
        world.wait(in_flight + [w for works, _ in pending for w in works])
    for _, unpack in pending:
        unpack()
    return ends.out


def _start(exchange: Exchange) -> tuple[list[Any], list[Any], Callable[[], None]]:
    """Issue ``exchange``: (its sends, its receives, the unpacking once they are done)."""
    works, unpack = exchange.start()
    num_sends = len(exchange.sends)  # issued first, one per peer (``Exchange.start``)
    if len(works) != num_sends + len(exchange.recvs):  # coalesced (nccl): one for all
        return [], works, unpack
    return works[:num_sends], works[num_sends:], unpack
