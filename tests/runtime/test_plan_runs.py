"""run_plan_processes: what `hspmd reshard --nproc N --dump DIR` runs."""

from __future__ import annotations

import numpy as np
import pytest

from hspmd.comm.simulate import scatter, simulate
from hspmd.errors import HspmdError
from hspmd.runtime.plan_runs import run_plan_processes

from .rt_plans import A, bsr, top_plans


@pytest.mark.multiproc
def test_every_dst_rank_gets_what_the_simulator_gives() -> None:
    plan = top_plans(4)["bsr-hetero"]
    value = np.arange(np.prod(plan.shape), dtype=np.float64).reshape(plan.shape)
    got = run_plan_processes(plan, nproc=4, value=value)
    want = simulate(plan, scatter(plan.src, value))
    assert sorted(got) == sorted(want)
    for rank, tensor in want.items():
        np.testing.assert_array_equal(got[rank], tensor)


def test_ranks_beyond_nproc_are_refused_before_launching() -> None:
    plan = bsr(A("[0,1]{0:2}"), A("[2,3]{1:2}"), (4, 4))
    with pytest.raises(HspmdError, match=r"names ranks \[2, 3\] but only 2 processes run"):
        run_plan_processes(plan, nproc=2, value=np.zeros((4, 4)))


def test_the_value_must_have_the_plan_shape() -> None:
    plan = bsr(A("[0,1]{0:2}"), A("[1,0]{1:2}"), (4, 4))
    with pytest.raises(HspmdError, match=r"value of shape \[4, 5\]"):
        run_plan_processes(plan, nproc=2, value=np.zeros((4, 5)))
