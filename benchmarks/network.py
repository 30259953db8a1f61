"""Switch schemes measured on a real two-tier network: nodes as network namespaces.

Needs root and iproute2 (``hspmd netcluster``; docs/netcluster.md). The run builds
``--nodes`` namespaces of ``--ranks-per-node`` ranks, each node's link shaped to
``--inter-gbps``, measures the links, starts one hspmd launcher per node, and removes the
network again whatever happens. Every rank then moves the fp32 masters and both Adam
moments of a Llama between two strategies, as the runtime does (``run_fused_bsr`` and
``run_relay``), and checks every piece it received:

1. C1 -> C2 scaled down (the paper's elastic switch, Table 4): two pipelines of two TP-2
   stages, pipeline A on nodes 0-1, B on nodes 2-3; the last rank fails and B's layers
   re-split over its three survivors. Schemes: naive (lowest-rank owner, one BSR per
   tensor), per-tensor (the heuristic, one BSR per tensor), fused (one BSR), relay (fused,
   single-owner inter-node transfers cut over the ranks of both nodes).
2. The BSR sender heuristic with the cluster's topology against the same heuristic on a
   flat topology (no nodes: owners by load and rank order), on C1 -> C2 and on a TP-2 -> 1
   shrink of pipeline B (where a same-node holder and a remote replica both exist).

3. Cross-pipeline gradient sync of 8 replicas (one per rank, llama-small's gradients as one
   fp32 tensor): the resolved ``{P:8} -> {D:8}`` plan as is, against a hierarchical variant
   of three resolved plans (reduce-scatter inside the node, all-reduce of each half across
   nodes between equal local ranks, all-gather inside the node); sums checked exactly.

Wall time is the slowest rank's, between barriers, the best of ``--repeats``. Bytes per
link class are the planned transfers classified by the cluster's topology; "veth MB"
is measured: the bytes every node's shaped link sent (tc counters, headers included).

Part ``sim`` (the planner's simulator on this network): 2 nodes x 2 ranks, ``hspmd
profile --nproc 4`` of this machine in the cluster file (its compute, its gloo calls and
the core sharing of the 4 ranks, which the namespaces share: ``one_host``), then llama-small
under three strategies (a pipeline with a stage per node, data parallel across nodes, TP 4
across nodes): ``hspmd.planner.predict`` against the median measured step (steps 3-8) of
``hspmd train --nnodes 2``, one launcher per node. Each strategy is priced twice beside the
same measured steps: with the veth as the cluster file gives it (its measured bandwidth,
loopback's fixed cost per call) and with the veth's own lines, timed across the nodes by
``hspmd profile --nnodes 2`` in each namespace.

    sudo .venv/bin/python benchmarks/network.py              # ~2-3 min: tables + JSON line
    sudo .venv/bin/python benchmarks/network.py --inter-gbps 0.2
    sudo .venv/bin/python benchmarks/network.py --part sim   # ~3 min
    sudo .venv/bin/python benchmarks/network.py --ranks-per-node 4   # C1 -> C2 on nodes of 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PORT = 29561
C1 = "2x1: R0-1:L0-3 R2-3:L4-7; 2x1: R4-5:L0-3 R6-7:L4-7"
C2 = "3x1: R0-1:L0-3 R2-3:L4-7; 1x1: R4-5:L0-4 R6:L5-7"  # R7 failed
SHRINK = "2x1: R0-1:L0-3 R2-3:L4-7; 2x1: R4:L0-3 R6:L4-7"  # B from TP 2 to TP 1
ONE_OWNER = "2x1: R0-1:L0-3 R2:L4-7"  # stage 1 on one rank of node 1 ...
SPREAD = "2x1: R0-1:L0-3 R4-5:L4-7"  # ... moves to TP 2 on node 2: one owner per slice
SCHEMES = ("naive", "per-tensor", "fused", "relay", "fused-flat")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    source: str
    target: str
    failed: tuple[int, ...]
    schemes: tuple[str, ...]


# The same switch on nodes of 4 ranks (TP-4 stages, a node each): the failed rank's node
# keeps three survivors, as the paper's 8-GPU node keeps seven, so a relay has NICs to
# spread the lost rank's slices over (``--ranks-per-node 4``: 16 processes).
C1_4 = "2x1: R0-3:L0-3 R4-7:L4-7; 2x1: R8-11:L0-3 R12-15:L4-7"
C2_4 = "3x1: R0-3:L0-3 R4-7:L4-7; 1x1: R8-11:L0-3 R12-13:L4-5 R14:L6-7"  # R15 failed
CASES_4 = (Case("C1 -> C2", C1_4, C2_4, (15,), SCHEMES),)
CASES = (
    Case("C1 -> C2", C1, C2, (7,), SCHEMES),
    Case("B TP2 -> TP1", C1, SHRINK, (), ("fused", "fused-flat")),
    Case("stage to node 2", ONE_OWNER, SPREAD, (), ("fused", "relay")),
)


def _config(args: argparse.Namespace) -> Any:
    from hspmd.models import get_config

    return get_config("llama-small", hidden_size=args.hidden, intermediate_size=3 * args.hidden)


def _tensors(case: Case, config: Any) -> tuple[list[Any], list[Any]]:
    """(FusedTensors, BSR tables): master, exp_avg, exp_avg_sq of every parameter."""
    from hspmd.plan.params import state_annotations
    from hspmd.plan.strategy import parse_strategy
    from hspmd.runtime.fused import FusedTensor
    from hspmd.switch.cost import switch_tables

    before = state_annotations(parse_strategy(case.source), config)
    after = state_annotations(parse_strategy(case.target), config)
    kinds = ("master", "exp_avg", "exp_avg_sq")
    old = {f"{k}/{n}": s for n, s in before.items() for k in kinds}
    new = {f"{k}/{n}": s for n, s in after.items() for k in kinds}
    tables = switch_tables(old, new, itemsize=4, failed=case.failed)
    tensors = [FusedTensor(s.shape, old[n].annotation, s.annotation) for n, s in new.items()]
    return tensors, tables


def _scheme(algo: str, tables: list[Any], topology: Any, failed: Sequence[int]) -> Any:
    """Transfers (one stage) or a RelayPlan, as the runtime takes them."""
    from hspmd.comm.bsr import schedule
    from hspmd.comm.relay import plan_relay
    from hspmd.comm.topology import Topology
    from hspmd.switch.cost import scheme_stages

    if algo == "fused-flat":
        return schedule(tables, topology=Topology.flat())
    if algo == "relay":
        return plan_relay(tables, schedule(tables, topology=topology), topology=topology,
                          exclude=failed)  # fmt: skip
    return scheme_stages(tables, algo, topology=topology)[0]


def _link_bytes(transfers: Sequence[Any], topology: Any) -> Counter[str]:
    out: Counter[str] = Counter()
    for t in transfers:
        if t.src != t.dst:
            n = 4
            for lo, hi in t.region:
                n *= hi - lo
            out[topology.link(t.src, t.dst).name] += n
    return out


def _global(shape: tuple[int, ...], index: int) -> Any:
    import torch

    return (torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32) + index).reshape(
        shape
    )


def _sent_on_link() -> int:
    """Bytes this node's shaped veths (``nc*``) have sent: the htb root of each."""
    out = subprocess.run(["tc", "-s", "qdisc", "show"], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    total, ours = 0, False
    for line in out.splitlines():
        if line.startswith("qdisc"):
            ours = re.search(r"^qdisc htb 1: dev nc\d+ root", line) is not None
        elif ours and (match := re.search(r"Sent (\d+) bytes", line)):
            total += int(match.group(1))
    return total


def _timed(world: Any, ranks_per_node: int, fn: Callable[[], Any]) -> tuple[Any, float, int]:
    """``fn()`` between barriers: (its result, slowest rank's seconds, veth bytes sent)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    counts = world.rank % ranks_per_node == 0  # one rank per node reads its link
    before = _sent_on_link() if counts else 0
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    took = time.perf_counter() - start
    dist.barrier()
    sent = (_sent_on_link() - before) if counts else 0
    stats = torch.tensor([took, float(sent)], dtype=torch.float64)
    dist.all_reduce(stats[1:])
    dist.all_reduce(stats[:1], op=dist.ReduceOp.MAX)
    return out, float(stats[0]), int(stats[1])


def _run(algo: str, scheme: Any, tensors: list[Any], local: dict[int, Any], world: Any) -> Any:
    from hspmd.runtime.fused import run_fused_bsr
    from hspmd.runtime.relay import run_relay

    if algo == "relay":
        return run_relay(scheme, tensors, local, world)
    if algo in ("naive", "per-tensor"):  # one BSR per tensor, tensors one after the other
        out = {}
        for i, t in enumerate(tensors):
            mine = [dataclasses.replace(tr, tensor=0) for tr in scheme if tr.tensor == i]
            pieces = {0: local[i]} if i in local else {}
            moved = run_fused_bsr(mine, [t], pieces, world)
            if 0 in moved:
                out[i] = moved[0]
        return out
    return run_fused_bsr(scheme, tensors, local, world)


def _cases(ranks_per_node: int) -> tuple[Case, ...]:
    if ranks_per_node == 2:
        return CASES
    if ranks_per_node == 4:
        return CASES_4
    raise SystemExit(f"--ranks-per-node {ranks_per_node}: the switch cases exist for 2 and 4")


def _worker(world: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    from hspmd.cost.cluster import load_cluster

    topology = load_cluster(args.cluster).topology()
    config = _config(args)
    rows = []
    for case in _cases(args.ranks_per_node):
        tensors, tables = _tensors(case, config)
        local = {}
        for i, t in enumerate(tensors):
            if world.rank in t.src.ranks:  # a failed rank's pieces are lost: NaN, never sent
                box = t.src.piece(world.rank, t.shape).region
                local[i] = _global(t.shape, i)[tuple(slice(a, b) for a, b in box)].clone()
                if world.rank in case.failed:
                    local[i].fill_(float("nan"))
        for algo in case.schemes:
            scheme = _scheme(algo, tables, topology, case.failed)
            flat = [tr for s in scheme.stages() for tr in s] if algo == "relay" else scheme
            best, sent = float("inf"), 0
            for _ in range(args.repeats):
                run_once = partial(_run, algo, scheme, tensors, local, world)
                out, took, measured = _timed(world, args.ranks_per_node, run_once)
                if took < best:
                    best, sent = took, measured
            for i, value in out.items():  # every received piece is the right slice
                box = tensors[i].dst.piece(world.rank, tensors[i].shape).region
                want = _global(tensors[i].shape, i)[tuple(slice(a, b) for a, b in box)]
                assert bool((value == want).all()), f"{algo}: tensor {i} wrong on {world.rank}"
            links = _link_bytes(flat, topology)
            rows.append({"case": case.name, "scheme": algo, "seconds": best,
                         "planned": dict(links), "veth_sent_bytes": sent})  # fmt: skip
    return rows + _sync_rows(world, args, topology)


def _sync_plans(world: Any, n: int, ranks_per_node: int, topology: Any) -> tuple[Any, list[Any]]:
    """Gradient sync of one replica per rank, ``n`` fp32 elements: the resolved plan
    ``{P:W} -> {D:W}`` as is, and the hierarchical variant as three resolved plans
    (reduce-scatter inside each node, all-reduce of each half across nodes between ranks of
    equal local index, all-gather inside each node), all prepared on every rank."""
    from hspmd.annotation import parse_annotation as A
    from hspmd.comm.resolve import resolve

    every = ",".join(map(str, range(world.world_size)))
    flat = resolve(A(f"[{every}]{{P:{world.world_size}}}"), A(f"[{every}]{{D:{world.world_size}}}"),
                   (n,), topology=topology)  # fmt: skip
    nodes = [list(range(s, s + ranks_per_node)) for s in range(0, world.world_size, ranks_per_node)]
    index = [list(range(k, world.world_size, ranks_per_node)) for k in range(ranks_per_node)]

    def text(ranks: list[int], ds: str) -> Any:
        return A(f"[{','.join(map(str, ranks))}]{{{ds}}}")

    r = ranks_per_node
    steps = [
        [resolve(text(g, f"P:{r}"), text(g, f"0:{r}"), (n,), topology=topology) for g in nodes],
        [resolve(text(g, f"P:{len(g)}"), text(g, f"D:{len(g)}"), (n // r,), topology=topology)
         for g in index],
        [resolve(text(g, f"0:{r}"), text(g, f"D:{r}"), (n,), topology=topology) for g in nodes],
    ]  # fmt: skip
    world.prepare([flat, *(p for step in steps for p in step)])
    me_node, me_index = world.rank // r, world.rank % r
    return flat, [steps[0][me_node], steps[1][me_index], steps[2][me_node]]


def _sync_rows(world: Any, args: argparse.Namespace, topology: Any) -> list[dict[str, Any]]:
    import torch

    from hspmd.runtime.execute import run_plan

    config = _config(args)
    n = sum(int(torch.tensor(s).prod()) for s in _param_shapes(config))
    n -= n % (2 * args.ranks_per_node)
    flat, hier = _sync_plans(world, n, args.ranks_per_node, topology)
    grad = (torch.arange(n, dtype=torch.float32) % 97) + world.rank  # exact sums in fp32

    def hierarchical() -> Any:
        out = grad
        for plan in hier:
            out = run_plan(plan, out, world)
        return out

    rows = []
    results = {}
    for name, fn in (("resolved plan", lambda: run_plan(flat, grad, world)),
                     ("hierarchical", hierarchical)):  # fmt: skip
        best, sent = float("inf"), 0
        for _ in range(args.repeats):
            out, took, measured = _timed(world, args.ranks_per_node, fn)
            if took < best:
                best, sent = took, measured
        results[name] = out
        rows.append({"case": "grad sync", "scheme": name, "seconds": best, "planned": {},
                     "veth_sent_bytes": sent})  # fmt: skip
    want = (torch.arange(n, dtype=torch.float32) % 97) * world.world_size + sum(
        range(world.world_size)
    )
    for name, out in results.items():
        assert bool((out == want).all()), f"{name}: wrong gradient sum on rank {world.rank}"
    return rows


def _param_shapes(config: Any) -> list[tuple[int, ...]]:
    from hspmd.models.config import parameter_shapes

    return list(parameter_shapes(config).values())


def node_main(args: argparse.Namespace) -> int:
    import torch

    from hspmd.runtime.launch import NodeSpec, launch

    torch.set_num_threads(1)
    node = NodeSpec(args.node, args.nodes, args.master, PORT)
    rows = launch(_worker, args.ranks_per_node, args=(args,), node=node, threads=1,
                  timeout_s=900)  # fmt: skip
    if args.node == 0:
        Path(args.rows).write_bytes(pickle.dumps(rows[0]))
    return 0


def _print(rows: list[dict[str, Any]], cluster: dict[str, Any]) -> dict[str, float]:
    measured = cluster["netcluster"]["measured"]
    print(f"{cluster['description']}")
    print(f"measured: loopback {measured['loopback_GBps']:.3f} GB/s, inter-node "
          f"{measured['inter_GBps'] * 1e3:.1f} MB/s ({measured['ratio']:.1f}x slower)")  # fmt: skip
    print(f"{'case':14} {'scheme':13} {'wall ms':>9} {'loopback MB':>12} {'veth MB':>9} "
          f"{'veth MB measured':>17}")  # fmt: skip
    by = {}
    for r in rows:
        p = r["planned"]
        planned = (f"{p.get('loopback', 0) / 1e6:12.2f} {p.get('veth', 0) / 1e6:9.2f}" if p
                   else f"{'-':>12} {'-':>9}")  # fmt: skip
        print(f"{r['case']:14} {r['scheme']:13} {r['seconds'] * 1e3:9.1f} {planned} "
              f"{r['veth_sent_bytes'] / 1e6:17.2f}")  # fmt: skip
        by[(r["case"], r["scheme"])] = r["seconds"]
    c = "C1 -> C2"
    out = {
        "grad_sync_hierarchical_over_resolved": by[("grad sync", "hierarchical")]
        / by[("grad sync", "resolved plan")],
        "fused_over_naive": by[(c, "fused")] / by[(c, "naive")],
        "fused_over_per_tensor": by[(c, "fused")] / by[(c, "per-tensor")],
        "relay_over_fused": by[(c, "relay")] / by[(c, "fused")],
        "c1c2_flat_over_topology": by[(c, "fused-flat")] / by[(c, "fused")],
    }
    if ("stage to node 2", "relay") in by:  # the cases of 2 ranks a node
        out["one_owner_relay_over_fused"] = (
            by[("stage to node 2", "relay")] / by[("stage to node 2", "fused")]
        )
        out["shrink_flat_over_topology"] = (
            by[("B TP2 -> TP1", "fused-flat")] / by[("B TP2 -> TP1", "fused")]
        )
    return out


def _measure_network(spec: Any, args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """Build ``spec``, run one launcher per node, tear down: (node 0's rows, cluster JSON)."""
    from hspmd.netcluster import run
    from hspmd.netcluster.describe import cluster_json

    with tempfile.TemporaryDirectory(prefix="hspmd-network-") as tmp, run.session(spec):
        measured = run.measure(spec)
        cluster = cluster_json(spec, measured, memory_mb=run.host_memory_mb() / spec.num_ranks)
        cluster_file, rows_file = Path(tmp, "cluster.json"), Path(tmp, "rows.pkl")
        cluster_file.write_text(json.dumps(cluster))
        env = {"PYTHONPATH": f"{ROOT / 'src'}", "OMP_NUM_THREADS": "1",
               "TORCH_CPP_LOG_LEVEL": "ERROR"}  # fmt: skip
        argv = [sys.executable, str(Path(__file__).resolve()), "--nodes", str(args.nodes),
                "--ranks-per-node", str(args.ranks_per_node), "--hidden", str(args.hidden),
                "--repeats", str(args.repeats), "--cluster", str(cluster_file),
                "--master", spec.address(0), "--rows", str(rows_file)]  # fmt: skip
        procs = [run.spawn(i, [*argv, "--node", str(i)], env=env) for i in range(args.nodes)]
        try:
            codes = [p.wait(900) for p in procs]
        finally:
            for p in procs:
                run.stop(p, grace_s=0)
        if any(codes):
            print(f"network.py: node launchers exited with {codes}", file=sys.stderr)
            return None, cluster
        return pickle.loads(rows_file.read_bytes()), cluster


SIM_STRATEGIES = {
    "PP, stage per node": "4x1: R0-1:L0-3 R2-3:L4-7",
    "DP across nodes": "2x1: R0-1:L0-7; 2x1: R2-3:L0-7",
    "TP 4 across nodes": "4x1: R0-3:L0-7",
}
SIM_BATCH, SIM_SEQ, SIM_STEPS, SIM_WARMUP = 4, 64, 8, 2


def _train_across(spec: Any, strategy: str, port: int, flags: Sequence[str] = ()) -> list[float]:
    """Step seconds of ``hspmd train --nnodes`` (node 0's JSON records)."""
    from hspmd.netcluster import run

    argv = [sys.executable, "-m", "hspmd", "train", "--model", "llama-small", "--strategy",
            strategy, "--global-batch", str(SIM_BATCH), "--seq-len", str(SIM_SEQ),
            "--steps", str(SIM_STEPS), "--json", "--nnodes", str(spec.num_nodes),
            "--master-port", str(port), *flags]  # fmt: skip
    env = {"PYTHONPATH": f"{ROOT / 'src'}", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    procs = [run.spawn(i, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
             for i in range(spec.num_nodes)]  # fmt: skip
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            run.stop(p, grace_s=0)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"train {strategy!r} failed on a node: {[p.returncode for p in procs]}")
    return [json.loads(line)["seconds"] for line in outs[0].splitlines() if line.startswith("{")]


def sim_part(args: argparse.Namespace) -> dict[str, Any]:
    from hspmd.cli.netcluster import profile_across
    from hspmd.cost.cluster import load_cluster
    from hspmd.cost.lines import CostModel
    from hspmd.cost.measure import profile_machine
    from hspmd.models import get_config
    from hspmd.netcluster import run
    from hspmd.netcluster.describe import KIND, cluster_json
    from hspmd.netcluster.spec import NetSpec
    from hspmd.plan.strategy import StrategyOptions, parse_strategy
    from hspmd.planner.predict import predict
    from hspmd.planner.search import plan

    spec = NetSpec(2, 2, args.inter_gbps)
    config = get_config("llama-small")
    with tempfile.TemporaryDirectory(prefix="hspmd-network-") as tmp:
        profile = Path(tmp, "profile.json")
        # this machine's compute, its gloo calls' fixed costs and how its cores are shared
        # by the 4 ranks (the namespaces share them: the cluster file says one_host)
        made = profile_machine(quick=False, nproc=spec.num_ranks, dtype="fp32")
        profile.write_text(made.to_json())
        share = made.core_sharing[-1]
        with run.session(spec):
            cluster = cluster_json(spec, run.measure(spec), memory_mb=4000)
            # the veth's own cost lines, timed across the nodes (hspmd profile --nnodes)
            profiled = Path(tmp, "profile-veth.json")
            table = profile_across(spec, profile, profiled, port=PORT + 9)
            # the veth's lines, and loopback's all-reduce beside them (the file's per-call cost)
            keep = [x for x in table.splitlines() if "veth" in x or x.startswith("all-reduce")]
            print("\n".join(keep))
            costs = {}  # the veth as the file gives it (bandwidth, loopback's fixed costs)
            for key, file in (("file veth", profile), ("profiled veth", profiled)):
                cluster["gpu_kinds"][KIND].update(profile=str(file))
                path = Path(tmp, f"cluster-{key.split()[0]}.json")
                path.write_text(json.dumps(cluster))
                costs[key] = CostModel.of(load_cluster(path), dtype="fp32")
            # and what the planner chooses on the profiled file (ZeRO-1 off, as the others)
            chosen = plan(config, costs["profiled veth"], global_batch=SIM_BATCH,
                          seq_len=SIM_SEQ, dtype="fp32", zero1="off")  # fmt: skip
            runs = {n: (t, StrategyOptions(dtype="fp32")) for n, t in SIM_STRATEGIES.items()}
            runs["the planner's plan"] = (str(chosen.strategy), chosen.options)
            print(f"the planner's plan: {chosen.strategy} ({chosen.options})")
            rows = []
            for i, (name, (text, options)) in enumerate(runs.items()):
                predicted = {
                    key: predict(parse_strategy(text), config, cost, seq_len=SIM_SEQ,
                                 options=options).step_time_s
                    for key, cost in costs.items()
                }  # fmt: skip
                flags = ["--sequence-parallel"] if options.sequence_parallel else []
                steps = _train_across(spec, text, PORT + 10 + i, flags)
                kept = sorted(steps[SIM_WARMUP:])  # the first steps warm caches up
                measured = kept[len(kept) // 2]
                rows.append({"name": name, "strategy": text, "predicted_s": predicted,
                             "measured_s": measured})  # fmt: skip
    m = cluster["netcluster"]["measured"]
    print(f"simulator on 2 nodes x 2 ranks, veth {m['inter_GBps'] * 1e3:.1f} MB/s, loopback "
          f"{m['loopback_GBps']:.2f} GB/s; llama-small, batch {SIM_BATCH} x {SIM_SEQ}, fp32, "
          f"core sharing x{share:.2f} with 4 processes busy)")  # fmt: skip
    keys = list(costs)
    print(
        f"{'strategy':22} {'measured s':>11}"
        + "".join(f" {k + ' s':>17} {'/meas':>6}" for k in keys)
    )
    for r in rows:
        cells = "".join(
            f" {r['predicted_s'][k]:17.3f} {r['predicted_s'][k] / r['measured_s']:6.2f}"
            for k in keys
        )
        print(f"{r['name']:22} {r['measured_s']:11.3f}{cells}")
    print()
    return {
        key: {r["name"]: round(r["predicted_s"][key] / r["measured_s"], 3) for r in rows}
        for key in keys
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--inter-gbps", type=float, default=0.4)
    parser.add_argument("--hidden", type=int, default=256, help="llama-small width")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--part", default="switch", choices=["switch", "sim", "all"])
    # internal: one launcher per node
    parser.add_argument("--node", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cluster", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--master", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rows", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.node is not None:
        return node_main(args)
    if args.nodes != 4 or args.ranks_per_node not in (2, 4):
        print("network.py: the cases are written for --nodes 4 and --ranks-per-node 2 or 4",
              file=sys.stderr)  # fmt: skip
        return 2

    from hspmd.netcluster import run
    from hspmd.netcluster.spec import NetClusterError, NetSpec

    try:
        run.check_permission(probe=True)
    except NetClusterError as error:
        print(f"network.py: {error}", file=sys.stderr)
        return 2
    summary: dict[str, Any] = {"benchmark": "network", "nodes": args.nodes,
                               "ranks_per_node": args.ranks_per_node,
                               "inter_gbps": args.inter_gbps, "hidden": args.hidden}  # fmt: skip
    if args.part in ("sim", "all"):
        summary["sim_predicted_over_measured"] = sim_part(args)
    for nic_per_rank in (False, True) if args.part != "sim" else ():
        spec = NetSpec(args.nodes, args.ranks_per_node, args.inter_gbps,
                       nic_per_rank=nic_per_rank)  # fmt: skip
        rows, cluster = _measure_network(spec, args)
        if rows is None:
            return 1
        ratios = _print(rows, cluster)
        print()
        key = "nic_per_rank" if nic_per_rank else "nic_per_node"
        summary[key] = {"loopback_over_inter": cluster["netcluster"]["measured"]["ratio"],
                        **{k: round(v, 3) for k, v in ratios.items()}}  # fmt: skip
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
