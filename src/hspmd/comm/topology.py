"""Which ranks share a node, and the bandwidth of the link between any two ranks.

A ``Topology`` is a tuple of ``Node`` s; each node has a kind (``"H20"``), its ranks, the
link class inside it (NVLink) and the link class of each of its NICs (InfiniBand). Two ranks
of one node talk over the node's intra link; two ranks of different nodes over the slower of
the two nodes' NIC links. Bandwidths are bytes per second in one direction, per rank::

    >>> topo = Topology.uniform_nodes(16, ranks_per_node=8)
    >>> topo.link(0, 7).name, topo.link(0, 8).name
    ('nvlink', 'ib')

``Topology.flat()`` knows no nodes: every pair of ranks shares one link class, so BSR's
choice of owner falls through to load balance and rank order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hspmd.errors import HspmdError

LOCAL = "local"


class TopologyError(HspmdError, ValueError):
    """A topology that lists a rank twice, or a rank it does not know."""


@dataclass(frozen=True, slots=True)
class LinkClass:
    """A kind of link and its bandwidth in bytes per second, e.g. ``LinkClass("ib", 50e9)``."""

    name: str
    bandwidth: float

    def __str__(self) -> str:
        return f"{self.name}({self.bandwidth / 1e9:g} GB/s)"


# Per GPU in one direction: NVLink 4's 900 GB/s (H100, H200, H20) is the total of both
# directions; one 400 Gb/s InfiniBand NIC per GPU.
NVLINK = LinkClass("nvlink", 450e9)
INFINIBAND = LinkClass("ib", 50e9)
FLAT = LinkClass("link", 1.0)


@dataclass(frozen=True, slots=True)
class Node:
    """One machine: its ranks, the link inside it, the link of each NIC (one NIC per rank)."""

    ranks: tuple[int, ...]
    intra: LinkClass = NVLINK
    nic: LinkClass = INFINIBAND
    kind: str = "gpu"


@dataclass(frozen=True, slots=True)
class Topology:
    """Nodes of a cluster; with no nodes, every pair of ranks shares ``FLAT``."""

    nodes: tuple[Node, ...] = ()
    # rank -> node index, built once: ``link`` runs for every transfer of a switch, and a
    # cache keyed by the topology would rehash all its nodes per call (4096 ranks)
    _index: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        seen: set[int] = set()
        for node in self.nodes:
            twice = seen.intersection(node.ranks)
            if twice:
                raise TopologyError(f"rank {min(twice)} is in two nodes: list each rank once")
            seen.update(node.ranks)
        self._index.update((r, i) for i, node in enumerate(self.nodes) for r in node.ranks)

    @staticmethod
    def flat() -> Topology:
        return Topology()

    @staticmethod
    def uniform_nodes(
        num_ranks: int,
        *,
        ranks_per_node: int = 8,
        intra: LinkClass = NVLINK,
        inter: LinkClass = INFINIBAND,
        kind: str = "gpu",
    ) -> Topology:
        """``num_ranks`` ranks, ``ranks_per_node`` to a node in rank order."""
        starts = range(0, num_ranks, ranks_per_node)
        return Topology(
            tuple(
                Node(tuple(range(s, min(s + ranks_per_node, num_ranks))), intra, inter, kind)
                for s in starts
            )
        )

    @staticmethod
    def of_kinds(parts: Sequence[tuple[str, int, int, LinkClass, LinkClass]]) -> Topology:
        """Heterogeneous nodes: ``(kind, num_nodes, ranks_per_node, intra, nic)`` per kind,
        ranks numbered in the order given, e.g.
        ``[("H800", 2, 8, LinkClass("nvlink", 400e9), IB), ("H20", 4, 8, NVLINK, IB)]``.
        """
        nodes, next_rank = [], 0
        for kind, num_nodes, per_node, intra, nic in parts:
            for _ in range(num_nodes):
                nodes.append(Node(tuple(range(next_rank, next_rank + per_node)), intra, nic, kind))
                next_rank += per_node
        return Topology(tuple(nodes))

    def node_of(self, rank: int) -> int:
        """Index of the node holding ``rank`` (-1 for a flat topology)."""
        if not self.nodes:
            return -1
        try:
            return self._index[rank]
        except KeyError:
            raise TopologyError(
                f"rank {rank} is on no node of this topology ({len(self.nodes)} nodes): "
                "describe every rank the plans use"
            ) from None

    def link(self, a: int, b: int) -> LinkClass:
        """The link class between ranks ``a`` and ``b`` (``a == b``: a local copy)."""
        if a == b:
            return LinkClass(LOCAL, float("inf"))
        if not self.nodes:
            return FLAT
        node_a, node_b = self.node_of(a), self.node_of(b)
        if node_a == node_b:
            return self.nodes[node_a].intra
        nic_a, nic_b = self.nodes[node_a].nic, self.nodes[node_b].nic
        return nic_a if nic_a.bandwidth <= nic_b.bandwidth else nic_b

    def bandwidth(self, a: int, b: int) -> float:
        return self.link(a, b).bandwidth

    @property
    def link_classes(self) -> tuple[str, ...]:
        """Names of the link classes, fastest first (e.g. ``("nvlink", "ib")``)."""
        if not self.nodes:
            return (FLAT.name,)
        classes = {n.intra.name: n.intra.bandwidth for n in self.nodes}
        classes.update({n.nic.name: n.nic.bandwidth for n in self.nodes})
        return tuple(sorted(classes, key=lambda name: -classes[name]))
