"""Switching strategies: in memory (one fused BSR) against a checkpoint save + load, and the
C1 -> C2 switch-cost table of the paper's elastic run for all four algorithms.

Part 1 runs on local processes (gloo, one thread each). The training state of a Llama
(fp32 masters and both Adam moments) moves A -> B and B -> A, each way twice:

- in memory: ``hspmd.train.loop.switch_to`` (one fused BSR, then B's executable graphs);
- checkpoint: ``save_checkpoint`` under the old strategy (safetensors, fsync, atomic rename),
  then B's executable graphs and ``load_checkpoint`` (reshard on load).

Both include building the new strategy's executable graphs (shown alone as "build"). Times
are the slowest rank's, between barriers; the ratio is measured side by side in one run.

Part 1b compares the two switch modes under bf16 compute in one launch: the unstable-devices
mode (``states``: fp32 masters and both moments move) against the mixed-length mode
(``weights``: only the bf16 compute weights move, one fused BSR; or, instead of the move,
B's compute weights gathered from the home shards by B's Pre plan, "rederive"). "move" is
the communication alone; "switch" is ``switch_to`` whole (move + build + load).

Part 2 is ``hspmd.switch.cost`` on the paper's C1 -> C2 (llama-32b, 32 x H20, rank 31
failed; estimates, nothing runs).

    python benchmarks/switch.py                  # llama-small, 4 ranks, ~30 s
    python benchmarks/switch.py --layers 16 --hidden 512   # bigger
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from hspmd.cost.cluster import load_cluster
from hspmd.plan.strategy import Strategy, parse_strategy
from hspmd.runtime.launch import launch
from hspmd.runtime.world import World
from hspmd.switch.cost import ALGOS, switch_cost
from hspmd.switch.live import plan_switch, run_switch
from hspmd.switch.weights import plan_weight_switch, run_weight_switch
from hspmd.train.active import activate
from hspmd.train.api import revise, train_config
from hspmd.train.config import TrainConfig
from hspmd.train.loop import load_checkpoint, prepare_all, save_checkpoint, switch_to

A = "1x4: R0-1:L0-{mid} R2-3:L{mid1}-{last}"  # PP 2 x TP 2
B = "1x4: R0-3:L0-{last}"  # TP 4
C1 = (
    "16x2: R0-3:L0-14 R4-7:L15-29 R8-11:L30-44 R12-15:L45-59; "
    "16x2: R16-19:L0-14 R20-23:L15-29 R24-27:L30-44 R28-31:L45-59"
)
C2 = (
    "33x1: R0-3:L0-14 R4-7:L15-29 R8-11:L30-44 R12-15:L45-59; "
    "31x1: R16-19:L0-15 R20-23:L16-31 R24-27:L32-47 R28-29:L48-55 R30:L56-59"
)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` between barriers; the slowest rank's seconds."""
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return out, float(took)


def _worker(
    world: World, config: TrainConfig, a: Strategy, b: Strategy, repeats: int
) -> list[dict]:
    prepare_all(world, config)
    active = activate(world, config, a)
    rows = []
    folder = tempfile.mkdtemp(prefix="hspmd-switch-bench-") if world.rank == 0 else ""
    names = [folder]
    dist.broadcast_object_list(names, src=0)
    for repeat in range(repeats):
        for source, target in ((a, b), (b, a)):
            move = partial(switch_to, world, config, steps=1)
            (active, _), memory = _timed(partial(move, active, target))
            # back, untimed, then the same move through a checkpoint
            active, _ = move(active, source)
            step = 2 * repeat + (target == a) + 1
            _, save = _timed(
                partial(save_checkpoint, world, config, active, directory=names[0], step=step,
                        steps=1)
            )  # fmt: skip
            active, build = _timed(partial(activate, world, config, target))
            _, load = _timed(partial(load_checkpoint, world, config, active, directory=names[0]))
            rows.append({"move": f"{source} -> {target}", "memory": memory, "save": save,
                         "build": build, "load": load})  # fmt: skip
    return rows


def _modes_worker(
    world: World,
    states: TrainConfig,
    weights: TrainConfig,
    a: Strategy,
    b: Strategy,
    repeats: int,
) -> list[dict]:
    """Switch times of both modes (bf16), A -> B and back, ``repeats`` times each way."""
    model = states.model_config()
    rows = []
    for config in (states, weights):
        prepare_all(world, config)
        active = activate(world, config, a)
        for _ in range(repeats):
            for source, target in ((a, b), (b, a)):
                src, dst = source, target
                if config.switching.mode == "states":
                    plan = plan_switch(model, src, dst)
                    state = active.post.state() if active.post is not None else {}
                    _, move = _timed(partial(run_switch, plan, state, world))
                else:
                    wplan = plan_weight_switch(model, src, dst, itemsize=2)
                    params = active.exe.params if active.exe is not None else {}
                    _, move = _timed(partial(run_weight_switch, wplan, params, world,
                                             dtype=torch.bfloat16))  # fmt: skip
                (active, _), whole = _timed(partial(switch_to, world, config, active, target,
                                                    steps=1))  # fmt: skip
                row = {"mode": config.switching.mode, "move": f"{source} -> {target}",
                       "move_s": move, "switch_s": whole}  # fmt: skip
                if config.switching.mode == "weights":
                    post = active.post
                    # the alternative to the move: B's Pre plan from the home shards
                    _, row["rederive_s"] = _timed(post.refresh if post is not None else list)
                rows.append(row)
    return rows


