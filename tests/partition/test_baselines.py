import numpy as np
import pytest

from hspmd.partition import baselines
from hspmd.partition.eft import arrivals as _arrivals
from hspmd.partition.emulate import CommModel, emulate
from hspmd.partition.generate import layered_graph
from hspmd.partition.graph import OpGraph


def _diamond() -> OpGraph:
    #   a -> b -> d, a -> c -> d; b and c are heavy and independent
    return OpGraph.build(
        "diamond",
        ("a", "b", "c", "d"),
        time_us=[1.0, 100.0, 100.0, 1.0],
        out_bytes=[8, 8, 8, 8],
        residual_bytes=[0, 0, 0, 0],
        edges=[(0, 1), (0, 2), (1, 3), (2, 3)],
    )


def test_round_robin_follows_topological_order() -> None:
    graph = _diamond()
    place = baselines.round_robin(graph, num_devices=2)
    assert place[graph.topo_order].tolist() == [0, 1, 0, 1]


def test_heft_runs_independent_work_in_parallel() -> None:
    graph = _diamond()
    place = baselines.heft(graph, num_devices=2)
    assert place[1] != place[2]
    single = emulate(graph, baselines.single_device(graph)).makespan_us
    assert emulate(graph, place).makespan_us < single


@pytest.mark.parametrize("k", [2, 4])
def test_baselines_are_valid_and_honour_colocation(k: int) -> None:
    graph = layered_graph(3000, seed=5)
    linked = np.flatnonzero(graph.colocate >= 0)
    for place in (
        baselines.round_robin(graph, num_devices=k),
        baselines.metis(graph, num_devices=k),
        baselines.heft(graph, num_devices=k),
    ):
        assert place.shape == (graph.num_nodes,) and place.min() >= 0 and place.max() < k
        assert (place[linked] == place[graph.colocate[linked]]).all()
    heft = emulate(graph, baselines.heft(graph, num_devices=k)).makespan_us
    single = emulate(graph, baselines.single_device(graph)).makespan_us
    assert heft < single


def test_metis_cuts_fewer_bytes_than_round_robin() -> None:
    graph = layered_graph(2000, seed=2)
    metis = emulate(graph, baselines.metis(graph, num_devices=4)).comm_bytes
    rr = emulate(graph, baselines.round_robin(graph, num_devices=4)).comm_bytes
    assert metis < rr / 5


def test_upward_rank_of_a_chain() -> None:
    graph = OpGraph.build(
        "chain",
        ("a", "b"),
        time_us=[2.0, 3.0],
        out_bytes=[140000, 0],
        residual_bytes=[0, 0],
        edges=[(0, 1)],
    )
    rank = baselines.upward_rank(graph, comm=CommModel(latency_us=25.0, bytes_per_us=140000.0))
    assert rank.tolist() == [2.0 + 26.0 + 3.0, 3.0]


def test_arrivals_match_brute_force() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        k = int(rng.integers(1, 5))
        num = int(rng.integers(1, 7))
        preds = list(range(num))
        place = rng.integers(0, k, size=num).tolist()
        finish = rng.random(num).tolist()
        delay = rng.random(num).tolist()
        got = _arrivals(
            num, [0] * num + [0, num], preds, place + [0], finish + [0.0], delay + [0.0], k
        )
        want = [
            max([finish[u] if place[u] == d else finish[u] + delay[u] for u in preds] + [0.0])
            for d in range(k)
        ]
        assert np.allclose(got, want)
