"""The planner's two integer programs (PuLP; HiGHS in-process where installed, else CBC).

**Layers per stage** of one pipeline of stages ``s = 0..S-1`` running ``m`` micro-batches
under 1F1B. A stage with ``l_s`` layers takes ``a_s * l_s + c_s`` seconds per micro-batch
(forward plus backward; ``c_s`` holds the embedding, the head and the sends) and needs
``alpha_s * l_s + beta_s`` bytes (``hspmd.planner.memory`` with ``S - s`` micro-batches in
flight)::

    minimize    (m - 1) * T + sum_s (a_s * l_s + c_s)
    subject to  sum_s l_s = L                                  "all_layers"
                a_s * l_s + c_s <= T          for every s      "slowest_stage_s"
                alpha_s * l_s + beta_s <= cap_s  for every s   "memory_s"
                l_s >= 1 integer

The objective is the 1F1B step time of the pipeline: the fill and drain pass every stage
once, the steady state repeats the slowest stage ``m - 1`` times.

**Micro-batches per pipeline**: pipeline ``p`` with slowest stage ``tmax_p`` and stage sum
``tsum_p`` runs ``m_p`` micro-batches of the common size ``b``::

    minimize    Z
    subject to  sum_p m_p * b = B                              "global_batch"
                (m_p - 1) * tmax_p + tsum_p <= Z  for every p  "pipeline_p"
                m_p >= 1 integer
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

from hspmd.errors import HspmdError

if TYPE_CHECKING:
    import pulp

__all__ = ["IlpError", "layers_per_stage", "micro_batches_per_pipeline", "solver"]


class IlpError(HspmdError, ValueError):
    """An integer program with bad inputs (lengths that differ, nothing to solve)."""


def _pulp() -> ModuleType:
    """PuLP, imported when an integer program is solved (not when hspmd is imported: a
    machine without it still trains, simulates and predicts)."""
    try:
        import pulp
    except ImportError:
        raise IlpError(
            "the planner's integer programs need PuLP, which is not installed: "
            "pip install 'pulp>=2.8' (hspmd's dependencies list it)"
        ) from None
    return pulp


@functools.cache
def _highs_ready() -> bool:
    """Whether highspy loads; its first ``Highs()`` prints a banner on file descriptor 1
    whatever the options say, which would corrupt ``--json`` output: it goes to /dev/null."""
    try:
        import highspy
    except ImportError:
        return False
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)
    return True


def solver(time_limit: float | None = None) -> pulp.LpSolver:
    """HiGHS through highspy (in-process, fast) when available, else PuLP's bundled CBC."""
    lp = _pulp()
    if _highs_ready():
        return lp.HiGHS(msg=False, timeLimit=time_limit)
    return lp.PULP_CBC_CMD(msg=False, timeLimit=time_limit)


def layers_per_stage(
    num_layers: int, num_micro_batches: int, a: Sequence[float], c: Sequence[float],
    alpha: Sequence[float], beta: Sequence[float], cap: Sequence[float],
    *, time_limit: float | None = None,
) -> list[int] | None:  # fmt: skip
    """Layers per stage minimizing the pipeline's 1F1B step time; None when nothing fits."""
    count = len(a)
    if not count or any(len(x) != count for x in (c, alpha, beta, cap)):
        raise IlpError(f"layers_per_stage: {count} stages but inputs of different lengths")
    if count > num_layers:
        return None
    lp = _pulp()
    prob = lp.LpProblem("layers_per_stage", lp.LpMinimize)
    layers = [
        prob.add_variable(f"layers_{s}", lowBound=1, upBound=num_layers, cat="Integer")
        for s in range(count)
    ]
    slowest = prob.add_variable("slowest_stage", lowBound=0)
    stage_time = [a[s] * layers[s] + c[s] for s in range(count)]
    prob += (num_micro_batches - 1) * slowest + lp.lpSum(stage_time), "step_time"
    prob += lp.lpSum(layers) == num_layers, "all_layers"
    for s in range(count):
        prob += stage_time[s] <= slowest, f"slowest_stage_{s}"
        if alpha[s] > 0:
            prob += alpha[s] * layers[s] + beta[s] <= cap[s], f"memory_{s}"
        elif beta[s] > cap[s]:
            return None
    status = prob.solve(solver(time_limit))
    if lp.LpStatus[status] != "Optimal":
        return None
    return [round(v.value()) for v in layers]


def micro_batches_per_pipeline(
    global_batch: int, micro_batch_size: int, tmax: Sequence[float], tsum: Sequence[float],
    *, time_limit: float | None = None,
) -> list[int] | None:  # fmt: skip
    """Micro-batch counts minimizing the slowest pipeline; None when the batch cannot split."""
    count = len(tmax)
    if not count or len(tsum) != count:
        raise IlpError(f"micro_batches_per_pipeline: {count} pipelines, {len(tsum)} sums")
    if global_batch % micro_batch_size or global_batch // micro_batch_size < count:
        return None
    total = global_batch // micro_batch_size
    if all(t == tmax[0] for t in tmax) and all(t == tsum[0] for t in tsum):
        base, extra = divmod(total, count)
        return [base + (p < extra) for p in range(count)]
    lp = _pulp()
    prob = lp.LpProblem("micro_batches_per_pipeline", lp.LpMinimize)
    counts = [
        prob.add_variable(f"micro_batches_{p}", lowBound=1, upBound=total, cat="Integer")
        for p in range(count)
    ]
    slowest = prob.add_variable("slowest_pipeline", lowBound=0)
    prob += slowest, "step_time"
    prob += lp.lpSum(counts) == total, "global_batch"
    for p in range(count):
        prob += (counts[p] - 1) * tmax[p] + tsum[p] <= slowest, f"pipeline_{p}"
    status = prob.solve(solver(time_limit))
    if lp.LpStatus[status] != "Optimal":
        return None
    return [round(v.value()) for v in counts]
