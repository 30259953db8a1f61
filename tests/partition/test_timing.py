"""Measured node times and the timed placed run (one tiny gloo run)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hspmd.errors import PartitionError
from hspmd.partition import timing
from hspmd.partition.execute import RunSpec, plan_from_placement, reference, run_plan


def _batch(width: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return torch.randn(8, width, generator=gen), torch.randint(0, 8, (8,), generator=gen)


def _small() -> torch.nn.Module:
    return timing.BranchNet(width=16, branches=2, depth=1)


def test_measured_graph_adds_up_to_the_step() -> None:
    batch = _batch()
    traced, graph = timing.measured_graph(_small, F.cross_entropy, batch, step_seconds=0.01)
    assert graph.meta["times"] == "measured" and graph.meta["repeats"] == 5
    assert graph.time_us.sum() == pytest.approx(1e4, rel=1e-3)
    towers = [i for i, n in enumerate(graph.names) if n.startswith("model_towers")]
    assert towers and (graph.time_us[towers] > 0).all()
    assert graph.time_us[graph.index["inputs"]] == 0
    with pytest.raises(PartitionError, match="repeats=0"):
        timing.measured_graph(_small, F.cross_entropy, batch, step_seconds=0.01, repeats=0)


def test_branch_net_towers_are_independent() -> None:
    traced, graph = timing.measured_graph(_small, F.cross_entropy, _batch(), step_seconds=0.01)
    a, b = graph.index["model_towers_0_0"], graph.index["model_towers_1_0"]
    assert graph.topo_rank[a] < graph.topo_rank[b] or graph.topo_rank[b] < graph.topo_rank[a]
    reach = {a}
    for v in graph.topo_order.tolist():
        if v in reach:
            reach |= set(graph.dst[graph.out_ptr[v] : graph.out_ptr[v + 1]].tolist())
    assert b not in reach  # no path from one tower to the other


@pytest.mark.multiproc
def test_time_plan_times_every_step_and_the_plan_is_exact() -> None:
    batch = _batch()
    traced, graph = timing.measured_graph(_small, F.cross_entropy, batch, step_seconds=0.01)
    place = np.zeros(graph.num_nodes, dtype=np.int64)
    place[[i for i, n in enumerate(graph.names) if n.startswith("model_towers_1")]] = 1
    plan = plan_from_placement(traced, graph, place, num_ranks=2)
    spec = RunSpec(_small, F.cross_entropy, batch, plan)
    timed = timing.time_plan(spec, steps=2, timeout_s=180)
    assert len(timed.step_seconds) == 2 and min(timed.step_seconds) > 0
    assert timed.link.latency_us > 0 and timed.link.bytes_per_us > 0
    # the timed plan is the one the equality tests run: same loss as one process
    results = run_plan(spec, timeout_s=180)
    loss = next(r.loss for r in results if r.loss is not None)
    assert loss == pytest.approx(reference(spec).loss, rel=1e-6)
    assert len(timing.time_single(_small, F.cross_entropy, batch, steps=3)) == 3
