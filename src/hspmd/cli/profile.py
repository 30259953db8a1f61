"""`hspmd profile`: measure this machine and write its fitted cost model.

    hspmd profile --out profile.json            # about a minute on 2 cores
    hspmd profile --quick --nproc 2 --dtype fp32 --json

Times matmul, causal attention, RMS norm, elementwise ops and an Adam step on this
machine (the CUDA device when there is one, at Llama's shapes), and all-reduce, all-gather,
reduce-scatter, all-to-all and send-recv over ``--nproc`` local gloo processes (link
"loopback"; on a CUDA host nccl, one GPU per process; ``--nproc 1``: none); fits
``seconds = overhead_s + slope * units`` per family (units in hspmd.cost.profile) and
writes the profile (format hspmd.profile/1, read back by hspmd.cost.profile.load_profile).
Prints a table of the fits, or with ``--json`` the profile itself.

Across nodes, one command per node (as ``hspmd train --nnodes``), after a profile of one
node::

    hspmd profile --nproc 2 --nnodes 2 --node-rank K --master-addr ADDR \
        --base profile.json --link ib --out profile-2nodes.json

times the same collectives over rings that cross the nodes (every rank, node-major, and
the first rank of each node: one flow leaving a node at a time), and node 0 writes the base
profile with those fits as link ``--link`` (the cluster file's inter link): the cost model
then prices a call across nodes by what it measured, not by the file's bandwidth plus the
local calls' fixed cost (docs/netcluster.md measures the difference).
"""

from __future__ import annotations

import argparse
import dataclasses

from hspmd.cli.paths import check_out_folder, write_out
from hspmd.cli.train import add_node_arguments, node_of
from hspmd.cost.profile import COMPUTE_UNIT, Profile, ProfileError, load_profile


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="measure compute and local collectives, write the fitted profile (JSON)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="profile.json", help="profile file to write")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument(
        "--nproc", type=int, default=2, help="local processes of the collectives (1: none)"
    )
    parser.add_argument(
        "--dtype", default="fp32", choices=["fp32", "bf16"], help="the dtype compute is measured in"
    )
    parser.add_argument("--json", action="store_true", help="print the profile as JSON")
    parser.add_argument(
        "--base", help="with --nnodes: the one-node profile the measured link is added to"
    )
    parser.add_argument(
        "--link", help="with --nnodes: the inter-node link's name in the cluster file (e.g. ib)"
    )
    add_node_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        raise ProfileError(f"--nproc {args.nproc}: give at least 1 (1 measures no collectives)")
    if args.nnodes < 1:
        raise ProfileError(f"--nnodes {args.nnodes}: give the number of nodes, at least 1")
    if args.nnodes > 1:
        return _across_nodes(args)
    if args.base or args.link:
        raise ProfileError("--base and --link go with --nnodes (a link across nodes)")
    check_out_folder(args.out, "--out")  # before a minute of measuring
    from hspmd.cost.measure import profile_machine  # torch: only when measuring

    return _write(args, profile_machine(quick=args.quick, nproc=args.nproc, dtype=args.dtype))


def _write(args: argparse.Namespace, profile: Profile) -> int:
    write_out(args.out, profile.to_json())
    if args.json:
        print(profile.to_json(), end="")
    else:
        print(fits_text(profile))
    return 0


def _across_nodes(args: argparse.Namespace) -> int:
    """One node's part of ``--nnodes`` (module docstring); node 0 writes the profile."""
    if not args.base or not args.link:
        raise ProfileError(
            "--nnodes times a link across nodes: give --base PROFILE (this node's, from "
            "`hspmd profile`) and --link NAME (the cluster file's inter link, e.g. ib)"
        )
    node = node_of(args)
    assert node is not None
    base = load_profile(args.base)
    if node.node_rank == 0:
        check_out_folder(args.out, "--out")
    from hspmd.cost.measure import link_fits, measure_across_nodes  # torch

    backend = "nccl" if base.kind == "cuda" else "gloo"
    by_group = measure_across_nodes(node, args.nproc, quick=args.quick, backend=backend)
    if node.node_rank != 0:
        print(f"node {node.node_rank}: collectives timed across {node.num_nodes} nodes; "
              f"node 0 writes {args.out}")  # fmt: skip
        return 0
    where = f"{backend} over {node.num_nodes} nodes x {args.nproc} processes"
    profile = dataclasses.replace(
        base,
        links={**base.links, args.link: link_fits(by_group)},
        host={**base.host, f"collectives ({args.link})": where},
    )
    return _write(args, profile)


def fits_text(profile: Profile) -> str:
    """One line per fitted family: slope, overhead and r2.

    >>> from hspmd.cost.profile import Fit
    >>> p = Profile(kind="cpu", device="cpu", dtype="float32", threads=2, created="-",
    ...             host={}, compute={"matmul": Fit(1e-11, 1e-4, 0.995)}, links={})
    >>> print(fits_text(p))
    cpu (cpu), float32, 2 threads
    family                link         slope  unit            overhead      r2
    matmul                -         1.00e-11  s/flop          100.0 us   0.995
    links: none measured (--nproc 1 times compute only)
    """
    lines = [
        f"{profile.device} ({profile.kind}), {profile.dtype}, {profile.threads} threads",
        f"{'family':<22}{'link':<10}{'slope':>8}  {'unit':<12}{'overhead':>12}{'r2':>8}",
    ]
    for op, fit in profile.compute.items():
        unit = "s/flop" if COMPUTE_UNIT[op] == "per_flop_s" else "s/byte"
        lines.append(_row(op, "-", fit.per_unit_s, unit, fit.overhead_s, fit.r2))
    for name, ops in profile.links.items():
        for op, link in ops.items():
            fit = link.fit
            family = f"{op} (n={link.group_size})"
            lines.append(_row(family, name, fit.per_unit_s, "s/bus-byte", fit.overhead_s, fit.r2))
            for n, g in link.groups:
                lines.append(_row(f"{op} (n={n})", name, g.per_unit_s, "s/bus-byte",
                                  g.overhead_s, g.r2))  # fmt: skip
    if not profile.links:
        lines.append("links: none measured (--nproc 1 times compute only)")
    if profile.core_sharing:
        shown = ", ".join(f"{f:.2f}" for f in profile.core_sharing)
        lines.append(f"core sharing: x{shown} for 1..{len(profile.core_sharing)} processes at once")
    return "\n".join(lines)


def _row(family: str, link: str, slope: float, unit: str, overhead_s: float, r2: float) -> str:
    return f"{family:<22}{link:<10}{slope:8.2e}  {unit:<12}{overhead_s * 1e6:9.1f} us{r2:8.3f}"
