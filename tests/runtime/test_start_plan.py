"""``start_plan``: plans left in flight together give bitwise what ``run_plan`` gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hspmd.comm.simulate import scatter
from hspmd.runtime.execute import run_plan, start_plan, startable
from hspmd.runtime.launch import launch
from hspmd.runtime.world import World

from .rt_plans import bottom_plans, top_plans

STARTABLE = {
    "all-reduce",
    "reduce-scatter-0",
    "reduce-scatter-1",
    "split-all-reduce",
    "split-reduce-scatter",
}


def test_startable_is_the_async_kinds_after_local_steps() -> None:
    plans = {**bottom_plans(4), **top_plans(4)}
    for name in STARTABLE:
        assert startable(plans[name]), name
    for name in ("all-gather-1", "bsr-hetero", "split-all-gather"):
        assert not startable(plans[name]), name


def _locals(world: World, names: list[str], seed: int) -> list[torch.Tensor | None]:
    plans = {**bottom_plans(world.world_size), **top_plans(world.world_size)}
    rng = np.random.default_rng(seed)
    out = []
    for name in names:
        plan = plans[name]
        pieces = scatter(plan.src, rng.standard_normal(plan.shape), rng=rng)
        out.append(torch.from_numpy(pieces[world.rank]).float() if world.rank in pieces else None)
    return out


def _worker(world: World, names: list[str], donate: bool) -> list[list[np.ndarray | None]]:
    torch.set_num_threads(1)
    plans = {**bottom_plans(world.world_size), **top_plans(world.world_size)}
    chosen = [plans[n] for n in names]
    world.prepare(chosen)
    sync = [
        run_plan(p, x, world, dtype=torch.float32)
        for p, x in zip(chosen, _locals(world, names, 3), strict=True)
    ]
    # every plan in flight at once (non-startable ones block inside start_plan), then wait
    started = [
        start_plan(p, x, world, dtype=torch.float32, donate=donate)
        for p, x in zip(chosen, _locals(world, names, 3), strict=True)
    ]
    late = [s.wait() for s in started]
    return [[None if t is None else t.numpy() for t in ts] for ts in (sync, late)]


@pytest.mark.multiproc
@pytest.mark.parametrize("donate", [False, True])
def test_started_plans_equal_run_plan_bitwise(donate: bool) -> None:
    names = sorted(STARTABLE) + ["all-gather-1", "bsr-hetero"]
    for rank, (sync, late) in enumerate(launch(_worker, 4, args=(names, donate), timeout_s=120)):
        for name, a, b in zip(names, sync, late, strict=True):
            assert (a is None) == (b is None), (rank, name)
            if a is not None:
                assert np.array_equal(a, b), (rank, name)
