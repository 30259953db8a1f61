"""Our executors against raw torch.distributed calls and DTensor.redistribute, side by side.

Four gloo processes reshard the same global tensor (4096 x 4096 float32 by default) with
an all-gather ({0:4} -> {D:4}), a reduce-scatter ({P:4} -> {0:4}), an all-reduce
({P:4} -> {D:4}) and a BSR ({0:4} -> {1:4} forced through batched send/receive). Each
repetition runs raw, ours and DTensor back to back (interleaved, in a rotating order),
between barriers; the table shows rank 0's median seconds and the median over repetitions
of each repetition's ratio to raw (neighbouring runs share the machine's load), then one
JSON line.

    .venv/bin/python benchmarks/comm.py              # default: 4096 x 4096, 7 repetitions
    .venv/bin/python benchmarks/comm.py --size 1024 --reps 20

"raw" is what a user would write by hand for the same result: all_gather_single /
reduce_scatter_single into a fresh output; all_reduce in place (ours with donate=True) and,
as "all-reduce-copy", on a copy (ours by default, leaving the input intact); for BSR one
batch_isend_irecv with each peer's block packed by .contiguous() and received in place.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from hspmd.annotation import parse_annotation
from hspmd.comm.plan import (
    AllGather,
    AllReduce,
    BatchedSendRecv,
    CommPlan,
    ReduceScatter,
    Transfer,
)
from hspmd.runtime import World, launch, run_plan
from hspmd.runtime.compat import all_gather_single, reduce_scatter_single

NPROC = 4
GROUP = (tuple(range(NPROC)),)


def plans(size: int) -> dict[str, CommPlan]:
    def a(text: str) -> object:
        return parse_annotation(f"[0,1,2,3]{text}")

    shape = (size, size)
    block = size // NPROC
    transfers = tuple(
        Transfer(i, j, ((i * block, (i + 1) * block), (j * block, (j + 1) * block)))
        for j in range(NPROC)
        for i in range(NPROC)
    )
    return {
        "all-gather": CommPlan(a("{0:4}"), a("{D:4}"), shape, (AllGather(GROUP, dim=0),)),
        "reduce-scatter": CommPlan(a("{P:4}"), a("{0:4}"), shape, (ReduceScatter(GROUP, dim=0),)),
        "all-reduce": CommPlan(a("{P:4}"), a("{D:4}"), shape, (AllReduce(GROUP),)),
        "all-reduce-copy": CommPlan(a("{P:4}"), a("{D:4}"), shape, (AllReduce(GROUP),)),
        "bsr": CommPlan(a("{0:4}"), a("{1:4}"), shape, (BatchedSendRecv(transfers),)),
    }  # type: ignore[arg-type]


def _raw(name: str, local: torch.Tensor, size: int, rank: int) -> Callable[[], object]:
    """The bare torch.distributed calls a user would write for the same result."""
    if name == "all-gather":

        def all_gather() -> object:
            out = torch.empty(size, size)
            return all_gather_single(out, local)

        return all_gather
    if name == "reduce-scatter":

        def reduce_scatter() -> object:
            out = torch.empty(size // NPROC, size)
            return reduce_scatter_single(out, local)

        return reduce_scatter
    if name == "all-reduce":
        return lambda: dist.all_reduce(local)
    if name == "all-reduce-copy":
        return lambda: dist.all_reduce(local.clone())
    block = size // NPROC

    def bsr() -> None:
        out = torch.empty(size, block)
        ops = []
        for j in range(NPROC):
            if j == rank:
                out[j * block : (j + 1) * block] = local[:, j * block : (j + 1) * block]
                continue
            ops.append(
                dist.P2POp(dist.isend, local[:, j * block : (j + 1) * block].contiguous(), j)
            )
            ops.append(dist.P2POp(dist.irecv, out[j * block : (j + 1) * block], j))
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return bsr


def _dtensor(name: str, local: torch.Tensor) -> Callable[[], object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (NPROC,))
    src, dst = {
        "all-gather": (Shard(0), Replicate()),
        "reduce-scatter": (Partial(), Shard(0)),
        "all-reduce": (Partial(), Replicate()),
        "all-reduce-copy": (Partial(), Replicate()),
        "bsr": (Shard(0), Shard(1)),
    }[name]

    def run() -> object:
        tensor = DTensor.from_local(local, mesh, [src], run_check=False)
        return tensor.redistribute(mesh, [dst]).to_local()

    return run


def _time(fn: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def worker(world: World, size: int, reps: int) -> dict[str, dict[str, float]]:
    all_plans = plans(size)
    world.prepare(all_plans.values())
    torch.manual_seed(world.rank)
    out = {}
    for name, plan in all_plans.items():
        local = torch.randn(plan.src.piece(world.rank, plan.shape).shape)
        impls = {
            "raw": _raw(name, local.clone(), size, world.rank),
            "ours": lambda plan=plan, local=local, donate=name == "all-reduce": run_plan(
                plan, local, world, donate=donate
            ),
            "dtensor": _dtensor(name, local),
        }
        for fn in impls.values():  # warm up
            fn()
        times: dict[str, list[float]] = {k: [] for k in impls}
        keys = list(impls)
        for rep in range(reps):
            for key in keys[rep % 3 :] + keys[: rep % 3]:  # rotate the order
                times[key].append(_time(impls[key]))
        out[name] = {k: statistics.median(v) for k, v in times.items()}
        for key in ("ours", "dtensor"):  # ratios within a repetition: shared load cancels
            ratios = [t / r for t, r in zip(times[key], times["raw"], strict=True)]
            out[name][f"{key}/raw"] = statistics.median(ratios)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="global tensor is size x size")
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions")
    args = parser.parse_args()
    medians = launch(worker, NPROC, args=(args.size, args.reps), timeout_s=1800)[0]
    print(f"{NPROC} gloo processes, {args.size} x {args.size} float32, {args.reps} reps (median s)")
    print(f"{'op':<16}{'raw':>10}{'ours':>10}{'dtensor':>10}{'ours/raw':>10}{'dt/raw':>10}")
    ratios = {}
    for name, m in medians.items():
        ours, dt = m["ours/raw"], m["dtensor/raw"]
        ratios[name] = {"ours_over_raw": round(ours, 3), "dtensor_over_raw": round(dt, 3)}
        print(
            f"{name:<16}{m['raw']:>10.4f}{m['ours']:>10.4f}{m['dtensor']:>10.4f}"
            f"{ours:>10.3f}{dt:>10.3f}"
        )
    print(
        json.dumps(
            {"benchmark": "comm", "nproc": NPROC, "size": args.size, "reps": args.reps, **ratios}
        )
    )


if __name__ == "__main__":
    main()
