"""The cases of benchmarks/network.py, planned without processes (no root needed)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from hspmd.cost.cluster import cluster_from_json
from hspmd.netcluster.describe import Measured, cluster_json
from hspmd.netcluster.spec import NetSpec

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "network.py"


def _bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("network_bench", PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_cases_plan_and_the_heuristic_keeps_the_shrink_on_the_loopback() -> None:
    bench = _bench()
    data = cluster_json(NetSpec(4, 2, 0.4), Measured(1e9, 5e7), memory_mb=1)
    topology = cluster_from_json(data).topology()
    config = bench._config(argparse.Namespace(hidden=64))
    planned = {}
    for case in bench.CASES:
        tensors, tables = bench._tensors(case, config)
        for algo in case.schemes:
            scheme = bench._scheme(algo, tables, topology, case.failed)
            flat = [t for s in scheme.stages() for t in s] if algo == "relay" else scheme
            planned[case.name, algo] = bench._link_bytes(flat, topology)
    c1c2 = {algo: planned["C1 -> C2", algo]["veth"] for algo in bench.SCHEMES}
    assert len(set(c1c2.values())) == 1 and c1c2["fused"] > 0  # every byte crosses nodes
    assert planned["C1 -> C2", "relay"]["loopback"] > 0  # the relay's extra rounds
    assert planned["B TP2 -> TP1", "fused"]["veth"] == 0  # same-node holders chosen
    assert planned["B TP2 -> TP1", "fused-flat"]["veth"] > 0
    one = planned["stage to node 2", "fused"]
    assert one["loopback"] == 0 and planned["stage to node 2", "relay"]["loopback"] > 0
