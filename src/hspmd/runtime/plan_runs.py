"""Run comm plans on real local processes from a global numpy value; return every rank's result.

This is what ``hspmd reshard ... --nproc N`` calls, and what the runtime tests use to run many
plans in one launch::

    out = run_plan_processes(plan, nproc=4, value=np.arange(16.0).reshape(4, 4))
    out[0]                                  # rank 0's local tensor under plan.dst

Each worker scatters ``value`` under ``plan.src`` itself (``comm.simulate.scatter``; with
``seed=None`` the first partial summand holds everything), runs the plan, and sends back its
local tensor as float64 numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hspmd.comm.plan import CommPlan
from hspmd.comm.simulate import scatter
from hspmd.errors import HspmdError
from hspmd.runtime.execute import run_plan
from hspmd.runtime.launch import launch
from hspmd.runtime.world import World

_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_DTYPES |= {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True, eq=False)
class PlanRun:
    """One plan to run on a global ``value`` in ``dtype``; ``seed`` splits partial summands.

    ``donate`` hands the scattered local tensor to ``run_plan`` to overwrite.
    """

    plan: CommPlan
    value: np.ndarray
    dtype: str = "float64"
    seed: int | None = None
    donate: bool = False


def run_plan_processes(
    plan: CommPlan,
    *,
    nproc: int,
    value: np.ndarray,
    backend: str = "gloo",
    dtype: str | None = None,
    timeout_s: float = 120.0,
) -> dict[int, np.ndarray]:
    """Every dst rank's local tensor after running ``plan`` on ``nproc`` processes."""
    name = dtype or str(value.dtype)
    return run_many(
        [PlanRun(plan, value, name)], nproc=nproc, backend=backend, timeout_s=timeout_s
    )[0]


def run_many(
    runs: Sequence[PlanRun], *, nproc: int, backend: str = "gloo", timeout_s: float = 120.0
) -> list[dict[int, np.ndarray]]:
    """Run every plan in one launch, one after the other; results per run, per dst rank."""
    for run in runs:
        _check(run, nproc)
    per_rank = launch(_worker, nproc, args=(list(runs),), backend=backend, timeout_s=timeout_s)
    return [
        {r: per_rank[r][i] for r in run.plan.dst.ranks if per_rank[r][i] is not None}
        for i, run in enumerate(runs)
    ]


def _check(run: PlanRun, nproc: int) -> None:
    beyond = [r for r in run.plan.ranks if r >= nproc]
    if beyond:
        raise HspmdError(
            f"plan {run.plan.src} -> {run.plan.dst} names ranks {beyond} but only {nproc} "
            f"processes run: use --nproc {max(run.plan.ranks) + 1} or more"
        )
    if run.dtype not in _DTYPES:
        raise HspmdError(f"dtype {run.dtype!r} is not supported: use one of {sorted(_DTYPES)}")
    if tuple(run.value.shape) != run.plan.shape:
        raise HspmdError(
            f"value of shape {list(run.value.shape)} does not match the plan's shape "
            f"{list(run.plan.shape)}"
        )


def _worker(world: World, runs: list[PlanRun]) -> list[np.ndarray | None]:
    world.prepare([run.plan for run in runs])
    out: list[np.ndarray | None] = []
    for run in runs:
        rng = None if run.seed is None else np.random.default_rng(run.seed)
        local = None
        if world.rank in run.plan.src:
            piece = scatter(run.plan.src, run.value, rng=rng)[world.rank]
            local = torch.from_numpy(piece).to(_DTYPES[run.dtype]).to(world.device)
        result = run_plan(run.plan, local, world, dtype=_DTYPES[run.dtype], donate=run.donate)
        out.append(None if result is None else result.cpu().double().numpy())
    return out
