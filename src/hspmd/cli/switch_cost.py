"""`hspmd switch-cost`: estimate a strategy switch without running it.

    hspmd switch-cost --model llama-32b --cluster h20x32 --algo fused --failed 31 \\
        --from "16x2: R0-3:L0-14 ...; 16x2: R16-19:L0-14 ..." \\
        --to   "33x1: R0-3:L0-14 ...; 31x1: R16-19:L0-15 ..."
    hspmd switch-cost ... --states bf16      # only the bf16 compute weights (mixed-length mode)
    hspmd switch-cost ... --json             # one JSON object
    hspmd switch-cost ... --picture sw.png   # also draw it: --algo's pair matrix, bars of all

Prints, for every rank that sends or receives, the bytes it sends over each link class, the
bytes it receives and the time it is busy (in B, KB, MB or GB, whichever fits the largest
figure), then the totals and the estimated time of the slowest rank (hspmd.cost.traffic's
model). ``--picture FILE.png|.svg`` draws the bytes per rank pair of ``--algo`` by link
class and each rank's bytes sent and received under naive, fused and relay. ``--cluster`` takes a cluster file or a shipped name (hetu-h800-h20, h20x32).
"""

from __future__ import annotations

import argparse
import json

from hspmd.cli.flags import add_flags
from hspmd.cli.model_input import model_argument
from hspmd.cli.strategy_arg import strategy_argument
from hspmd.cost.cluster import Cluster, load_cluster
from hspmd.models.config import PRESETS
from hspmd.plan.strategy import parse_ranks
from hspmd.switch.cost import ALGOS, STATES, SwitchCost, switch_cost
from hspmd.viz.common import check_picture_path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "switch-cost",
        help="per-rank send volume and estimated time of a switch between two strategies",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        required=True,
        type=model_argument(sorted(PRESETS)),
        help="model preset, e.g. llama-32b, an nn.Module's FILE.py:FUNCTION (docs/models.md), "
        "or hf:DIR (docs/checkpoints.md)",
    )
    parser.add_argument("--config", default=None, help="JSON: the factory's keyword arguments")
    for flag, dest, which in (("--from", "source", "old"), ("--to", "target", "new")):
        parser.add_argument(flag, dest=dest, required=True, type=strategy_argument,
                            help=f"{which} strategy string, or @FILE holding it")  # fmt: skip
    parser.add_argument("--cluster", required=True, help="cluster file or shipped name")
    parser.add_argument("--algo", choices=ALGOS, default="fused", help="BSR scheme")
    parser.add_argument(
        "--states", choices=tuple(STATES), default="fp32-adam",
        help="fp32-adam: masters + 2 Adam states (12 B/param); bf16: compute weights (2 B)",
    )  # fmt: skip
    parser.add_argument("--failed", default="", help="ranks that died and own nothing, e.g. 31")
    add_flags(parser, ["--zero1"])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--picture", default=None, metavar="FILE", help="also draw FILE.png|.svg")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hspmd.cli.model_input import model_kwargs

    if args.picture:
        check_picture_path(args.picture)
    cluster = load_cluster(args.cluster)
    failed = parse_ranks(args.failed) if args.failed.strip() else ()
    cost = switch_cost(
        model=args.model,
        source=args.source,
        target=args.target,
        cluster=cluster,
        algo=args.algo,
        states=args.states,
        failed=failed,
        zero1=args.zero1,
        model_kwargs=model_kwargs(args.config),
    )
    if args.json:
        print(json.dumps(cost.to_json()))
    else:
        print(cost_text(cost, links=cluster.topology().link_classes))
    if args.picture:
        _picture(args, cluster, failed)
        if not args.json:
            print(f"picture: {args.picture}")
    return 0


def _picture(args: argparse.Namespace, cluster: Cluster, failed: tuple[int, ...]) -> None:
    from hspmd.cli.model_input import model_kwargs
    from hspmd.switch.pairs import switch_pairs
    from hspmd.viz.switch import draw_switch

    algos = tuple(dict.fromkeys(("naive", "fused", "relay", args.algo)))
    traffics = switch_pairs(
        model=args.model, source=args.source, target=args.target, cluster=cluster,
        algos=algos, states=args.states, failed=failed, zero1=args.zero1,
        model_kwargs=model_kwargs(args.config),
    )  # fmt: skip
    title = f"{args.model} on {cluster.name}, states {args.states}" + (
        f", failed {args.failed}" if failed else ""
    )
    draw_switch(traffics, args.picture, matrix=args.algo, num_ranks=cluster.num_ranks,
                link_classes=cluster.topology().link_classes, title=title)  # fmt: skip


def cost_text(cost: SwitchCost, *, links: tuple[str, ...]) -> str:
    """The per-rank table: bytes sent per link class, bytes received, busy time; every rank
    that sends or receives (so the slowest one is always there), in a unit that fits."""
    est = cost.estimate
    ranks = sorted(set(est.sent) | set(est.received))
    received = {r: sum(est.received.get(r, {}).values()) for r in ranks}
    largest = max([est.total(name) for name in links] + list(received.values()), default=0.0)
    unit, scale = _unit(largest)
    lines = [
        f"{cost.model} on {cost.cluster}: {cost.algo}, states {cost.states}, "
        f"{cost.num_tensors} tensors, {cost.num_messages} messages",
        "rank  "
        + "".join(f"{name + ' ' + unit:>12}" for name in links)
        + f"{'recv ' + unit:>12}{'busy ms':>10}",
    ]
    for rank in ranks:
        per = est.sent.get(rank, {})
        cells = "".join(f"{per.get(name, 0.0) / scale:12.1f}" for name in links)
        lines.append(
            f"R{rank:<4}{cells}{received[rank] / scale:12.1f}"
            f"{_ms(est.rank_time.get(rank, 0.0)):>10}"
        )
    totals = "".join(f"{est.total(name) / scale:12.1f}" for name in links)
    lines.append(f"total{totals}{sum(received.values()) / scale:12.1f}")
    slowest = cost.slowest_rank
    lines.append(
        f"slowest rank R{slowest}: estimated switch time {_ms(est.time)} ms "
        f"({est.total() / scale:.1f} {unit} moved)"
        if slowest >= 0
        else "nothing moves: the strategies place every tensor alike"
    )
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.1f}" if ms >= 1 or ms == 0 else f"{ms:.3g}"


def _unit(largest: float) -> tuple[str, float]:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if largest >= 10 * scale:
            return unit, scale
    return "B", 1.0
