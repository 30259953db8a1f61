"""Reshard as an autograd Function: values and gradients equal the simulator's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hspmd.comm.plan import AllGather, CommPlan, Local, ReduceScatter, SendRecv
from hspmd.comm.simulate import scatter, simulate
from hspmd.errors import ResolutionError
from hspmd.runtime import World, launch
from hspmd.runtime.autograd import check_pair, reshard

from .rt_plans import A, bottom_plans, bsr, top_plans

Case = tuple[str, CommPlan, CommPlan]


def cases(n: int) -> list[Case]:
    g, group, shape = "[" + ",".join(map(str, range(n))) + "]", (tuple(range(n)),), (8, 24)
    plans = {**bottom_plans(n), **top_plans(n)}
    out = [
        (
            "all-gather",
            plans["all-gather-0"],
            CommPlan(A(f"{g}{{P:{n}}}"), A(f"{g}{{0:{n}}}"), shape, (ReduceScatter(group, dim=0),)),
        ),
        (
            "reduce-scatter",
            plans["reduce-scatter-1"],
            CommPlan(A(f"{g}{{1:{n}}}"), A(f"{g}{{D:{n}}}"), shape, (AllGather(group, dim=1),)),
        ),
        (
            "all-reduce",
            plans["all-reduce"],
            CommPlan(A(f"{g}{{D:{n}}}"), A(f"{g}{{D:{n}}}"), shape, ()),
        ),
        ("bsr", plans["bsr-hetero"], bsr(plans["bsr-hetero"].dst, plans["bsr-hetero"].src, shape)),
    ]
    if "send-recv-half" in plans:
        fwd = plans["send-recv-half"]
        pairs = tuple((d, s) for s, d in fwd.steps[0].pairs)  # type: ignore[attr-defined]
        out.append(("send-recv-half", fwd, CommPlan(fwd.dst, fwd.src, shape, (SendRecv(pairs),))))
    if "split-all-gather-uneven" in plans:
        fwd = plans["split-all-gather-uneven"]
        out.append(("uneven", fwd, CommPlan(fwd.dst, fwd.src, shape, (Local((0, 1)),))))
    return out


def forward_backward(world: World, n: int) -> list[tuple[np.ndarray | None, np.ndarray | None]]:
    plans = cases(n)
    world.prepare([p for _, f, b in plans for p in (f, b)])
    results = []
    for i, (_, fwd, bwd) in enumerate(plans):
        value, grad = _globals(fwd.shape, i)
        x = None
        if world.rank in fwd.src:
            x = torch.from_numpy(scatter(fwd.src, value)[world.rank]).requires_grad_()
        y = reshard(x, fwd, bwd, world, dtype=torch.float64)
        g = torch.zeros(0, dtype=torch.float64)
        if world.rank in bwd.src:
            g = torch.from_numpy(scatter(bwd.src, grad, rng=np.random.default_rng(i))[world.rank])
        (y * g).sum().backward()
        results.append(
            (
                y.detach().numpy() if world.rank in fwd.dst else None,
                x.grad.numpy() if x is not None and x.grad is not None else None,
            )
        )
    return results


def _globals(shape: tuple[int, ...], i: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + i)
    return rng.standard_normal(shape), rng.standard_normal(shape)


@pytest.mark.multiproc
@pytest.mark.parametrize("nproc", [2, 4])
def test_values_and_gradients_match_the_simulator(nproc: int) -> None:
    per_rank = launch(forward_backward, nproc, args=(nproc,), timeout_s=120)
    for i, (name, fwd, bwd) in enumerate(cases(nproc)):
        value, grad = _globals(fwd.shape, i)
        want_y = simulate(fwd, scatter(fwd.src, value))
        want_dx = simulate(bwd, scatter(bwd.src, grad, rng=np.random.default_rng(i)))
        for rank in range(nproc):
            y, dx = per_rank[rank][i]
            if rank in fwd.dst:
                np.testing.assert_allclose(y, want_y[rank], atol=1e-12, err_msg=f"{name} {rank}")
            if rank in fwd.src:
                np.testing.assert_allclose(dx, want_dx[rank], atol=1e-12, err_msg=f"{name} {rank}")
            else:
                assert dx is None, f"{name}: rank {rank} holds no input but got a gradient"


def test_a_backward_that_does_not_mirror_the_forward_is_refused() -> None:
    fwd = bottom_plans(2)["all-gather-0"]
    with pytest.raises(ResolutionError, match="does not mirror"):
        check_pair(fwd, fwd)
