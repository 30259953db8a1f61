import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hspmd.partition import execute as ex
from hspmd.partition.baselines import round_robin, single_device
from hspmd.partition.emulate import emulate


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(self.a(x)))


def test_op_graph_costs_and_colocation() -> None:
    traced = ex.trace(ex.tiny_net(), F.cross_entropy)
    graph = ex.op_graph(traced, _batch())
    index = graph.index
    head = index["model_head"]
    assert graph.residual_bytes[head] == (16 * 4 + 4) * 4 * 3  # weights + Adam states
    assert graph.out_bytes[head] == 8 * 4 * 4
    assert graph.time_us[index["inputs"]] == 0 and graph.time_us[head] > 0
    shared = ex.op_graph(
        ex.trace(Twice(), F.cross_entropy), (torch.randn(3, 4), torch.tensor([0, 1, 1]))
    )
    a0, a1 = shared.index["model_a"], shared.index["model_a_1"]
    assert shared.colocate[a1] == a0 and shared.colocate[a0] == -1


def test_plan_transfers_follow_the_cut_edges() -> None:
    traced = ex.trace(ex.tiny_net(), F.cross_entropy)
    graph = ex.op_graph(traced, _batch())
    place = single_device(graph)
    place[graph.index["model_right_0"]] = 1
    plan = ex.plan_from_placement(traced, graph, place, num_ranks=2)
    assert [str(t) for t in plan.transfers] == ["model_right_0: 1 -> 0 [8, 32] torch.float32"]
    assert plan.rank_of()["inputs"] == -1 and plan.rank_of()["model_right_0"] == 1
    assert plan.makespan_us == emulate(graph, place).makespan_us
    assert "rank 1: model_right_0" in str(plan)


def _check(spec: ex.RunSpec) -> None:
    results = ex.run_plan(spec, timeout_s=120)
    ref = ex.reference(spec)
    losses = [r.loss for r in results if r.loss is not None]
    assert losses == [pytest.approx(ref.loss, rel=1e-6, abs=1e-7)]
    seen = set()
    for r in results:
        for name, grad in r.grads.items():
            np.testing.assert_allclose(grad, ref.grads[name], rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(r.updated[name], ref.updated[name], rtol=1e-5, atol=1e-7)
            seen.add(name)
    assert seen == set(ref.grads)  # every parameter is owned by exactly one rank


@pytest.mark.multiproc
def test_round_robin_on_three_ranks_equals_one_process() -> None:
    batch = _batch()
    traced = ex.trace(ex.tiny_net(), F.cross_entropy)
    graph = ex.op_graph(traced, batch)
    plan = ex.plan_from_placement(traced, graph, round_robin(graph, num_devices=3), num_ranks=3)
    assert len(plan.transfers) >= 8
    _check(ex.RunSpec(ex.tiny_net, F.cross_entropy, batch, plan))


@pytest.mark.multiproc
def test_pardnn_under_a_memory_cap_equals_one_process() -> None:
    batch = _batch()
    traced = ex.trace(ex.tiny_net(), F.cross_entropy)
    graph = ex.op_graph(traced, batch)
    single = int(emulate(graph, single_device(graph)).peak_bytes.max())
    cap = int(0.6 * single)
    plan = ex.make_plan(
        ex.tiny_net(), batch, loss_fn=F.cross_entropy, num_ranks=2, memory_bytes=cap
    )
    assert max(plan.peak_bytes) <= cap
    assert plan.transfers  # the cap forces a split
    _check(ex.RunSpec(ex.tiny_net, F.cross_entropy, batch, plan))
