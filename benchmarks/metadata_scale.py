"""Metadata at scale: explain, simulate, plan, switch-cost and one rank's executable, by rank count.

llama-70b (80 layers), sequence 4096, on H20 nodes of 8 (``h20x32``'s kind, as many nodes as
the run needs). For each size, a strategy of P pipelines of S stages of TP T, and a switch
target with twice the pipelines and half the stages (the same ranks):

    ranks    strategy            switch target
    48       3 x 4 stages x TP4  6 x 2 stages x TP4
    512      8 x 8 stages x TP8  16 x 4 stages x TP8
    4096     64 x 8 stages x TP8 128 x 4 stages x TP8
    65536    1024 x 8 stages x TP8 2048 x 4 stages x TP8

Each command runs in a process of its own, so ``peak_MB`` (the process's maximum RSS,
``os.wait4``'s rusage; torch's import is in it) is that command's alone:

- ``explain``: ``hspmd explain --model llama-70b --strategy @S --rank 0 --seq-len 4096 --json``
  (the per-rank graph, communication and schedule summary of rank 0; every strategy is
  passed as ``@FILE``, as 65,536 ranks written out exceed one command-line argument);
- ``simulate``: ``hspmd simulate ... --strategy S --json``, one simulated step of every rank;
- ``plan``: ``hspmd plan ... --global-batch 1024 --json`` on the size's cluster (the
  heterogeneous search and the homogeneous baseline; 16384 at 65,536 ranks);
- ``switch``: ``hspmd switch-cost --from S --to TARGET --algo fused --json`` (fp32 masters and
  Adam states);
- ``replan`` (only when named in ``--commands``): the elastic re-plan ``hspmd plan ...
  --alive 0-(N-9) --current @P --json`` with ``P = N/8*(1xM: R0-7:L0-79)`` (one TP-8 replica
  per node, the global batch's micro-batches) and the last node gone;
- ``executable``: ``build_executable`` of rank 0 on the meta device (nothing allocated;
  capture, deduction and the per-rank graph, as a worker builds it before binding a world),
  in a fresh process after a warm-up build of a 2-layer llama-tiny: the warm-up pays the
  imports torch makes at its first meta-device calls (``torch._dynamo``, sympy: several
  seconds), which every worker pays once whatever it builds; it is reported apart
  (``warmup_s``), not in ``executable_s``.

Per command: ``*_s`` is the command's own time in its process (``hspmd.cli.main`` from
parsing its arguments to printing), ``import_s`` the imports before it (``hspmd.cli`` and
its subcommands, torch included), ``wall_s`` the whole process from the parent's side
(interpreter start, imports, the command, exit): what a user waits for.

Goals (issue 12): each command under 30 s at 4096 ranks, one rank's executable under 2 s,
peak memory under 4 GiB; issue 39: each under 60 s and 4 GiB at 65,536 ranks. Run:
``python benchmarks/metadata_scale.py [--sizes 48 512 4096 65536]`` (the default leaves
65,536 out: minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES = {48: (3, 4, 4), 512: (8, 8, 8), 4096: (64, 8, 8), 65536: (1024, 8, 8)}
DEFAULT_SIZES = (48, 512, 4096)
MODEL = "llama-70b"
SEQ_LEN = 4096
GLOBAL_BATCH = {48: 1024, 512: 1024, 4096: 1024, 65536: 16384}
COMMANDS = ("explain", "simulate", "plan", "switch", "executable")
EXTRA = ("replan",)  # measured when named: minutes at 65,536 ranks


def strategy_text(pipelines: int, stages: int, tp: int, layers: int) -> str:
    """``pipelines`` pipelines of ``stages`` even stages of ``tp`` ranks, 4 micro-batches of 1."""
    per = layers // stages
    out, rank = [], 0
    for _ in range(pipelines):
        parts = []
        for s in range(stages):
            last = layers - 1 if s == stages - 1 else (s + 1) * per - 1
            parts.append(f"R{rank}-{rank + tp - 1}:L{s * per}-{last}")
            rank += tp
        out.append("4x1: " + " ".join(parts))
    return "; ".join(out)


def cluster_json(num_ranks: int) -> dict[str, Any]:
    return {
        "format": "hspmd.cluster/1",
        "name": f"h20x{num_ranks}",
        "description": f"{num_ranks} H20 in nodes of 8 (benchmark)",
        "gpu_kinds": {
            "H20": {
                "memory_mb": 97871,
                "bf16_tflops": 148,
                "achieved_tflops": 74,
                "hbm_GBps": 4000,
                "intra_link": {"name": "nvlink", "GBps": 900},
            }  # fmt: skip
        },
        "inter_link": {"name": "ib", "GBps": 50},
        "nodes": [{"kind": "H20", "count": num_ranks // 8, "gpus_per_node": 8}],
    }


def strategy_files(num_ranks: int, cluster: str) -> tuple[str, str]:
    """The strategy and the switch target at ``num_ranks``, as files beside ``cluster``."""
    from hspmd.models.config import get_config

    layers = get_config(MODEL).num_layers
    p, s, t = SIZES[num_ranks]
    paths = []
    for name, text in (("from", strategy_text(p, s, t, layers)),
                       ("to", strategy_text(2 * p, s // 2, t, layers))):  # fmt: skip
        path = Path(cluster).with_name(f"{name}{num_ranks}.txt")
        path.write_text(text)
        paths.append(str(path))
    return paths[0], paths[1]


def cli_args(command: str, num_ranks: int, cluster: str) -> list[str]:
    """The ``hspmd`` command line of ``command`` at ``num_ranks`` (cluster: a file; the
    strategies: files beside it)."""
    source, target = strategy_files(num_ranks, cluster)
    text = f"@{source}"
    common = ["--model", MODEL, "--seq-len", str(SEQ_LEN)]
    if command == "explain":
        return ["explain", *common, "--strategy", text, "--rank", "0", "--dtype", "bf16", "--json"]
    if command == "simulate":
        return ["simulate", *common, "--cluster", cluster, "--strategy", text, "--json"]
    if command in ("plan", "replan"):
        batch = ["--global-batch", str(GLOBAL_BATCH[num_ranks])]
        return ["plan", *common, "--cluster", cluster, *batch, "--json", *elastic_args(
            command, num_ranks, cluster)]  # fmt: skip
    return ["switch-cost", "--model", MODEL, "--from", text, "--to", f"@{target}", "--cluster",
            cluster, "--algo", "fused", "--json"]  # fmt: skip


def elastic_args(command: str, num_ranks: int, cluster: str) -> list[str]:
    """``replan``: the elastic re-plan after the last node's 8 ranks are gone, from one TP-8
    replica of every layer per node (``N*(1x2: R0-7:L0-79)``, as file beside ``cluster``)."""
    if command != "replan":
        return []
    from hspmd.models.config import get_config

    layers = get_config(MODEL).num_layers
    path = Path(cluster).with_name(f"current{num_ranks}.txt")
    path.write_text(f"{num_ranks // 8}*(1x{GLOBAL_BATCH[num_ranks] * 8 // num_ranks}: "
                    f"R0-7:L0-{layers - 1})")  # fmt: skip
    return ["--alive", f"0-{num_ranks - 9}", "--current", f"@{path}"]


def measure(num_ranks: int, command: str, cluster: str) -> dict[str, Any]:
    """One command at one size, in this (fresh) process."""
    start = time.perf_counter()
    import torch

    torch.set_num_threads(1)
    from hspmd.cli import build_parser, main

    build_parser()  # imports every subcommand's module
    row: dict[str, Any] = {"import_s": time.perf_counter() - start}
    if command == "executable":
        from hspmd.models.config import get_config
        from hspmd.plan.strategy import StrategyOptions, parse_strategy
        from hspmd.specialize.executable import build_executable

        start = time.perf_counter()
        with torch.device("meta"):  # torch's lazy imports, not this model's work
            tiny = get_config("llama-tiny", num_layers=2)
            warm = parse_strategy("1x1: R0-1:L0 R2-3:L1")
            build_executable(tiny, warm, StrategyOptions(), 0, seq_len=16, seed=0)
        row["warmup_s"] = time.perf_counter() - start
        config = get_config(MODEL)
        p, s, t = SIZES[num_ranks]
        strategy = parse_strategy(strategy_text(p, s, t, config.num_layers))
        start, cpu = time.perf_counter(), time.process_time()
        with torch.device("meta"):
            # fp32: the executable builder takes bf16 through TrainConfig's dtype, not here
            exe = build_executable(config, strategy, StrategyOptions(), 0, seq_len=SEQ_LEN, seed=0)
        row["executable_s"] = time.perf_counter() - start
        row["executable_cpu_s"] = time.process_time() - cpu
        row["executable_nodes"] = len(exe.graph_module.graph.nodes)
        return row
    out = io.StringIO()
    start, cpu = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(out):
        status = main(cli_args(command, num_ranks, cluster))
    row[f"{command}_s"] = time.perf_counter() - start
    row[f"{command}_cpu_s"] = time.process_time() - cpu
    if status not in (0, 1):  # simulate: 1 when a stage does not fit
        raise SystemExit(f"hspmd {command} at {num_ranks} ranks failed ({status})")
    data = json.loads(out.getvalue())
    if command == "simulate":
        row["predicted_step_s"] = data["step_time_s"]
    elif command == "plan":
        row["plan_step_s"] = data["step_time_s"]
    elif command == "replan":
        row["replan_step_s"], row["replan_strategy"] = data["step_time_s"], data["strategy"]
        row["replan_moved_bytes"] = data["moved_bytes"]
    elif command == "switch":
        row["switch_predicted_s"] = data["seconds"]
        row["switch_messages"] = data["messages"]
    elif command == "explain":
        row["explain_ranks"] = len(data["ranks"])
    return row


def run_child(num_ranks: int, command: str, cluster: str) -> dict[str, Any]:
    """``measure`` in a fresh interpreter; its wall time and peak RSS from ``os.wait4``."""
    argv = [sys.executable, __file__, "--one", str(num_ranks), command, cluster]
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.PIPE, text=True)
        assert child.stderr is not None
        err = child.stderr.read()
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        if child.returncode != 0:
            raise SystemExit(f"{command} at {num_ranks} ranks failed:\n{err}")
        out.seek(0)
        row = json.loads(out.read().strip().splitlines()[-1])
    row[f"{command}_wall_s"] = wall
    row[f"{command}_peak_MB"] = usage.ru_maxrss / 1024  # KiB on Linux
    row[f"{command}_import_s"] = row.pop("import_s")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), choices=sorted(SIZES)
    )
    parser.add_argument(
        "--commands", nargs="+", default=list(COMMANDS), choices=COMMANDS + EXTRA,
        help="commands to measure (default: all but replan)",
    )  # fmt: skip
    parser.add_argument("--one", nargs=3, default=None, help=argparse.SUPPRESS)  # child
    args = parser.parse_args()
    if args.one is not None:
        size, command, cluster = args.one
        print(json.dumps(measure(int(size), command, cluster)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            p, s, t = SIZES[size]
            cluster = Path(tmp) / f"h20x{size}.json"
            cluster.write_text(json.dumps(cluster_json(size)))
            row: dict[str, Any] = {"ranks": size, "strategy": f"{p} x {s} stages x TP{t}"}
            for command in args.commands:
                row.update(run_child(size, command, str(cluster)))
            rows.append(row)
    print(f"llama-70b, seq {SEQ_LEN}; per command: its time in its process (imports before "
          "it apart), its CPU time / the whole process (wall) / peak RSS")  # fmt: skip
    print(f"{'ranks':>6} {'strategy':>20} " + " ".join(f"{c:>34}" for c in args.commands))
    for row in rows:
        cells = []
        for c in args.commands:
            cells.append(
                f"{row[c + '_s']:.2f} ({row[c + '_cpu_s']:.2f} cpu) / {row[c + '_wall_s']:.1f} s"
                f" / {row[c + '_peak_MB']:.0f} MB"
            )
        print(f"{row['ranks']:>6} {row['strategy']:>20} " + " ".join(f"{x:>34}" for x in cells))
    if "executable" in args.commands:
        warm = ", ".join(f"{r['ranks']}: {r['warmup_s']:.2f} s" for r in rows)
        print(
            f"executable: warm-up build of llama-tiny first (torch's lazy imports), apart: {warm}"
        )
    largest = rows[-1]
    summary: dict[str, Any] = {
        "benchmark": "metadata_scale",
        "model": MODEL,
        "rows": rows,
        "largest_ranks": largest["ranks"],
        "largest_slowest_command_s": max(largest[c + "_s"] for c in args.commands),
        "largest_slowest_wall_s": max(largest[c + "_wall_s"] for c in args.commands),
        "largest_peak_MB": max(largest[c + "_peak_MB"] for c in args.commands),
        "goal_command_s": 60.0 if largest["ranks"] > 4096 else 30.0,  # issue 39 / issue 12
        "goal_executable_s": 2.0,
        "goal_peak_MB": 4096.0,
    }
    if "executable" in args.commands:
        summary["largest_executable_s"] = largest["executable_s"]
    if len(rows) > 1:
        summary["ratio_largest_to_smallest"] = {
            c: largest[c + "_s"] / rows[0][c + "_s"] for c in args.commands
        }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
