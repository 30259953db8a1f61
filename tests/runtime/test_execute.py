"""Every step kind on 2, 4 and 8 real gloo processes gives what the simulator gives."""

from __future__ import annotations

import numpy as np
import pytest

from hspmd.comm.simulate import scatter, simulate
from hspmd.runtime.plan_runs import PlanRun, run_many

from .rt_plans import runs_for

TOLERANCE = {"float32": 1e-5, "float64": 1e-12, "bfloat16": 0.0, "float16": 0.0}


def expected(run: PlanRun) -> dict[int, np.ndarray]:
    rng = None if run.seed is None else np.random.default_rng(run.seed)
    return simulate(run.plan, scatter(run.plan.src, run.value, rng=rng))


@pytest.mark.multiproc
@pytest.mark.parametrize("nproc", [2, 4, 8])
def test_every_step_kind_matches_the_simulator(nproc: int) -> None:
    cases = runs_for(nproc)
    results = run_many([run for _, run in cases], nproc=nproc, timeout_s=120)
    for (name, run), got in zip(cases, results, strict=True):
        want = expected(run)
        assert sorted(got) == sorted(want), name
        tol = TOLERANCE[run.dtype]
        for rank, value in want.items():
            np.testing.assert_allclose(
                got[rank], value, rtol=tol, atol=tol, err_msg=f"{name} rank {rank}"
            )
