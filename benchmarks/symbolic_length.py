"""What symbolic lengths save: rebuilding an executable per sequence length, against sizing
the plans of one executable built at the maximum length (``hspmd.comm.sizing``).

For each rank of the strategy (llama-small, TP 2 stages, sequence parallel so that the
plans split the sequence), side by side in one run:

    rebuild   build_executable(..., seq_len=L) for each new length L (deduction, cut,
              resolution, localization: what re-specializing per batch would cost)
    size      sized() of every plan of the executable built once at the maximum, plus its
              boundary plans, for each new length (what the runtime does per new length)

Times are the median over the lengths, per rank; the JSON line has their ratio.

    python benchmarks/symbolic_length.py                  # ~1 min
    python benchmarks/symbolic_length.py --max-len 1024 --lengths 128 256 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from hspmd.comm.sizing import sized
from hspmd.models.llama import get_config
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.specialize.boundary import boundary_plans, sized_boundaries
from hspmd.specialize.executable import build_executable, reshard_plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="2x1: R0-1:L0-3 R2-3:L4-7")
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--lengths", type=int, nargs="*", default=[128, 256, 384, 512])
    args = parser.parse_args()
    config = get_config("llama-small")
    strategy = parse_strategy(args.strategy)
    options = StrategyOptions(sequence_parallel=True)
    rows = []
    for rank in strategy.ranks:
        exe = build_executable(config, strategy, options, rank, seq_len=args.max_len, seed=0)
        plans = list(reshard_plans(exe.graph_module))
        bounds = boundary_plans(
            strategy, config, rank, (1, args.max_len, config.hidden_size), options=options
        )
        rebuild, size = [], []
        for length in args.lengths:
            start = time.perf_counter()
            build_executable(config, strategy, options, rank, seq_len=length, seed=0)
            rebuild.append(time.perf_counter() - start)
            start = time.perf_counter()
            for plan in plans:
                sized(plan, (plan.shape[0], length, *plan.shape[2:]))
            sized_boundaries(bounds, (1, length, config.hidden_size))
            size.append(time.perf_counter() - start)
        rows.append((rank, len(plans), statistics.median(rebuild), statistics.median(size)))
    print(f"{'rank':>4} {'plans':>6} {'rebuild':>12} {'size':>12} {'ratio':>8}")
    for rank, count, rebuild_s, size_s in rows:
        print(f"{rank:>4} {count:>6} {rebuild_s * 1e3:>9.1f} ms {size_s * 1e6:>9.1f} us "
              f"{rebuild_s / size_s:>8.0f}")  # fmt: skip
    rebuild_all = sum(r[2] for r in rows)
    size_all = sum(r[3] for r in rows)
    print(json.dumps({
        "benchmark": "symbolic_length", "strategy": args.strategy, "max_len": args.max_len,
        "lengths": args.lengths, "rebuild_s_per_length": round(rebuild_all, 4),
        "size_s_per_length": round(size_all, 6), "rebuild_over_size": round(rebuild_all / size_all),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
