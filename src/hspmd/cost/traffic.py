"""Volume and estimated time of a BSR scheme on a topology.

The model, per stage of transfers (a plain scheme is one stage; a relayed one has up to three,
run one after the other)::

    send_time(rank) = sum over its sends    of transfer_time(bytes, link to the receiver)
    recv_time(rank) = sum over its receives of transfer_time(bytes, link from the sender)
    rank_time(rank) = max(send_time, recv_time)     # a rank sends and receives at once
    stage_time      = max over ranks of rank_time   # the slowest rank sets the pace
    time            = sum of stage_time over stages

``transfer_time`` is the link model of every cost (``hspmd.cost.link``), here at one over the
link class's bandwidth a byte and no latency: a batched exchange posts every message of a
stage at once, so their latencies overlap (and are small next to the bytes of a switch).
Local copies cost nothing. Links of one class are not shared between ranks (one NIC per GPU,
full-bisection fabric), so contention inside a switch is not modelled.

    >>> from hspmd.comm.plan import Transfer
    >>> from hspmd.comm.topology import LinkClass, Topology
    >>> topo = Topology.uniform_nodes(16, ranks_per_node=8)
    >>> est = estimate([[Transfer(0, 8, ((0, 50),)), Transfer(0, 1, ((0, 450),))]], topology=topo,
    ...                itemsizes={0: 1_000_000_000})
    >>> est.sent[0], round(est.time, 3)
    ({'ib': 50000000000.0, 'nvlink': 450000000000.0}, 2.0)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hspmd.comm.plan import Transfer, volume
from hspmd.comm.topology import LinkClass, Topology
from hspmd.cost.link import transfer_time


@dataclass(frozen=True, slots=True)
class Estimate:
    """Bytes each rank sends (and receives) per link class, each rank's time, and the total
    time (s)."""

    sent: dict[int, dict[str, float]]
    rank_time: dict[int, float]
    time: float
    received: dict[int, dict[str, float]] = field(default_factory=dict)

    def total(self, link: str | None = None) -> float:
        return sum(v for per in self.sent.values() for k, v in per.items() if link in (None, k))


def estimate(
    stages: Sequence[Sequence[Transfer]],
    *,
    topology: Topology,
    itemsizes: Mapping[int, int] | None = None,
) -> Estimate:
    """Volumes and time of ``stages`` (see the module docstring); ``itemsizes[tensor]`` is
    bytes per element (1 when not given)."""
    sent: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    received: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    rank_time: dict[int, float] = defaultdict(float)
    time = 0.0
    sizes = itemsizes or {}
    links: dict[tuple[int, int], LinkClass] = {}  # per pair: a switch has far fewer pairs
    for stage in stages:
        send_t: dict[int, float] = defaultdict(float)
        recv_t: dict[int, float] = defaultdict(float)
        for t in stage:
            src, dst = t.src, t.dst
            if src == dst:
                continue
            size = volume(t.region) * sizes.get(t.tensor, 1)
            link = links.get((src, dst))
            if link is None:
                link = links[(src, dst)] = topology.link(src, dst)
            sent[src][link.name] += size
            received[dst][link.name] += size
            seconds = transfer_time(size, per_byte=1.0 / link.bandwidth)
            send_t[src] += seconds
            recv_t[dst] += seconds
        stage_time = 0.0
        for rank in set(send_t) | set(recv_t):
            busy = max(send_t[rank], recv_t[rank])
            rank_time[rank] += busy
            stage_time = max(stage_time, busy)
        time += stage_time
    return Estimate(
        {r: dict(v) for r, v in sorted(sent.items())},
        dict(rank_time),
        time,
        {r: dict(v) for r, v in sorted(received.items())},
    )
