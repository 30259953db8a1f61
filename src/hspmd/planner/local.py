"""A cost model of local processes, for planning on this machine without a cluster file.

``local_cost(num_ranks)`` describes ``num_ranks`` equal CPU processes as one cluster kind
``"cpu"``: one node, or nodes of ``ranks_per_node`` (fake nodes, as ``hspmd train
--ranks-per-node`` makes them), each process with an equal share of this machine's memory.
Compute comes from ``profile`` (a file ``hspmd profile`` wrote) where given, else from the
assumed figures below; only their ratios matter when every rank is the same. Ranks that
differ (``--slowdown``) need a cluster file with one kind per speed.

    >>> cost = local_cost(4, ranks_per_node=2)
    >>> cost.num_ranks, cost.node_of(3), cost.kind_of(0)
    (4, 1, 'cpu')
"""

from __future__ import annotations

import os
from typing import Any, Literal

from hspmd.cost.cluster import FORMAT, ClusterError, cluster_from_json
from hspmd.cost.lines import CostModel

__all__ = ["CPU_GFLOPS", "LOOPBACK_GBPS", "local_cost"]

CPU_GFLOPS = 20.0  # assumed: one thread's sustained fp32 matmul rate
CPU_MEMORY_GBPS = 10.0  # assumed: one thread's memory bandwidth
LOOPBACK_GBPS = 2.0  # assumed: gloo over loopback between two local processes


def local_cost(
    num_ranks: int, *, ranks_per_node: int | None = None, profile: str | None = None,
    dtype: Literal["bf16", "fp32"] = "fp32",
) -> CostModel:  # fmt: skip
    """The cost model of ``num_ranks`` local processes (module docstring)."""
    per_node = ranks_per_node or num_ranks
    if num_ranks < 1 or per_node < 1 or num_ranks % per_node:
        raise ClusterError(
            f"num_ranks={num_ranks}, ranks_per_node={ranks_per_node}: give num_ranks >= 1 "
            "and a ranks_per_node that divides it"
        )
    memory_mb = _host_memory_bytes() / num_ranks / 1e6
    kind: dict[str, Any] = {
        "memory_mb": memory_mb,
        "bf16_tflops": CPU_GFLOPS / 1e3,
        "achieved_tflops": CPU_GFLOPS / 1e3,
        "hbm_GBps": CPU_MEMORY_GBPS,
        "intra_link": {"name": "loopback", "GBps": LOOPBACK_GBPS},
    }
    if profile is not None:
        kind["profile"] = str(profile)
    data = {
        "format": FORMAT,
        "name": f"local-{num_ranks}",
        "gpu_kinds": {"cpu": kind},
        "inter_link": {"name": "loopback", "GBps": LOOPBACK_GBPS},
        "nodes": [{"kind": "cpu", "count": num_ranks // per_node, "gpus_per_node": per_node}],
        "one_host": True,  # fake nodes or not, the processes share this machine's cores
    }
    return CostModel.of(cluster_from_json(data, origin="local processes"), dtype=dtype)


def _host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX: assume 16 GB
        return 16e9
