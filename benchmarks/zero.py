"""ZeRO 0/1/2/3 on 4 local ranks: each rank's peak training-state memory, measured and
predicted, and the step time; ZeRO-3's step time against torch's FSDP2 (``fully_shard``).

The model is a Llama of 4 layers (hidden 256, FFN 768, vocabulary 2048: 4.46 M parameters,
17.8 MB in fp32) trained in fp32 by 4 pipelines of one rank each (data parallelism 4, the
pipelines in lock step: ZeRO-3 gathers per layer), each step 2 micro-batches of 1 sequence
of 128 tokens per rank. One launch trains, per round, every ZeRO stage (3 twice more:
without overlap, ``--zero-no-overlap``, and with uneven shares 3,1,1,1, whose first rank
holds half of every shard) and, in the same processes, the same model, data and batches
under FSDP2 (every block and the root ``fully_shard``-ed, torch's AdamW, a reduce-scatter
in every backward as ZeRO-3 here): FSDP2 last in even rounds, first in odd ones (ABAB),
the stages' order rotating. Each run's first two steps are warm-up. A step's wall time is
its slowest rank's; its CPU time (``time.process_time``: the rank's process, gloo's threads
included; less moved by the other processes of a shared machine) the ranks' mean. Per
round, each run's median step over FSDP2's median step of that round; the table and the
JSON line give the median of these ratios over the rounds and their range, in wall and in
CPU time (``zero3_step_over_fsdp2`` is the wall-time median).

Memory is the state's tracked tensor bytes (``hspmd.train.meter``: parameters as their
storage holds them now, gradients, fp32 masters, Adam moments, gradient shards; not the
communication buffers in flight), the peak over 3 steps of a launch of its own (the
sampling costs time: the timed runs go without it), on rank 1 (rank 0 of the uneven run
holds more). Predicted: ``hspmd.planner.memory`` (weights + gradients + masters and
Adam). The goal of issue 38: ZeRO-3 within 10% of 1/4 of ZeRO-0's plus the largest
gathered layer, the prediction within 10%, ZeRO-3's step time <= 1.0x FSDP2's. With
prefetch (the default) one unit computes while the next one's gather arrives, so two
units are resident at the peak by design (FSDP2's prefetch holds two as well): the goal
line also gives ZeRO-3 over 1/4 of ZeRO-0's plus two layers.

    .venv/bin/python benchmarks/zero.py            # 4 rounds of 6 steps
    .venv/bin/python benchmarks/zero.py --quick    # 1 round of 4 steps
    .venv/bin/python benchmarks/zero.py --runs ZeRO-3 --rounds 6   # ZeRO-3 and FSDP2 only
    .venv/bin/python benchmarks/zero.py --tiny --quick   # toy sizes (the GPU check's dry run)

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from hspmd.plan.strategy import StrategyOptions
from hspmd.planner.memory import largest_unit, rank_memory, stage_places
from hspmd.runtime.launch import launch
from hspmd.runtime.world import World
from hspmd.train.api import revise, train_config
from hspmd.train.batches import step_batches
from hspmd.train.config import AdamConfig, TrainConfig
from hspmd.train.loop import run_rank
from hspmd.train.reference import build_reference_model
from hspmd.train.trainer import train_many

STRATEGY = "; ".join(f"2x1: R{r}:L0-3" for r in range(4))
BASE = train_config(
    model_kwargs=(("num_layers", 4), ("hidden_size", 256), ("intermediate_size", 768),
                     ("num_heads", 4), ("num_kv_heads", 4), ("vocab_size", 2048)),
    strategy=STRATEGY, global_batch=8, seq_len=128, adam=AdamConfig(lr=1e-3),
    data_max_bytes=1 << 20,
)  # fmt: skip
RUNS: dict[str, dict[str, Any]] = {
    "ZeRO-0": dict(zero=0),
    "ZeRO-1": dict(zero=1),
    "ZeRO-2": dict(zero=2),
    "ZeRO-3": dict(zero=3),
    "ZeRO-3 no overlap": dict(zero=3, zero_overlap=False),
    "ZeRO-3 shares 3,1,1,1": dict(zero=3, zero_shares=(3.0, 1.0, 1.0, 1.0)),
}
TINY = (("num_layers", 4), ("hidden_size", 32), ("intermediate_size", 64), ("num_heads", 2),
        ("num_kv_heads", 2), ("vocab_size", 256))  # fmt: skip
RANK = 1  # the rank whose memory is shown (rank 0 of the uneven run holds more)


def predicted(config: TrainConfig, rank: int = RANK) -> float:
    """The memory model's weights + gradients + masters and Adam of ``rank``."""
    model = config.model_config()
    options = StrategyOptions(zero=config.zero, dtype=config.options.dtype)
    strategy = config.require_strategy()
    places = stage_places(
        strategy, model.num_layers, options.schedule, shares=config.options.zero_shares
    )
    for _, _, stage, place in places:
        if rank in stage.ranks:
            m = rank_memory(
                model, rank=rank, tp=stage.tp, num_layers=len(stage.layers), first=place.first,
                last=place.last, in_flight_micro_batches=place.in_flight,
                micro_batch_size=place.micro_batch_size, seq_len=config.batch.seq_len,
                replicas=place.replicas, options=options, lock_step=place.lock_step,
                micro_batches=place.micro_batches, prefetch=config.runtime.zero_overlap,
                share=place.share,
            )  # fmt: skip
            return m.weights + m.gradients + m.optimizer
    raise AssertionError(f"rank {rank} is not in {strategy}")


