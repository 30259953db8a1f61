"""C1 -> C2 reconfiguration of the paper (Appendix C.3, Table 11; Table 4): BSR schemes compared.

The 32B Llama of Table 6 on 32 H20 GPUs (4 nodes of 8; NVLink inside a node, InfiniBand
between nodes). C1 runs two TP4 x PP4 pipelines on R0-15 and R16-31. Rank 31 fails; C2 runs
on R0-30. Every parameter's fp32 master and both Adam moments move from C1 to C2 (12 bytes
per parameter, moved as one tensor per parameter); the failed rank owns nothing.

Assumed figures: NVLink 450 GB/s per GPU in one direction (Table 7's 900 GB/s for the H20 is
NVIDIA's total of both directions); one 400 Gb/s (50 GB/s) InfiniBand NIC per GPU (not given
in the paper). Time model: ``hspmd.cost.traffic``.

    .venv/bin/python benchmarks/bsr_reconfig.py            # the table, then one JSON line
    .venv/bin/python benchmarks/bsr_reconfig.py --all-ranks # every rank, not only senders

Schemes: ``naive`` (local copy, else the lowest-rank owner sends), ``per-tensor`` (the
heuristic, load counters reset per tensor), ``fused`` (one heuristic scheme over all tensors),
``relay`` (fused, then single-owner InfiniBand transfers spread over the NICs of both nodes).
The schemes and tables come from ``hspmd.switch.cost`` (also behind ``hspmd switch-cost``).
"""

from __future__ import annotations

import argparse
import json
import time

from hspmd.comm.bsr import BsrTable, messages
from hspmd.comm.resolve import _resolve, resolve
from hspmd.comm.topology import NVLINK, LinkClass, Topology
from hspmd.cost.traffic import Estimate
from hspmd.models import get_config
from hspmd.plan.params import parameter_annotations, state_annotations
from hspmd.plan.strategy import parse_strategy
from hspmd.switch.cost import ALGOS, estimate_scheme, scheme_stages, switch_tables

C1 = (
    "16x2: R0-3:L0-14 R4-7:L15-29 R8-11:L30-44 R12-15:L45-59; "
    "16x2: R16-19:L0-14 R20-23:L15-29 R24-27:L30-44 R28-31:L45-59"
)
C2 = (
    "33x1: R0-3:L0-14 R4-7:L15-29 R8-11:L30-44 R12-15:L45-59; "
    "31x1: R16-19:L0-15 R20-23:L16-31 R24-27:L32-47 R28-29:L48-55 R30:L56-59"
)
BYTES_PER_PARAM = 12  # fp32 master + Adam m + Adam v


FAILED = {31}


def build_tables(*, failed: set[int]) -> list[BsrTable]:
    config = get_config("llama-32b")
    before = state_annotations(parse_strategy(C1), config)
    after = state_annotations(parse_strategy(C2), config)
    return switch_tables(before, after, itemsize=BYTES_PER_PARAM, failed=failed)


def run_schemes(tables: list[BsrTable], topology: Topology) -> dict[str, Estimate]:
    out: dict[str, Estimate] = {
        algo: estimate_scheme(tables, algo, topology=topology, failed=FAILED) for algo in ALGOS
    }
    out["_messages"] = len(messages(scheme_stages(tables, "fused", topology=topology)[0]))  # type: ignore[assignment]
    return out


TABLE9_48 = "; ".join(
    f"16x1: R{16 + 8 * i}-{19 + 8 * i}:L0-10 R{20 + 8 * i}-{23 + 8 * i}:L11-21 "
    f"R{4 * i}-{4 * i + 3}:L22-59"
    for i in range(4)
)
C4_48 = (
    "32x1: R16-19:L0-4 R20-23:L5-10 R24-27:L11-16 R28-31:L17-22 R0-3:L23-40 R4-7:L41-59; "
    "32x1: R32-35:L0-4 R36-39:L5-10 R40-43:L11-16 R44-47:L17-22 R8-11:L23-40 R12-15:L41-59"
)


def resolve_seconds() -> tuple[int, float]:
    """Cold ``resolve`` of every llama-32b parameter, C4 -> Table 9 plan on 48 ranks."""
    config = get_config("llama-32b")
    before = parameter_annotations(parse_strategy(C4_48), config)
    after = parameter_annotations(parse_strategy(TABLE9_48), config)
    topology = Topology.uniform_nodes(48)
    _resolve.cache_clear()
    start = time.perf_counter()
    for name, spec in before.items():
        resolve(spec.annotation, after[name].annotation, spec.shape, topology=topology)
    return len(before), time.perf_counter() - start


def cell(est: Estimate, rank: int) -> str:
    sent = est.sent.get(rank, {})
    nvl, ib = sent.get("nvlink", 0.0) / 1e6, sent.get("ib", 0.0) / 1e6
    return f"{nvl:7.0f} | {ib:6.0f}" if nvl or ib else f"{'-':>7} | {'-':>6}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--all-ranks", action="store_true", help="list every rank")
    parser.add_argument("--ib-gbps", type=float, default=400.0, help="InfiniBand per NIC, Gb/s")
    args = parser.parse_args()
    topology = Topology.uniform_nodes(
        32,
        ranks_per_node=8,
        intra=NVLINK,
        inter=LinkClass("ib", args.ib_gbps / 8 * 1e9),
    )
    start = time.perf_counter()
    tables = build_tables(failed=FAILED)
    results = run_schemes(tables, topology)
    planning_s = time.perf_counter() - start
    num_messages = results.pop("_messages")
    names = list(results)
    print("C1 -> C2, llama-32b, fp32 master + 2 Adam states (12 B/param), rank 31 failed")
    print("sent per rank, MB:  NVLink | IB")
    print("rank  " + "  ".join(f"{n:>16}" for n in names))
    for rank in range(32):
        cells = [cell(results[n], rank) for n in names]
        if args.all_ranks or any(rank in results[n].sent for n in names):
            print(f"R{rank:<4} " + "  ".join(f"{c:>16}" for c in cells))
    print("total  " + "  ".join(f"{results[n].total() / 1e9:13.1f} GB" for n in names))
    print("time   " + "  ".join(f"{results[n].time * 1e3:13.1f} ms" for n in names))
    print(f"{len(tables)} tensors, fused BSR: {num_messages} messages; planning {planning_s:.2f} s")
    count, seconds = resolve_seconds()
    print(
        f"resolve() of all {count} llama-32b parameters, 48-rank switch (C4 -> Table 9): "
        f"{seconds * 1e3:.0f} ms cold"
    )
    fused = results["fused"].time
    print(
        json.dumps(
            {
                "benchmark": "bsr_reconfig",
                "naive_over_fused": round(results["naive"].time / fused, 3),
                "per_tensor_over_fused": round(results["per-tensor"].time / fused, 3),
                "relay_over_fused": round(results["relay"].time / fused, 3),
                "ib_share_fused": round(results["fused"].total("ib") / results["fused"].total(), 3),
                "ib_share_naive": round(results["naive"].total("ib") / results["naive"].total(), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
