"""Resolved plans (every Figure 7 category, random pairs) on 2, 4 and 8 gloo processes."""

from __future__ import annotations

import numpy as np
import pytest

from hspmd.comm.resolve import resolve
from hspmd.comm.simulate import scatter, simulate
from hspmd.runtime.plan_runs import PlanRun, run_many

from .rt_plans import figure7_pairs, random_pairs

SHAPE = (12, 24)
RANDOM = {2: 6, 4: 10, 8: 10}


def runs(n: int) -> list[tuple[str, PlanRun]]:
    pairs = figure7_pairs(n) + random_pairs(n, RANDOM[n], SHAPE)
    rng = np.random.default_rng(n)
    out = []
    for i, (name, src, dst) in enumerate(pairs):
        plan = resolve(src, dst, SHAPE)
        out.append((name, PlanRun(plan, rng.standard_normal(SHAPE), "float64", seed=i)))
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("nproc", [2, 4, 8])
def test_resolved_plans_match_the_simulator(nproc: int) -> None:
    cases = runs(nproc)
    results = run_many([run for _, run in cases], nproc=nproc, timeout_s=120)
    for (name, run), got in zip(cases, results, strict=True):
        rng = np.random.default_rng(run.seed)
        want = simulate(run.plan, scatter(run.plan.src, run.value, rng=rng))
        assert sorted(got) == sorted(want), name
        for rank, value in want.items():
            np.testing.assert_allclose(
                got[rank], value, atol=1e-12, err_msg=f"{name} rank {rank}\n{run.plan}"
            )