Times = list[tuple[float, float]]  # per step: wall seconds, CPU seconds of the process


class _StepClock:
    """A ``Spans`` for ``run_rank`` that keeps each step's wall and CPU seconds (the
    process's, its communication threads included; less moved by the other processes of a
    shared machine than wall time) and records nothing else."""

    enabled = False

    def __init__(self) -> None:
        self.times: Times = []

    def span(self, name: str, *, cat: str, **args: Any) -> AbstractContextManager[None]:
        return nullcontext()

    def begin(self, name: str, *, cat: str, **args: Any) -> Callable[[], None]:
        if cat != "step":
            return lambda: None
        wall, cpu = time.perf_counter(), time.process_time()
        return lambda: self.times.append((time.perf_counter() - wall, time.process_time() - cpu))


def _hspmd_rank(world: World, config: TrainConfig) -> Times:
    clock = _StepClock()
    run_rank(world, config, rec=clock)
    return clock.times


def _fsdp_rank(world: World, config: TrainConfig) -> Times:
    """FSDP2 on this rank: its rows of each global batch, 2 micro-batches of 1; the step
    times (between barriers, the loss all-reduced as hspmd's loop does)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hspmd.models.build import step_loss

    torch.manual_seed(config.seed)
    model = build_reference_model(config)
    mesh = init_device_mesh("cpu", (world.world_size,))  # its default takes a GPU where seen
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.adam.lr, weight_decay=0.0)
    spec, rows = config.model_config(), config.batch.global_batch // world.world_size
    times = []
    for tokens, targets in step_batches(config):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.zeros(1, dtype=torch.float64)
        for m in range(rows):
            row = slice(world.rank * rows + m, world.rank * rows + m + 1)
            value = step_loss(spec, model, tokens[row], targets[row]) / rows
            value.backward()
            loss += float(value.detach())
        optimizer.step()
        dist.all_reduce(loss)
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def _rounds_rank(
    world: World, configs: dict[str, TrainConfig], fsdp: TrainConfig, rounds: int
) -> dict[str, list[Times]]:
    """Every run and FSDP2 in turn, ``rounds`` times, in the same processes: the runs'
    order rotates each round, FSDP2 goes last in even rounds and first in odd ones (ABAB);
    this rank's step times by run and round."""
    names = list(configs)
    out: dict[str, list[Times]] = {name: [] for name in [*names, "FSDP2"]}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in [*order, "FSDP2"] if r % 2 == 0 else ["FSDP2", *order]:
            run = _fsdp_rank(world, fsdp) if name == "FSDP2" else _hspmd_rank(world, configs[name])
            out[name].append(run)
    return out


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def timed_rounds(
    base: TrainConfig, names: list[str], rounds: int
) -> tuple[dict[str, list[Times]], dict[str, dict[str, dict[str, float]]]]:
    """One launch of ``_rounds_rank``; per run and round its steps after the first two
    (wall: the slowest rank's, CPU: the ranks' mean), and per run the spread over rounds of
    its median step over FSDP2's in the same round, in wall and in CPU time."""
    configs = {name: revise(base, **RUNS[name]) for name in names}
    per_rank = launch(_rounds_rank, 4, args=(configs, base, rounds), threads=1, timeout_s=3600)
    steps: dict[str, list[Times]] = {}
    for name in [*names, "FSDP2"]:
        steps[name] = [
            [
                (max(w for w, _ in s), statistics.fmean(c for _, c in s))
                for s in zip(*runs, strict=True)
            ][2:]
            for runs in zip(*(rank[name] for rank in per_rank), strict=True)
        ]
    ratios = {}
    for name in names:
        ratios[name] = {
            kind: spread([
                statistics.median(t[i] for t in ours) / statistics.median(t[i] for t in fsdp)
                for ours, fsdp in zip(steps[name], steps["FSDP2"], strict=True)
            ])
            for i, kind in enumerate(("wall", "cpu"))
        }  # fmt: skip
    return steps, ratios


