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
    # and its gather back, in both dims
    back = resolve(A("h0: [2,3]{1:2} [0,1]{1:2}"), A("hD: [2,3]{1:2} [0,1]{1:2}"), shape)
    cols = resolve(A("h1: [0,1]{0:2} [2,3]{0:2}"), A("hD: [0,1]{0:2} [2,3]{0:2}"), shape)
    names = ["reduce-scatter-0", "reduce-scatter-1", "reduce-scatter-unsorted",
             "split-reduce-scatter", "split-all-gather", "all-reduce", "all-gather-1"]  # fmt: skip
    return [named[name] for name in names] + [tp, named["reduce-scatter-0"], back, cols]


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
    # gathers fill the given tensors in place (ZeRO-3's parameter storage)
    outs = {i: torch.full(p.dst.piece(world.rank, p.shape).shape, -1.0)
            for i, p in enumerate(plans) if p.steps[0].kind.endswith("all-gather")
            and world.rank in p.dst}  # fmt: skip
    got = start_plans(plans, _locals(world, plans), world, tag=1, dtype=torch.float32, outs=outs)
    together = got.wait()
    for i, out in outs.items():
        assert together[i] is out, i
    return [None if t is None else t.numpy() for t in alone], {
        i: t.numpy() for i, t in together.items()
    }


@pytest.mark.multiproc
def test_started_together_equal_run_alone_bitwise() -> None:
    for rank, (alone, together) in enumerate(launch(_worker, 4, timeout_s=120)):
        for index, a in enumerate(alone):
            if a is None:
                assert index not in together, (rank, index)
            else:
                assert np.array_equal(a, together[index]), (rank, index)
