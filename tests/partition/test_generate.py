import time

import numpy as np
import pytest

from hspmd.errors import PartitionError
from hspmd.partition.generate import layered_graph


@pytest.mark.parametrize("size", [16, 100, 1000, 5000])
def test_exact_size_dag_and_costs(size: int) -> None:
    graph = layered_graph(size, seed=3)
    assert graph.num_nodes == size
    assert len(graph.topo_order) == size  # acyclic (build checks too)
    assert (graph.time_us >= 0).all() and (graph.out_bytes >= 0).all()
    params = graph.residual_bytes > 0
    assert params.any() and (graph.time_us[params] <= 1.0).all()
    # every update op is colocated with a parameter and reads it
    linked = np.flatnonzero(graph.colocate >= 0)
    assert linked.size == params.sum()
    assert params[graph.colocate[linked]].all()
    edges = set(zip(graph.src.tolist(), graph.dst.tolist(), strict=True))
    assert all((int(graph.colocate[v]), int(v)) in edges for v in linked)


def test_seeded_and_heavy_tailed() -> None:
    a, b, c = layered_graph(2000, seed=1), layered_graph(2000, seed=1), layered_graph(2000, seed=2)
    assert np.array_equal(a.time_us, b.time_us) and np.array_equal(a.src, b.src)
    assert not np.array_equal(a.time_us, c.time_us)
    ops = a.time_us[a.out_bytes > 0]
    assert ops.max() > 10 * np.median(ops)  # a heavy tail
    # fan-out and fan-in both occur
    assert a.out_degree.max() >= 3 and a.in_degree.max() >= 3


def test_large_graph_is_fast() -> None:
    start = time.perf_counter()
    graph = layered_graph(200_000, seed=0)
    assert time.perf_counter() - start < 15.0  # < 1 s on an idle machine: a guard, not a target
    assert graph.num_nodes == 200_000


def test_too_small_is_an_error() -> None:
    with pytest.raises(PartitionError, match="num_nodes=3"):
        layered_graph(3)