def measure_modes(*, layers: int, hidden: int, repeats: int) -> list[dict]:
    mid = layers // 2 - 1
    a = A.format(mid=mid, mid1=mid + 1, last=layers - 1)
    b = B.format(last=layers - 1)
    overrides = (("num_layers", layers), ("hidden_size", hidden),
                 ("intermediate_size", 3 * hidden))  # fmt: skip
    states = train_config(model="llama-small", model_kwargs=overrides, seq_len=16,
                         global_batch=4, strategy=a, switches=((2, b),), dtype="bf16")  # fmt: skip
    weights = revise(states, switch_mode="weights")
    results = launch(_modes_worker, 4, args=(states, weights, states.strategy,
                                             parse_strategy(b), repeats), threads=1,
                     timeout_s=600)  # fmt: skip
    return results[0]


def measure(*, layers: int, hidden: int, repeats: int) -> list[dict]:
    mid = layers // 2 - 1
    a = A.format(mid=mid, mid1=mid + 1, last=layers - 1)
    b = B.format(last=layers - 1)
    overrides = (("num_layers", layers), ("hidden_size", hidden),
                 ("intermediate_size", 3 * hidden))  # fmt: skip
    config = train_config(model="llama-small", model_kwargs=overrides, seq_len=16,
                         global_batch=4, strategy=a, switches=((2, b),))  # fmt: skip
    results = launch(_worker, 4, args=(config, config.strategy, parse_strategy(b), repeats),
                     threads=1, timeout_s=600)  # fmt: skip
    return results[0]


def cost_table() -> list[dict]:
    cluster = load_cluster("h20x32")
    rows = []
    for algo in ALGOS:
        cost = switch_cost(model="llama-32b", source=C1, target=C2, cluster=cluster,
                           algo=algo, failed=(31,))  # fmt: skip
        est = cost.estimate
        rows.append({"algo": algo, "messages": cost.num_messages,
                     "nvlink_MB": est.total("nvlink") / 1e6, "ib_MB": est.total("ib") / 1e6,
                     "slowest_rank": cost.slowest_rank, "ms": est.time * 1e3})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    params = args.layers * (4 * args.hidden**2 + 9 * args.hidden**2) + 2 * 256 * args.hidden
    rows = measure(layers=args.layers, hidden=args.hidden, repeats=args.repeats)
    print(f"llama-small x{args.layers} layers, hidden {args.hidden} (~{params / 1e6:.1f}M "
          f"params, {12 * params / 1e6:.0f} MB of fp32 state), 4 local ranks")  # fmt: skip
    print(f"{'move':44} {'memory ms':>10} {'save ms':>9} {'build ms':>9} {'load ms':>9}")
    for r in rows:
        print(f"{r['move']:44} {r['memory'] * 1e3:10.1f} {r['save'] * 1e3:9.1f} "
              f"{r['build'] * 1e3:9.1f} {r['load'] * 1e3:9.1f}")  # fmt: skip
    memory = sum(r["memory"] for r in rows)
    checkpoint = sum(r["save"] + r["build"] + r["load"] for r in rows)
    print(f"checkpoint (save + build + load) / in-memory switch: {checkpoint / memory:.2f}")
    print()
    modes = measure_modes(layers=args.layers, hidden=args.hidden, repeats=args.repeats)
    print(f"switch modes, bf16 compute ({12 * params / 1e6:.0f} MB of fp32 state vs "
          f"{2 * params / 1e6:.0f} MB of bf16 weights)")  # fmt: skip
    print(f"{'mode':8} {'move':44} {'move ms':>8} {'switch ms':>10} {'rederive ms':>12}")
    for r in modes:
        rederive = f"{r['rederive_s'] * 1e3:12.1f}" if "rederive_s" in r else f"{'':12}"
        print(f"{r['mode']:8} {r['move']:44} {r['move_s'] * 1e3:8.1f} "
              f"{r['switch_s'] * 1e3:10.1f} {rederive}")  # fmt: skip

    def total(mode: str, key: str) -> float:
        return sum(r[key] for r in modes if r["mode"] == mode)

    move_ratio = total("weights", "move_s") / total("states", "move_s")
    switch_ratio = total("weights", "switch_s") / total("states", "switch_s")
    rederive_ratio = total("weights", "rederive_s") / total("weights", "move_s")
    print(
        f"weights / states: move {move_ratio:.2f}, whole switch {switch_ratio:.2f}; "
        f"rederive from home / weights move {rederive_ratio:.2f}"
    )
    print()
    table = cost_table()
    print("C1 -> C2, llama-32b on h20x32, rank 31 failed (estimates: hspmd.switch.cost)")
    print(f"{'algo':12} {'messages':>8} {'NVLink MB':>10} {'IB MB':>8} {'slowest':>8} {'ms':>8}")
    for r in table:
        print(f"{r['algo']:12} {r['messages']:8} {r['nvlink_MB']:10.0f} {r['ib_MB']:8.0f} "
              f"R{r['slowest_rank']:<7} {r['ms']:8.1f}")  # fmt: skip
    by = {r["algo"]: r["ms"] for r in table}
    print(json.dumps({
        "benchmark": "switch", "layers": args.layers, "hidden": args.hidden,
        "checkpoint_over_memory": round(checkpoint / memory, 3),
        "build_over_memory": round(sum(r["build"] for r in rows) / memory, 3),
        "weights_move_over_states_move": round(move_ratio, 3),
        "weights_switch_over_states_switch": round(switch_ratio, 3),
        "rederive_over_weights_move": round(rederive_ratio, 3),
        "fused_over_naive": round(by["fused"] / by["naive"], 3),
        "relay_over_fused": round(by["relay"] / by["fused"], 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
