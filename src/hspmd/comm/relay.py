"""Relayed BSR: single-owner transfers between nodes spread over every NIC of both nodes.

Beyond the paper. Where a slice has one owner and a needer on another node, one NIC would
carry it all. A *relay plan* cuts such a transfer into one chunk per rank of the owner's
node and moves it in three fused BSR *rounds*, run one after the other::

    round 0   owner  -> i-th rank of its node          (fast intra link)   piece -> relay
    round 1   i-th rank -> i-th rank of needer's node  (the i-th NIC pair) relay -> relay
    round 2   i-th rank of needer's node -> needer     (fast intra link)   relay -> piece

The owner's own chunk skips round 0 and the needer's skips round 2 (the owner and the needer
are each the i-th rank of their node for some i); every transfer that is not relayed (local
copies, same-node, several owners, or fewer than two NIC pairs) runs in round 1 as is. Intermediate
chunks live in *relay buffers* on the relaying ranks, keyed by ``(tensor, region)``, for the
duration of the switch. The cost model (``hspmd.cost.traffic.estimate``) takes the rounds
as its stages (``RelayPlan.stages``), so the estimate and the executor
(``hspmd.runtime.relay.run_relay``) read the same plan.

    >>> from hspmd.comm.bsr import BsrTable, schedule
    >>> from hspmd.comm.topology import Topology
    >>> topo = Topology.uniform_nodes(4, ranks_per_node=2)
    >>> table = BsrTable.of({0: ((0, 4),)}, {2: ((0, 4),)}, (4,))
    >>> print(plan_relay([table], schedule([table]), topology=topo))
    relay plan: 3 rounds, 4 messages
    round 0 (1 messages)
      R0 -> R1  t0[2:4]  piece -> relay
    round 1 (2 messages)
      R0 -> R2  t0[0:2]  piece -> piece
      R1 -> R3  t0[2:4]  relay -> relay
    round 2 (1 messages)
      R3 -> R2  t0[2:4]  relay -> piece
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from hspmd.annotation import Region
from hspmd.comm.bsr import BsrEntry, BsrTable
from hspmd.comm.plan import Transfer, region_text
from hspmd.comm.slices import contains
from hspmd.comm.topology import Topology

__all__ = ["RelayPlan", "RelayTransfer", "plan_relay"]

BufferKey = tuple[int, Region]  # (tensor, global region) of one relay buffer


@dataclass(frozen=True, slots=True)
class RelayTransfer:
    """One region of one tensor from ``src`` to ``dst``: read from the sender's source piece
    or its relay buffer (``from_relay``), written into the receiver's destination piece or a
    new relay buffer (``to_relay``); ``src == dst`` is a local copy."""

    src: int
    dst: int
    region: Region
    tensor: int
    from_relay: bool = False
    to_relay: bool = False

    @property
    def transfer(self) -> Transfer:
        return Transfer(self.src, self.dst, self.region, self.tensor)

    def __str__(self) -> str:
        read = "relay" if self.from_relay else "piece"
        write = "relay" if self.to_relay else "piece"
        where = f"t{self.tensor}{region_text(self.region)}"
        return f"R{self.src} -> R{self.dst}  {where}  {read} -> {write}"


Round = tuple[RelayTransfer, ...]


@dataclass(frozen=True, slots=True)
class RelayPlan:
    """Rounds of transfers, each run as one fused BSR after the previous one finished."""

    rounds: tuple[Round, ...]

    def stages(self) -> list[list[Transfer]]:
        """The rounds as the traffic model's stages."""
        return [[t.transfer for t in round_] for round_ in self.rounds]

    def messages(self) -> list[dict[tuple[int, int], int]]:
        """Per round: one message per (sender, receiver) pair; local copies are none."""
        return [
            dict.fromkeys(sorted({(t.src, t.dst) for t in r if t.src != t.dst}), 1)
            for r in self.rounds
        ]

    @property
    def num_messages(self) -> int:
        return sum(len(per) for per in self.messages())

    def buffers(self, rank: int) -> set[BufferKey]:
        """The relay buffers ``rank`` holds during the switch."""
        return {
            (t.tensor, t.region) for r in self.rounds for t in r if t.to_relay and t.dst == rank
        }

    def __str__(self) -> str:
        lines = [f"relay plan: {len(self.rounds)} rounds, {self.num_messages} messages"]
        for index, (round_, per) in enumerate(zip(self.rounds, self.messages(), strict=True)):
            lines.append(f"round {index} ({len(per)} messages)")
            lines += [f"  {t}" for t in round_]
        return "\n".join(lines)


