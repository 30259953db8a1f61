"""`hspmd netcluster`: a real two-tier network on this machine (root, iproute2).

    hspmd netcluster up --nodes 2 --ranks-per-node 2 --inter-gbps 0.4 [--latency-ms 1] \\
        [--out cluster.json]
    hspmd netcluster exec 1 -- python -c "import socket; print(socket.gethostname())"
    hspmd netcluster status
    hspmd netcluster down

``up`` makes one network namespace per node (``hspmd-nc-n0``, ...) joined by a bridge in a
namespace of its own (``hspmd-nc-hub``), addresses 10.213.0.1, 10.213.0.2, ... on the
bridge, each node's link shaped with tc (htb, netem), measures loopback and inter-node
throughput, and writes a cluster file (``hspmd.cluster/1``) with the measured figures.
With ``--profile PROFILE`` (a profile of this machine, ``hspmd profile --nproc N``), ``up``
also times the veth's collectives across the nodes (``hspmd profile --nnodes`` in each
namespace) and writes PROFILE plus the veth's lines beside the cluster file, which names
it as the kind's profile: the file is then ready for ``hspmd simulate`` and ``plan``.
``exec NODE -- CMD`` runs CMD inside node NODE with ``GLOO_SOCKET_IFNAME``,
``HSPMD_NODE`` and ``HSPMD_MASTER_ADDR`` (node 0's address) set. ``down`` removes every
``hspmd-nc-*`` namespace; it is safe to run any time. See docs/netcluster.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from hspmd.cli.paths import check_out_folder
from hspmd.cost.profile import load_profile
from hspmd.netcluster.describe import KIND
from hspmd.netcluster.spec import NetClusterError, NetSpec, node_namespace


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "netcluster",
        help="emulate nodes as network namespaces with shaped links (root)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    up = actions.add_parser("up", help="build the network, measure it, write a cluster file")
    up.add_argument("--nodes", type=int, required=True, help="namespaces (nodes), >= 2")
    up.add_argument("--ranks-per-node", type=int, required=True, help="ranks of each node")
    up.add_argument(
        "--inter-gbps", type=float, required=True, help="inter-node link, Gbit/s per direction"
    )
    up.add_argument("--latency-ms", type=float, default=0.0, help="round trip between nodes")
    up.add_argument(
        "--nic-per-rank",
        action="store_true",
        help="one shaped veth per rank (as one NIC per GPU) instead of one per node",
    )
    up.add_argument("--out", default="cluster.json", help="cluster file to write")
    up.add_argument(
        "--profile",
        help="this machine's profile (hspmd profile): add the veth timed across the nodes",
    )
    up.set_defaults(func=run_up)
    down = actions.add_parser("down", help="remove every hspmd-nc-* namespace")
    down.set_defaults(func=run_down)
    status = actions.add_parser("status", help="list the hspmd-nc-* namespaces")
    status.set_defaults(func=run_status)
    run = actions.add_parser("exec", help="run a command inside one node")
    run.add_argument("node", type=int, help="node index (0 is the master)")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    run.set_defaults(func=run_exec)


def run_up(args: argparse.Namespace) -> int:
    from hspmd.netcluster import run
    from hspmd.netcluster.describe import cluster_json

    spec = NetSpec(
        args.nodes, args.ranks_per_node, args.inter_gbps, args.latency_ms, args.nic_per_rank
    )
    check_out_folder(args.out, "--out")  # before any namespace is made
    if args.profile:
        load_profile(args.profile)  # a bad file: one line before anything is built
    with run.Signals():  # SIGTERM too: measured on the built network, or taken down again
        run.up(spec)
        try:
            measured = run.measure(spec)
            data = cluster_json(spec, measured, memory_mb=run.host_memory_mb() / spec.num_ranks)
            if args.profile:
                both = Path(args.out).with_name(f"{Path(args.out).stem}-profile.json")
                profile_across(spec, Path(args.profile), both)
                data["gpu_kinds"][KIND]["profile"] = both.name  # beside the cluster file
            Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
        except BaseException:
            run.down()
            raise
    print(
        f"netcluster up: {spec.num_nodes} nodes x {spec.ranks_per_node} ranks "
        f"({', '.join(f'{ns} {spec.address(i)}' for i, ns in enumerate(spec.nodes))})"
    )
    print(
        f"loopback {measured.loopback_Bps / 1e9:.3f} GB/s, inter-node "
        f"{measured.inter_Bps / 1e9:.4f} GB/s ({measured.inter_Bps * 8 / 1e9:.3f} Gbit/s, "
        f"shaped to {spec.inter_gbps:g}): {measured.ratio:.1f}x; cluster file {args.out}"
    )
    if args.profile:
        print(f"the veth's collectives timed across the nodes: {both}")
    print("run `hspmd netcluster down` to remove it")
    return 0


def profile_across(
    spec: NetSpec, base: Path, out: Path, *, port: int = 29649, quick: bool = False
) -> str:
    """``hspmd profile --nnodes`` in every node of the running network: ``base`` plus the
    veth's lines into ``out``; node 0's table."""
    from hspmd.netcluster import run

    argv = [sys.executable, "-m", "hspmd", "profile", "--nproc", str(spec.ranks_per_node),
            "--nnodes", str(spec.num_nodes), "--master-port", str(port), "--base",
            str(base.resolve()), "--link", "veth", "--out", str(out.resolve()),
            *(["--quick"] if quick else [])]  # fmt: skip
    src = str(Path(__file__).resolve().parents[2])  # hspmd importable as this one is
    env = {"PYTHONPATH": src, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    procs = [
        run.spawn(i, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for i in range(spec.num_nodes)
    ]
    try:
        outs = [p.communicate(timeout=1800) for p in procs]
    finally:
        for p in procs:
            run.stop(p, grace_s=0)
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode]
    if failed:
        node, code = failed[0]
        last = (outs[node][1].strip().splitlines() or [""])[-1]
        raise NetClusterError(
            f"timing the veth across the nodes failed in node {node} (exit {code}): {last}"
        )
    return outs[0][0]


def run_down(args: argparse.Namespace) -> int:
    from hspmd.netcluster import run

    removed = run.down()
    print(f"netcluster down: removed {', '.join(removed)}" if removed else "netcluster: none up")
    return 0


def run_status(args: argparse.Namespace) -> int:
    from hspmd.netcluster import run

    run.check_permission()
    names = run.existing()
    print("\n".join(names) if names else "netcluster: none up")
    return 0


def run_exec(args: argparse.Namespace) -> int:
    from hspmd.netcluster import run

    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise NetClusterError("exec: give the command after --, e.g. exec 0 -- ip addr")
    run.check_permission()
    if node_namespace(args.node) not in run.existing():
        raise NetClusterError(
            f"node {args.node}: no namespace {node_namespace(args.node)}; "
            "`hspmd netcluster status` lists the nodes that are up"
        )
    proc = subprocess.run(run.exec_argv(args.node, argv), env=run.node_env(args.node))
    sys.stdout.flush()
    return proc.returncode
