"""The Llama preset's step from its exported graph against its old fx-traced graph.

The preset is captured like every user model (``torch.export``: ``hspmd.graph.export``,
through ``hspmd.models.build.model_graph``); before, it was traced at the Python level by
``torch.fx`` (``hspmd.graph.capture``, still there for hand-written test modules). Both
graphs are specialized the same way (``build_executable``) and run side by side in the
same processes: per rank, both executables are built, then rounds alternate which one
runs first, each timing ``--steps`` forward + backward passes of one micro-batch, in wall
time and in the process's CPU time (``time.process_time``, one torch thread per rank: less
moved by the other processes of a shared machine). A row's figures are rank 0's median
step over the rounds' medians (export / fx below 1: the exported graph is faster), with the
losses of the first step compared (equal to the last bit, or the difference printed).

    one rank   "1xB: R0:L0-.."      no communication
    2-rank TP  "1xB: R0-1:L0-.."    Megatron TP over gloo (2 local processes)
    capture    each path's capture of the model (and of ``--capture-model``, llama-70b by
               default) in this process, CPU seconds, after a 1-layer warm-up capture of
               each that pays the first-call imports

    PYTHONPATH=src .venv/bin/python benchmarks/llama_capture.py           # llama-small
    PYTHONPATH=src .venv/bin/python benchmarks/llama_capture.py --quick   # llama-tiny

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import hspmd.specialize.cut as cut
from hspmd.graph.capture import capture
from hspmd.models.build import model_graph
from hspmd.models.llama import Llama, get_config
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.runtime.executable import bind_executable
from hspmd.runtime.launch import launch
from hspmd.runtime.world import World
from hspmd.specialize.executable import Executable, build_executable, executable_groups

SIDES = ("fx", "export")


def fx_graph(config: Any) -> torch.fx.GraphModule:
    """The Llama traced by torch.fx, as ``model_graph`` gave it before."""
    with torch.device("meta"):
        module = Llama(config)
    return capture(module)


def _build(side: str, args: argparse.Namespace, world: World) -> Executable:
    config = get_config(args.model)
    strategy = parse_strategy(_strategy(args, world.world_size, config.num_layers))
    graph: Callable[[Any], torch.fx.GraphModule] = fx_graph if side == "fx" else model_graph
    cut.model_graph = graph  # type: ignore[assignment]  # the graph deduce_pipeline reads
    try:
        exe = build_executable(
            config, strategy, StrategyOptions(), world.rank, seq_len=args.seq, seed=0
        )
    finally:
        cut.model_graph = model_graph  # type: ignore[assignment]
    return bind_executable(exe, world)


def _strategy(args: argparse.Namespace, ranks: int, layers: int) -> str:
    stage = "R0" if ranks == 1 else f"R0-{ranks - 1}"
    return f"1x{args.batch}: {stage}:L0-{layers - 1}"


def _steps(
    exe: Executable, tokens: torch.Tensor, targets: torch.Tensor, n: int
) -> tuple[float, float]:
    """Median wall and CPU seconds of ``n`` forward + backward passes."""
    wall, cpu = [], []
    for _ in range(n):
        begin, begin_cpu = time.perf_counter(), time.process_time()
        loss = exe.forward(tokens, targets)
        loss.backward()
        wall.append(time.perf_counter() - begin)
        cpu.append(time.process_time() - begin_cpu)
        for p in exe.params.values():
            p.grad = None
    return statistics.median(wall), statistics.median(cpu)


def worker(world: World, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    config = get_config(args.model)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    targets = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    world.prepare_groups(
        executable_groups(parse_strategy(_strategy(args, world.world_size, config.num_layers)))
    )
    exes = {side: _build(side, args, world) for side in SIDES}
    losses = {side: float(exes[side].forward(tokens, targets).detach()) for side in SIDES}
    medians: dict[str, list[tuple[float, float]]] = {side: [] for side in SIDES}
    for r in range(args.rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            medians[side].append(_steps(exes[side], tokens, targets, args.steps))
    return {"losses": losses, "medians": medians}


def measure(args: argparse.Namespace, ranks: int) -> dict[str, Any]:
    results = launch(worker, ranks, args=(args,), timeout_s=1800.0, threads=1)
    first = results[0]
    row: dict[str, Any] = {"ranks": ranks}
    for k, clock in enumerate(("wall", "cpu")):
        fx = [m[k] for m in first["medians"]["fx"]]
        ours = [m[k] for m in first["medians"]["export"]]
        row[f"fx_{clock}_s"] = statistics.median(fx)
        row[f"export_{clock}_s"] = statistics.median(ours)
        row[f"{clock}_ratio"] = row[f"export_{clock}_s"] / row[f"fx_{clock}_s"]
        row[f"{clock}_round_ratios"] = [e / f for e, f in zip(ours, fx, strict=True)]
    row["loss_diff"] = abs(first["losses"]["export"] - first["losses"]["fx"])
    return row


def capture_seconds(name: str) -> dict[str, float]:
    """CPU seconds of each path's capture of preset ``name`` (module docstring)."""
    out = {}
    for side, graph in (("fx", fx_graph), ("export", model_graph)):
        graph(get_config("llama-tiny", num_layers=1))  # first-call imports
        config = get_config(name)
        begin = time.process_time()
        graph(config)
        out[side] = time.process_time() - begin
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="llama-tiny, short sequences")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--capture-model", default="llama-70b", help="a preset to capture")
    args = parser.parse_args()
    args.model = "llama-tiny" if args.quick else "llama-small"
    args.batch, args.seq = (2, 32) if args.quick else (4, 256)
    rows = [measure(args, ranks) for ranks in (1, 2)]
    table = Table(title=f"{args.model}, batch {args.batch} x {args.seq}: forward + backward")
    for column in ("ranks", "clock", "fx s", "export s", "export / fx", "rounds", "loss diff"):
        table.add_column(column)
    for row in rows:
        for clock in ("wall", "cpu"):
            rounds = ", ".join(f"{r:.2f}" for r in row[f"{clock}_round_ratios"])
            table.add_row(
                str(row["ranks"]), clock, f"{row[f'fx_{clock}_s']:.4f}",
                f"{row[f'export_{clock}_s']:.4f}", f"{row[f'{clock}_ratio']:.3f}", rounds,
                f"{row['loss_diff']:.1e}",
            )  # fmt: skip
    Console().print(table)
    captures = {name: capture_seconds(name) for name in (args.model, args.capture_model)}
    for name, seconds in captures.items():
        print(
            f"capture of {name}: fx {seconds['fx']:.2f} s CPU, export {seconds['export']:.2f} s CPU"
        )
    print(json.dumps({
        "benchmark": "llama_capture", "model": args.model, "rows": rows, "capture_cpu_s": captures,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