def plan_relay(
    tables: Sequence[BsrTable],
    transfers: Sequence[Transfer],
    *,
    topology: Topology,
    exclude: Collection[int] = (),
) -> RelayPlan:
    """The relay plan of a fused scheme ``transfers`` over ``tables`` (see the module
    docstring). Ranks in ``exclude`` (failed ones, or ranks that are not running) relay
    nothing."""
    entries = {t.tensor: t.entries for t in tables}
    rounds: list[list[RelayTransfer]] = [[], [], []]
    for t in transfers:
        crosses = t.src != t.dst and topology.node_of(t.src) != topology.node_of(t.dst)
        if not crosses or not _single_owner(t, entries[t.tensor]):
            rounds[1].append(RelayTransfer(t.src, t.dst, t.region, t.tensor))
            continue
        pairs = _rail_pairs(topology, t.src, t.dst, exclude)
        if len(pairs) < 2:  # one NIC pair at most: relaying only adds intra hops
            rounds[1].append(RelayTransfer(t.src, t.dst, t.region, t.tensor))
            continue
        chunks = _chunks(t.region, len(pairs))
        for chunk, (hop_src, hop_dst) in zip(chunks, pairs, strict=False):
            relayed_src, relayed_dst = hop_src != t.src, hop_dst != t.dst
            if relayed_src:
                rounds[0].append(RelayTransfer(t.src, hop_src, chunk, t.tensor, to_relay=True))
            rounds[1].append(
                RelayTransfer(hop_src, hop_dst, chunk, t.tensor, relayed_src, relayed_dst)
            )
            if relayed_dst:
                rounds[2].append(RelayTransfer(hop_dst, t.dst, chunk, t.tensor, from_relay=True))
    return RelayPlan(tuple(tuple(r) for r in rounds))


def _single_owner(t: Transfer, entries: Sequence[BsrEntry]) -> bool:
    """Whether every finest slice inside ``t.region`` has ``t.src`` as its only owner."""
    return all(e.owners == (t.src,) for e in entries if contains(t.region, e.region))


def _rail_pairs(
    topology: Topology, src: int, dst: int, exclude: Collection[int]
) -> list[tuple[int, int]]:
    """The middle round's (sender, receiver) pairs of a transfer ``src -> dst``: the ranks of
    equal local index on the two nodes (NIC ``k`` of one node to NIC ``k`` of the other,
    as rail-optimised clusters wire them), both able to relay; the pair holding ``src`` or
    ``dst`` first. A pair of unequal indices would cross rails: on the emulated network
    (docs/netcluster.md) its connection runs over the NICs of the lower index, so two
    crossed pairs share one NIC, and on a rail-optimised fabric it crosses the spine."""
    here = topology.nodes[topology.node_of(src)].ranks
    there = topology.nodes[topology.node_of(dst)].ranks
    pairs = [
        (a, b)
        for a, b in zip(here, there, strict=False)
        if (a == src or a not in exclude) and (b == dst or b not in exclude)
    ]
    return sorted(pairs, key=lambda p: (p[0] != src, p[1] != dst))


def _chunks(region: Region, count: int) -> list[Region]:
    """``region`` cut into ``count`` nearly equal boxes along its longest dim."""
    dim = max(range(len(region)), key=lambda d: region[d][1] - region[d][0])
    start, stop = region[dim]
    count = max(1, min(count, stop - start))
    cuts = [start + (stop - start) * i // count for i in range(count + 1)]
    return [region[:dim] + ((a, b),) + region[dim + 1 :] for a, b in itertools.pairwise(cuts)]
