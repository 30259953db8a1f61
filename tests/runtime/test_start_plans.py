"""``start_plans``: a bucket of plans started together gives bitwise what each plan run
alone gives, reduce-scatters packed into one collective per group."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hspmd.annotation import parse_annotation as A
from hspmd.comm.plan import CommPlan
from hspmd.comm.resolve import resolve
from hspmd.comm.simulate import scatter
from hspmd.runtime.batched import start_plans
from hspmd.runtime.execute import run_plan
from hspmd.runtime.launch import launch
from hspmd.runtime.world import World

from .rt_plans import bottom_plans, top_plans


def _plans(n: int) -> list[CommPlan]:
    named = {**bottom_plans(n), **top_plans(n)}
    shape = (8, 12)
    # ZeRO's reduce with TP 2 over two replicas: groups [0,2] and [1,3], in subgroup order
    tp = resolve(A("hP: [2,3]{1:2} [0,1]{1:2}"), A("h0: [2,3]{1:2} [0,1]{1:2}"), shape)
    names = ["reduce-scatter-0", "reduce-scatter-1", "reduce-scatter-unsorted",
             "split-reduce-scatter", "split-all-gather", "all-reduce"]  # fmt: skip
    return [named[name] for name in names] + [tp, named["reduce-scatter-0"]]


def _locals(world: World, plans: list[CommPlan]) -> dict[int, torch.Tensor]:
    rng = np.random.default_rng(5)
    out = {}
    for index, plan in enumerate(plans):
        pieces = scatter(plan.src, rng.standard_normal(plan.shape), rng=rng)
        if world.rank in pieces:
            out[index] = torch.from_numpy(pieces[world.rank]).float()
    return out


def _worker(world: World) -> tuple[list, dict[int, np.ndarray]]:
    torch.set_num_threads(1)
    plans = _plans(world.world_size)
    world.prepare(plans)
    local = _locals(world, plans)
    alone = [run_plan(p, local.get(i), world, dtype=torch.float32) for i, p in enumerate(plans)]
    got = start_plans(plans, _locals(world, plans), world, tag=1, dtype=torch.float32).wait()
    return [None if t is None else t.numpy() for t in alone], {i: t.numpy() for i, t in got.items()}


@pytest.mark.multiproc
def test_started_together_equal_run_alone_bitwise() -> None:
    for rank, (alone, together) in enumerate(launch(_worker, 4, timeout_s=120)):
        for index, a in enumerate(alone):
            if a is None:
                assert index not in together, (rank, index)
            else:
                assert np.array_equal(a, together[index]), (rank, index)
