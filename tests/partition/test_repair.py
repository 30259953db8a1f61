"""The memory repair: caps met, few and cheap moves, slack-aware costs."""

import numpy as np
import pytest

from hspmd.errors import PartitionError
from hspmd.partition import baselines
from hspmd.partition.emulate import CommModel, buffers, emulate, schedule
from hspmd.partition.graph import OpGraph
from hspmd.partition.pardnn import partition
from hspmd.partition.repair import _kept_until, _Pricer, repair_memory
from hspmd.partition.transformer_graph import TransformerShape, transformer_graph

COMM = CommModel()


def _narrow(layers: int) -> OpGraph:
    return transformer_graph(layers, shape=TransformerShape(heads=1), seed=0)


def _cap(graph: OpGraph, k: int, share: float) -> int:
    single = emulate(graph, baselines.single_device(graph))
    return int(share * int(single.peak_bytes.max()) / k)


def test_repair_meets_caps_from_an_uncapped_placement() -> None:
    graph = _narrow(24)
    k, cap = 4, _cap(_narrow(24), 4, 1.6)
    free = partition(graph, num_devices=k).placement
    assert emulate(graph, free).peak_bytes.max() > cap  # the repair has work to do
    fixed = repair_memory(graph, free, caps=np.full(k, cap), comm=COMM)
    assert emulate(graph, fixed).peak_bytes.max() <= cap
    assert (fixed != free).sum() < graph.num_nodes // 2


def test_capped_close_to_uncapped_on_a_transformer() -> None:
    graph = _narrow(60)  # ~2K ops, mostly a chain: the caps bind on the chain's devices
    k, cap = 4, _cap(graph, 4, 1.6)
    free = partition(graph, num_devices=k)
    capped = partition(graph, num_devices=k, memory_bytes=cap)
    assert capped.emulation.peak_bytes.max() <= cap < free.emulation.peak_bytes.max()
    assert capped.emulation.makespan_us <= 1.03 * free.emulation.makespan_us


def test_nothing_moves_when_caps_hold() -> None:
    graph = _narrow(3)
    place = baselines.round_robin(graph, num_devices=2)
    peak = int(emulate(graph, place).peak_bytes.max())
    assert np.array_equal(repair_memory(graph, place, caps=np.full(2, peak), comm=COMM), place)


def test_impossible_caps_say_what_is_missing() -> None:
    graph = _narrow(3)
    with pytest.raises(PartitionError, match="raise --memory"):
        repair_memory(
            graph, np.zeros(graph.num_nodes, dtype=np.int64), caps=np.full(2, 10**6), comm=COMM
        )


def test_a_buffer_stays_until_the_consumer_before_its_last() -> None:
    # a -> b (early), a -> c (late), all on device 0: moving c frees a's output from b's start
    g = OpGraph.build(
        "fan",
        "abc",
        time_us=[1.0, 1.0, 5.0],
        out_bytes=[100, 8, 8],
        residual_bytes=[0, 0, 0],
        edges=[(0, 1), (0, 2), (1, 2)],
    )
    place = np.zeros(3, dtype=np.int64)
    start, finish = schedule(g, place, comm=COMM)
    buf = buffers(g, place, start=start, finish=finish)
    kept = _kept_until(g, place, buf, start=start, finish=finish, k=1)
    assert buf.last_consumer[0] == 2 and kept[0] == start[1] < buf.free_us[0]
    assert kept[1] == finish[1]  # b's output: no other consumer, held while b runs


def test_a_move_into_slack_is_cheap() -> None:
    # chain a -> b -> c (long) with a side op s (a -> s -> c): s has slack, b has none
    g = OpGraph.build(
        "slack",
        "abcs",
        time_us=[1.0, 500.0, 1.0, 10.0],
        out_bytes=[8] * 4,
        residual_bytes=[0] * 4,
        edges=[(0, 1), (1, 2), (0, 3), (3, 2)],
    )
    place = np.zeros(4, dtype=np.int64)
    pricer = _Pricer(g, place, delay=COMM.cost_us(g.out_bytes))
    side, critical = pricer.cost(3, 1, place), pricer.cost(1, 1, place)
    # the critical op lengthens the step by both transfers; the side op hides them
    assert critical - side >= 2 * COMM.latency_us and side < critical / 5
    table = pricer.table(place, 2)
    assert table[1, 3] == pytest.approx(side) and table[1, 1] == pytest.approx(critical)
