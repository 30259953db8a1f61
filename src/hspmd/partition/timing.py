"""Measured speedups of a placement: one process against the placed run on gloo ranks.

* :func:`measured_graph`: the fx op graph of :func:`hspmd.partition.execute.op_graph`
  with *measured* node times: every node's forward is timed in ``repeats`` runs of an
  interpreter (median), then all times are scaled so that they add up to the measured
  forward + backward step of the plain module (backward is not a node of the graph);
* :func:`time_plan`: the step (forward, backward) of each rank under a plan, timed
  ``steps`` times after a barrier, and a ping-pong between ranks 0 and 1 that fits the
  gloo link's latency and bandwidth (fastest round trips); a step takes as long as its slowest rank;
* :func:`time_single`: the plain module's step in this process, one thread.

The emulator's prediction for a placement is then ``emulate(graph, single) /
emulate(graph, placed)`` with the measured node times and the fitted link.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from hspmd.errors import PartitionError
from hspmd.partition.emulate import CommModel
from hspmd.partition.execute import (
    LossFn,
    RunSpec,
    WithLoss,
    forward_backward,
    op_graph,
    trace,
)
from hspmd.partition.graph import OpGraph
from hspmd.runtime.launch import launch
from hspmd.runtime.world import World


class BranchNet(nn.Module):
    """An inception-style block: ``branches`` parallel MLP towers, summed, then a head.

    ``x -> [tower_0 .. tower_{b-1}] -> sum -> head``; each tower is ``depth`` Linear +
    ReLU layers of ``width``: towers are independent work a placement can overlap.
    """

    def __init__(self, width: int = 256, branches: int = 4, depth: int = 3, classes: int = 8):
        super().__init__()
        self.towers = nn.ModuleList(
            nn.Sequential(*(m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())))
            for _ in range(branches)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = self.towers[0](x)
        for tower in self.towers[1:]:
            total = total + tower(x)
        return self.head(total)


def branch_net() -> nn.Module:
    """A picklable factory of the default :class:`BranchNet`."""
    return BranchNet()


def time_single(
    make_model: Any, loss_fn: LossFn, batch: tuple[torch.Tensor, torch.Tensor], *, steps: int
) -> list[float]:
    """Seconds of each forward + backward of the plain module in this process."""
    torch.manual_seed(0)
    model = WithLoss(make_model(), loss_fn)
    out = []
    for _ in range(steps + 1):  # the first is a warm-up
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(*batch).backward()
        out.append(time.perf_counter() - start)
    return out[1:]


def measured_graph(
    make_model: Any,
    loss_fn: LossFn,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    repeats: int = 5,
    step_seconds: float,
) -> tuple[fx.GraphModule, OpGraph]:
    """The traced module and its op graph with measured node times (module docstring)."""
    if repeats < 1:
        raise PartitionError(f"{repeats=} must be >= 1")
    torch.manual_seed(0)
    traced = trace(make_model(), loss_fn)
    graph = op_graph(traced, batch)
    samples: dict[str, list[float]] = {}

    class Timed(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            start = time.perf_counter()
            out = super().run_node(n)
            samples.setdefault(n.name, []).append((time.perf_counter() - start) * 1e6)
            return out

    with torch.no_grad():
        for _ in range(repeats + 1):
            Timed(traced).run(*batch)
    forward = np.array(
        [
            float(np.median(samples[n][1:])) if n in samples and graph.time_us[i] > 0 else 0.0
            for i, n in enumerate(graph.names)
        ]
    )
    scale = step_seconds * 1e6 / max(float(forward.sum()), 1e-9)
    measured = OpGraph.build(
        graph.name,
        graph.names,
        time_us=np.round(forward * scale, 3),
        out_bytes=graph.out_bytes,
        residual_bytes=graph.residual_bytes,
        edges=np.stack((graph.src, graph.dst), axis=1),
        colocate=graph.colocate,
        meta={
            "times": "measured",
            "repeats": repeats,
            "statistic": "median",
            "scaled_to_step_us": round(step_seconds * 1e6, 1),
        },
    )
    return traced, measured


@dataclass(frozen=True, slots=True)
class PlanTimes:
    """Per step, the slowest rank's seconds; and the link fitted by ping-pong."""

    step_seconds: tuple[float, ...]
    link: CommModel


def time_plan(spec: RunSpec, *, steps: int, timeout_s: float = 300.0) -> PlanTimes:
    """Run ``spec.plan`` ``steps`` times on local gloo ranks (one thread each)."""
    results = launch(
        _timed_entry, spec.plan.num_ranks, args=(spec, steps), timeout_s=timeout_s, threads=1
    )
    per_rank = np.asarray([r[0] for r in results])  # [ranks, steps]
    return PlanTimes(tuple(per_rank.max(axis=0).tolist()), results[0][1])


def _timed_entry(world: World, spec: RunSpec, steps: int) -> tuple[list[float], CommModel]:
    rank = world.rank
    link = _ping_pong(rank) if spec.plan.num_ranks > 1 else CommModel()
    torch.manual_seed(spec.seed)
    traced = trace(spec.make_model(), spec.loss_fn)
    out = []
    for _ in range(steps + 1):  # the first is a warm-up
        for p in traced.parameters():
            p.grad = None
        dist.barrier()
        start = time.perf_counter()
        forward_backward(rank, spec, traced)
        out.append(time.perf_counter() - start)
    return out[1:], link


def _ping_pong(rank: int, *, repeats: int = 9) -> CommModel:
    """Latency and bandwidth of the 0 <-> 1 link: round trips of 4 B and 4 MiB, halved,
    the fastest of ``repeats`` (on a shared machine the others measure the load)."""
    times = {}
    for numel in (1, 1 << 20):
        buf = torch.zeros(numel)
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            samples.append((time.perf_counter() - start) / 2 * 1e6)
        times[numel] = float(np.min(samples))
    latency = times[1]
    per_byte = max(times[1 << 20] - latency, 1e-3) / (4 << 20)
    return CommModel(latency_us=latency, bytes_per_us=1.0 / per_byte)
