"""A cost model of local processes, for planning on this machine without a cluster file.

``local_cost(num_ranks)`` describes ``num_ranks`` equal CPU processes as one cluster kind
``"cpu"``: one node, or nodes of ``ranks_per_node`` (fake nodes, as ``hspmd train
--ranks-per-node`` makes them), each process with an equal share of this machine's memory.
Compute comes from ``profile`` (a file ``hspmd profile`` wrote) where given, else from the
assumed figures below; only their ratios matter when every rank is the same. Ranks that
``slowdown`` makes slower (``--slowdown``) are a kind of their own (``"cpu-x3"``, a kind's
``slowdown`` factor), each run of equal speed a node of its own.

    >>> cost = local_cost(4, ranks_per_node=2)
    >>> cost.num_ranks, cost.node_of(3), cost.kind_of(0)
    (4, 1, 'cpu')
    >>> slow = local_cost(4, slowdown={2: 3.0})
    >>> [slow.kind_of(r) for r in range(4)], [slow.node_of(r) for r in range(4)]
    (['cpu', 'cpu', 'cpu-x3', 'cpu'], [0, 0, 1, 2])
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from hspmd.cost.cluster import FORMAT, ClusterError, cluster_from_json
from hspmd.cost.lines import CostModel

__all__ = ["CPU_GFLOPS", "LOOPBACK_GBPS", "local_cost"]

CPU_GFLOPS = 20.0  # assumed: one thread's sustained fp32 matmul rate
CPU_MEMORY_GBPS = 10.0  # assumed: one thread's memory bandwidth
LOOPBACK_GBPS = 2.0  # assumed: gloo over loopback between two local processes


def local_cost(
    num_ranks: int, *, ranks_per_node: int | None = None, profile: str | None = None,
    dtype: Literal["bf16", "fp32"] = "fp32", slowdown: Mapping[int, float] | None = None,
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
    if slowdown and any(f != 1.0 for f in slowdown.values()):
        _slowed(data, num_ranks, per_node, slowdown)
    return CostModel.of(cluster_from_json(data, origin="local processes"), dtype=dtype)


def _slowed(data: dict[str, Any], num_ranks: int, per_node: int, slowdown: Mapping[int, float]) -> None:  # fmt: skip
    """``data`` with a kind per slowdown factor, each run of ranks of one factor inside a
    node a node of its own (a TP group never mixes speeds)."""
    factors = [float(slowdown.get(r, 1.0)) for r in range(num_ranks)]
    base = data["gpu_kinds"]["cpu"]
    nodes = []
    for start in range(0, num_ranks, per_node):
        run = [start]
        for r in range(start + 1, start + per_node + 1):
            if r == start + per_node or factors[r] != factors[run[0]]:
                name = "cpu" if factors[run[0]] == 1.0 else f"cpu-x{factors[run[0]]:g}"
                data["gpu_kinds"].setdefault(name, {**base, "slowdown": factors[run[0]]})
                nodes.append({"kind": name, "count": 1, "gpus_per_node": r - run[0]})
                run = [r]
    data["nodes"] = nodes


def _host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not POSIX: assume 16 GB
        return 16e9