def measure(
    *, steps: int, rounds: int, names: list[str], start: TrainConfig = BASE
) -> dict[str, dict[str, Any]]:
    base = revise(start, steps=steps)
    # memory once, 3 steps (its sampling costs time: the timed runs go without it)
    metered = [revise(base, steps=3, measure_memory=True, **RUNS[n]) for n in names]
    results = train_many(metered, threads=1, timeout_s=1200)
    peaks = {name: result.state_peak for name, result in zip(names, results, strict=True)}
    times, ratios = timed_rounds(base, names, rounds)
    model = base.model_config()
    unit = 4 * largest_unit(model, 1, first=True, last=True)
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        config = revise(base, **RUNS[name])
        out[name] = {
            "state_bytes": peaks[name][RANK],
            "state_bytes_by_rank": peaks[name],
            "predicted_bytes": predicted(config),
            "predicted_bytes_by_rank": {r: predicted(config, r) for r in peaks[name]},
            "step_s": statistics.median(w for run in times[name] for w, _ in run),
            "step_over_fsdp2": ratios[name],
        }
    out["FSDP2"] = {"step_s": statistics.median(w for run in times["FSDP2"] for w, _ in run)}
    out["goal"] = _goals(out, unit)
    return out


def _goals(out: dict[str, dict[str, Any]], unit: float) -> dict[str, Any]:
    goal: dict[str, Any] = {"largest_layer_bytes": unit}
    if "ZeRO-0" in out:
        quarter = out["ZeRO-0"]["state_bytes"] / 4 + unit
        for name, key in (("ZeRO-3", "zero3"), ("ZeRO-3 no overlap", "zero3_no_overlap")):
            if name in out:
                goal[f"{key}_over_quarter_plus_layer"] = out[name]["state_bytes"] / quarter
        if "ZeRO-3" in out:  # with prefetch a unit computes while the next one arrives
            goal["zero3_over_quarter_plus_two_layers"] = out["ZeRO-3"]["state_bytes"] / (
                quarter + unit
            )
    if "ZeRO-3" in out:  # the median over rounds of the per-round ratios, and their spread
        goal["zero3_step_over_fsdp2"] = out["ZeRO-3"]["step_over_fsdp2"]["wall"]["median"]
        goal["zero3_step_over_fsdp2_rounds"] = out["ZeRO-3"]["step_over_fsdp2"]
        if "ZeRO-3 shares 3,1,1,1" in out:
            uneven = out["ZeRO-3 shares 3,1,1,1"]["step_s"]
            goal["uneven_over_even_step"] = uneven / out["ZeRO-3"]["step_s"]
    return goal


def _ranged(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def render(out: dict[str, dict[str, Any]], names: list[str]) -> Table:
    table = Table("run", f"state MiB (rank {RANK})", "predicted MiB", "predicted / measured",
                  "step s", "step / FSDP2's, wall", "CPU")  # fmt: skip
    mib = 2**20
    for name in names:
        m = out[name]
        ratio = m["step_over_fsdp2"]
        table.add_row(name, f"{m['state_bytes'] / mib:.2f}", f"{m['predicted_bytes'] / mib:.2f}",
                      f"{m['predicted_bytes'] / m['state_bytes']:.3f}", f"{m['step_s']:.3f}",
                      _ranged(ratio["wall"]), _ranged(ratio["cpu"]))  # fmt: skip
    if "ZeRO-3 shares 3,1,1,1" in out:
        uneven = out["ZeRO-3 shares 3,1,1,1"]
        got, want = uneven["state_bytes_by_rank"][0], uneven["predicted_bytes_by_rank"][0]
        table.add_row("ZeRO-3 shares 3,1,1,1, rank 0", f"{got / mib:.2f}", f"{want / mib:.2f}",
                      f"{want / got:.3f}", "", "", "")  # fmt: skip
    table.add_row("FSDP2 (fully_shard)", "-", "-", "-", f"{out['FSDP2']['step_s']:.3f}", "1", "1")
    return table


def run_names(text: str) -> list[str]:
    """The names of ``--runs``: comma-separated, a name's own commas kept
    (``ZeRO-0,ZeRO-3 shares 3,1,1,1`` is two runs).

    >>> run_names("ZeRO-0,ZeRO-3 shares 3,1,1,1,ZeRO-3")
    ['ZeRO-0', 'ZeRO-3 shares 3,1,1,1', 'ZeRO-3']
    """
    names: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        joined = f"{names[-1]},{piece}" if names else piece
        if names and names[-1] not in RUNS and any(r.startswith(joined) for r in RUNS):
            names[-1] = joined
        elif piece:
            names.append(piece)
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one round of 4 steps")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated names of RUNS")
    parser.add_argument("--tiny", action="store_true", help="toy sizes: checks the plumbing")
    args = parser.parse_args()
    steps, rounds = (4, 1) if args.quick else (args.steps, args.rounds)
    names = run_names(args.runs)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown runs {unknown}: choose among {', '.join(RUNS)}")
    if steps < 3:
        parser.error(f"--steps {steps}: give at least 3 (the first two are warm-up)")
    start = revise(BASE, model_kwargs=TINY, seq_len=32) if args.tiny else BASE
    out = measure(steps=steps, rounds=rounds, names=names, start=start)
    Console().print(render(out, names))
    mib = 2**20
    print("step / FSDP2's: median [min-max] over rounds of the round's median step ratio; goals: " + ", ".join(
        f"{k} {v / mib:.2f} MiB" if k.endswith("bytes") else f"{k} {v:.3f}"
        for k, v in out["goal"].items() if not isinstance(v, dict)
    ))  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
