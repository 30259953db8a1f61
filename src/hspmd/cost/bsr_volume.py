"""A fused BSR scheme's cost from bytes per (sender, receiver), without a transfer per slice.

``hspmd.comm.bsr.schedule`` returns one ``Transfer`` per (sender, receiver, tensor) with
its merged boxes, which the runtime needs; ``hspmd.cost.traffic.estimate`` then prices
them one by one. A cost needs less: the traffic model's send and receive times are sums
over the transfers of bytes over the link's bandwidth, and the link depends only on the
(sender, receiver) pair, and a fused scheme sends one message per pair. So this module
applies the same rules to every (slice, needer) in the same order (``bsr.walk``, local
copies left out: they load no sender), keeps two flat arrays (the pair as one int, the
slice's bytes), and sums the bytes per pair, then per (rank, link class), with numpy.

At 65,536 ranks (llama-70b, 1024 -> 2048 pipelines, benchmarks/metadata_scale.py) that is
11.8 million picks held as 16 bytes each, where the scheme held a region per pick and a
``Transfer`` per pair. The picks are the scheme's own, so every byte count is equal to
``estimate(schedule(...))``'s (sums of whole numbers below 2**53 are exact in floats); a
rank's seconds sum the same terms grouped per link class rather than per transfer, so they
may differ from it in the last bits (tests/comm/test_bsr_volume.py compares both).

    >>> from hspmd.annotation import parse_annotation as A
    >>> from hspmd.comm.bsr import BsrTable
    >>> from hspmd.comm.topology import Topology
    >>> table = BsrTable.between(A("[0,1]{D:2}"), A("[2,3,9]{0:3}"), (6,), itemsize=4)
    >>> est, pairs = fused_estimate([table], topology=Topology.uniform_nodes(16, ranks_per_node=8))
    >>> est.sent, pairs
    ({0: {'nvlink': 8.0, 'ib': 8.0}, 1: {'nvlink': 8.0}}, 3)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hspmd.comm.bsr import BsrTable, key_space, walk
from hspmd.comm.topology import LinkClass, Topology
from hspmd.cost.traffic import Estimate

__all__ = ["fused_estimate", "pair_bytes"]


def pair_bytes(
    tables: Sequence[BsrTable], *, topology: Topology | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Senders, receivers and bytes of the fused heuristic scheme over ``tables``, one row
    per (sender, receiver) pair that moves something (sender != receiver), by sender then
    receiver: ``messages(schedule(tables))``'s pairs and their summed volumes."""
    topology = topology or Topology.flat()
    ranks, _, _ = key_space(tables)
    keys, sizes = walk(tables, topology, method="heuristic", fused=True, ranks=ranks,
                       tensors=1, local=False, sizes=True)  # fmt: skip
    flat = np.frombuffer(keys, dtype=np.int64) if len(keys) else np.zeros(0, np.int64)
    pairs, index = np.unique(flat, return_inverse=True)
    weights = np.frombuffer(sizes, dtype=np.float64) if len(sizes) else np.zeros(0)
    volumes = np.bincount(index.reshape(-1), weights=weights, minlength=len(pairs))
    del keys, sizes, flat, index
    return pairs // ranks, pairs % ranks, volumes


def fused_estimate(
    tables: Sequence[BsrTable], *, topology: Topology | None = None
) -> tuple[Estimate, int]:
    """``traffic.estimate`` of the fused heuristic scheme over ``tables`` (one stage), and
    its message count (pairs), computed from ``pair_bytes``."""
    topology = topology or Topology.flat()
    src, dst, volumes = pair_bytes(tables, topology=topology)
    classes, link = _link_ids(topology, src, dst)
    bandwidth = np.array([c.bandwidth for c in classes])
    sent = _per_rank(src, link, volumes, classes)
    received = _per_rank(dst, link, volumes, classes)
    send_t = _seconds(src, link, volumes, bandwidth)
    recv_t = _seconds(dst, link, volumes, bandwidth)
    rank_time = {
        r: max(send_t.get(r, 0.0), recv_t.get(r, 0.0)) for r in sorted(set(send_t) | set(recv_t))
    }
    time = max(rank_time.values(), default=0.0)
    return Estimate(sent, rank_time, time, received), len(src)


def _link_ids(
    topology: Topology, src: np.ndarray, dst: np.ndarray
) -> tuple[list[LinkClass], np.ndarray]:
    """The distinct link classes and, per pair, the index of ``topology.link(src, dst)``'s."""
    if not topology.nodes:
        return [topology.link(0, 1)], np.zeros(len(src), dtype=np.int64)
    classes: list[LinkClass] = []
    ids: dict[LinkClass, int] = {}
    intra = np.array([ids.setdefault(n.intra, len(ids)) for n in topology.nodes])
    nic = np.array([ids.setdefault(n.nic, len(ids)) for n in topology.nodes])
    classes = list(ids)
    bandwidth = np.array([c.bandwidth for c in classes])
    ranks = np.unique(np.concatenate([src, dst]))
    node_of = np.zeros(int(ranks.max()) + 1 if len(ranks) else 0, dtype=np.int64)
    node_of[ranks] = [topology.node_of(int(r)) for r in ranks]  # TopologyError off the nodes
    a, b = node_of[src], node_of[dst]
    # Topology.link: the node's intra link on one node, else the slower NIC (the sender's
    # on equal bandwidth)
    slower = np.where(bandwidth[nic[a]] <= bandwidth[nic[b]], nic[a], nic[b])
    return classes, np.where(a == b, intra[a], slower)


def _per_rank(
    rank: np.ndarray, link: np.ndarray, volumes: np.ndarray, classes: list[LinkClass]
) -> dict[int, dict[str, float]]:
    """Bytes per rank and link class name, ranks in order (``Estimate.sent``'s form)."""
    out: dict[int, dict[str, float]] = {}
    width = len(classes)
    keys, index = np.unique(rank * width + link, return_inverse=True)
    sums = np.bincount(index.reshape(-1), weights=volumes, minlength=len(keys))
    for key, total in zip(keys.tolist(), sums.tolist(), strict=True):
        r, c = divmod(key, width)
        per = out.setdefault(r, {})
        name = classes[c].name
        per[name] = per.get(name, 0.0) + total
    return out


def _seconds(
    rank: np.ndarray, link: np.ndarray, volumes: np.ndarray, bandwidth: np.ndarray
) -> dict[int, float]:
    """Per rank, the sum over its link classes of its bytes on the class over its bandwidth."""
    width = len(bandwidth)
    keys, index = np.unique(rank * width + link, return_inverse=True)
    sums = np.bincount(index.reshape(-1), weights=volumes, minlength=len(keys))
    out: dict[int, float] = {}
    for key, total in zip(keys.tolist(), sums.tolist(), strict=True):
        r, c = divmod(key, width)
        out[r] = out.get(r, 0.0) + total / float(bandwidth[c])
    return out
