"""count_comm records exactly what the executors issue."""

from __future__ import annotations

import pytest
import torch

from hspmd.comm.simulate import scatter
from hspmd.runtime import World, count_comm, launch, run_plan

from .rt_plans import bottom_plans, top_plans

NAMES = ("all-gather-1", "reduce-scatter-0", "all-to-all", "bsr-dim-change", "split-all-reduce")


def counted(world: World) -> list[tuple[dict[str, int], int]]:
    plans = {**bottom_plans(4), **top_plans(4)}
    world.prepare(plans[name] for name in NAMES)
    out = []
    for name in NAMES:
        plan = plans[name]
        value = torch.ones(plan.shape, dtype=torch.float64).numpy()
        local = torch.from_numpy(scatter(plan.src, value)[world.rank]).float()
        with count_comm(world) as log:
            run_plan(plan, local, world)
        out.append((log.counts(), log.nbytes()))
    plan = plans["all-reduce"]
    local = torch.ones(plan.shape)
    donated = run_plan(plan, local, world, donate=True)
    kept = run_plan(plan, local, world)
    assert donated is local and kept is not local, "donate=True reduces in place, else a copy"
    assert float(local[0, 0]) == 4.0 and float(kept[0, 0]) == 16.0
    return out


@pytest.mark.multiproc
def test_exact_communication_of_each_reshard() -> None:
    per_rank = launch(counted, 4, timeout_s=60)
    piece = 8 * 24 * 4 // 4  # bytes of one quarter of an 8 x 24 float32 tensor
    want = {
        "all-gather-1": ({"all_gather": 1}, piece),
        "reduce-scatter-0": ({"reduce_scatter": 1}, 4 * piece),
        "all-to-all": ({"all_to_all": 1}, piece),
        # every rank sends a quarter of its piece to each of the three others, and receives
        "bsr-dim-change": ({"batch": 1, "send": 3, "recv": 3}, 2 * 3 * piece // 4),
        # two subgroups of two: one all-reduce of a half between the two copies of each half
        "split-all-reduce": ({"all_reduce": 1}, 2 * piece),
    }
    for rank, results in enumerate(per_rank):
        for name, got in zip(NAMES, results, strict=True):
            assert got == want[name], f"{name} on rank {rank}"


def test_the_log_reads_back() -> None:
    import datetime

    world = World(0, 2, torch.device("cpu"), "gloo", datetime.timedelta(seconds=1))
    with count_comm(world) as outer:
        world.record("send", group=(0, 1), nbytes=8)
        with count_comm(world) as inner:
            world.record("recv", group=(1, 0), nbytes=4)
    world.record("send", group=(0, 1), nbytes=100)
    assert outer.counts() == {"send": 1, "recv": 1} and outer.nbytes() == 12
    assert inner.counts() == {"recv": 1} and inner.nbytes("recv") == 4
    assert str(inner) == "recv group=[1, 0] bytes=4"
