"""The cluster file (``hspmd.cluster/1``) of an emulated network, from measured link figures.

Each node is one kind ``netns-cpu`` whose intra link is the namespace's loopback; the inter
link is the node's veth through the bridge. The cluster format counts bandwidth per rank
(one NIC per GPU), and the ``ranks_per_node`` ranks of a namespace share its one veth, so
``inter_link.GBps`` is the measured link rate over ``ranks_per_node`` (with
``nic_per_rank``, each rank has its own veth: the measured rate itself), and the link is
marked ``shared`` (one flow leaving a node may use the whole veth: the cost model splits it
among the flows leaving at once); the measured figures themselves are kept under
``netcluster.measured``::

    >>> from hspmd.netcluster.spec import NetSpec
    >>> spec = NetSpec(2, 2, 0.4)
    >>> data = cluster_json(spec, Measured(loopback_Bps=2e9, inter_Bps=4.8e7), memory_mb=1000)
    >>> data["inter_link"], data["gpu_kinds"]["netns-cpu"]["intra_link"]
    ({'name': 'veth', 'GBps': 0.024, 'shared': True}, {'name': 'loopback', 'GBps': 2.0})
    >>> from hspmd.cost.cluster import cluster_from_json
    >>> str(cluster_from_json(data).topology().link(0, 2))
    'veth(0.024 GB/s)'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hspmd.netcluster.spec import NetSpec

KIND = "netns-cpu"


@dataclass(frozen=True, slots=True)
class Measured:
    """Bytes per second of one TCP stream: inside a namespace, and from one node to another."""

    loopback_Bps: float
    inter_Bps: float

    @property
    def ratio(self) -> float:
        """How many times the loopback is faster than the inter-node link."""
        return self.loopback_Bps / self.inter_Bps


def cluster_json(spec: NetSpec, measured: Measured, *, memory_mb: float) -> dict[str, Any]:
    """The cluster file's JSON object; ``memory_mb`` is each rank's share of the host."""
    intra = round(measured.loopback_Bps / 1e9, 4)
    sharing = 1 if spec.nic_per_rank else spec.ranks_per_node
    inter = round(measured.inter_Bps / sharing / 1e9, 6)
    return {
        "format": "hspmd.cluster/1",
        "name": f"netcluster-{spec.num_nodes}x{spec.ranks_per_node}",
        "description": (
            f"{spec.num_nodes} network namespaces of {spec.ranks_per_node} CPU ranks, joined "
            f"by a bridge; each {'rank' if spec.nic_per_rank else 'node'}'s veth shaped to "
            f"{spec.inter_gbps:g} Gbit/s per direction"
            f"{f', {spec.latency_ms:g} ms round trip' if spec.latency_ms else ''} "
            "(hspmd netcluster up)"
        ),
        "gpu_kinds": {
            KIND: {
                "memory_mb": round(memory_mb),
                "bf16_tflops": 0.1,
                "intra_link": {"name": "loopback", "GBps": intra},
            }
        },
        "inter_link": {"name": "veth", "GBps": inter}
        | ({} if spec.nic_per_rank else {"shared": True}),
        "nodes": [{"kind": KIND, "count": spec.num_nodes, "gpus_per_node": spec.ranks_per_node}],
        "one_host": True,  # the namespaces share this machine's cores
        "assumed": {
            f"gpu_kinds.{KIND}.bf16_tflops": "not measured: a placeholder, profile the host "
            "with `hspmd profile` for compute figures",
            f"gpu_kinds.{KIND}.memory_mb": "the host's memory split evenly over the ranks",
            "inter_link.GBps": (
                "the measured rate of one rank's own veth"
                if spec.nic_per_rank
                else f"the measured rate of one node's veth ({measured.inter_Bps / 1e9:.4f} "
                f"GB/s) over its {spec.ranks_per_node} ranks; shared: one flow leaving the "
                "node may use all of it"
            ),
        },
        "netcluster": {
            "namespaces": list(spec.nodes),
            "addresses": [spec.address(i) for i in range(spec.num_nodes)],
            "nics": list(spec.nics),
            "master_addr": spec.address(0),
            "ranks_per_node": spec.ranks_per_node,
            "inter_gbps": spec.inter_gbps,
            "latency_ms": spec.latency_ms,
            "measured": {
                "loopback_GBps": round(measured.loopback_Bps / 1e9, 4),
                "inter_GBps": round(measured.inter_Bps / 1e9, 6),
                "ratio": round(measured.ratio, 2),
                "how": "one TCP stream, best of 3 transfers (python -m hspmd.netcluster.measure)",
            },
        },
    }
