"""Training across emulated nodes equals the single-process reference (root, else skipped).

Two namespaces of two ranks each, linked at 0.4 Gbit/s: one pipeline whose stage 0 (TP 2)
is node 0 and stage 1 (TP 2) node 1, so activations and gradients cross the shaped link,
started by hspmd's launcher (one per node) and by multi-node torchrun (c10d rendezvous).
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hspmd.cli import main
from hspmd.netcluster import run
from hspmd.netcluster.spec import NetSpec
from hspmd.train.compare import compare
from hspmd.train.reference import run_reference
from hspmd.train.trainer import assemble, merge

from .nodes import MASTER, config_of

ROOT = Path(__file__).resolve().parents[2]
STRATEGY = "4x1: R0-1:L0-1 R2-3:L2-3"
ENV = {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def network() -> Iterator[NetSpec]:
    try:
        run.check_permission(probe=True)
    except Exception as error:  # noqa: BLE001 - any reason is a reason to skip
        pytest.skip(str(error))
    if run.existing():
        pytest.skip(f"a netcluster is already up ({', '.join(run.existing())}): not touching it")
    with run.session(NetSpec(2, 2, inter_gbps=0.4)) as spec:
        yield spec


def _sent_bytes(node: int) -> int:
    """Bytes the node's shaped veth has sent (htb's counter)."""
    out = subprocess.run(run.exec_argv(node, ["tc", "-s", "qdisc", "show", "dev", "nc0"]),
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return int(re.search(r"Sent (\d+) bytes", out).group(1))  # type: ignore[union-attr]


def _run_nodes(argvs: list[list[str]]) -> None:
    procs = [run.spawn(i, argv, env=ENV, stderr=subprocess.PIPE) for i, argv in enumerate(argvs)]
    try:
        errors = [p.communicate(timeout=400)[1] for p in procs]
    finally:
        for proc in procs:
            run.stop(proc, grace_s=0)
    for node, (proc, err) in enumerate(zip(procs, errors, strict=True)):
        assert proc.returncode == 0, f"node {node}: {err[-3000:]}"


def test_hspmd_launcher_per_node_equals_the_reference(network, tmp_path) -> None:
    before = _sent_bytes(0)
    outs = [tmp_path / f"node{i}.pkl" for i in range(2)]
    tool = [sys.executable, "-m", "tests.netcluster.nodes"]
    _run_nodes([[*tool, str(outs[i]), str(i), "2", STRATEGY] for i in range(2)])
    result = merge([pickle.loads(p.read_bytes()) for p in outs])
    comparison = compare(result, run_reference(config_of(STRATEGY)))
    assert comparison.ok, comparison
    assert _sent_bytes(0) - before > 100_000  # activations crossed the shaped link


def test_multi_node_torchrun_c10d_equals_the_reference(network, tmp_path) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this python")
    argvs = []
    for node in range(2):
        argvs.append([
            torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{MASTER}:29522", "--rdzv-id", "netcluster-test",
            "--local-addr", network.address(node), "--rdzv-conf", f"is_host={node == 0}",
            "-m", "hspmd.runtime", "tests.netcluster.nodes:torchrun_work", str(tmp_path), STRATEGY,
        ])  # fmt: skip
    _run_nodes(argvs)
    outcomes = [pickle.loads((tmp_path / f"rank-{r}.pkl").read_bytes()) for r in range(4)]
    config = config_of(STRATEGY)
    comparison = compare(assemble(outcomes, config), run_reference(config))
    assert comparison.ok, comparison


def test_cli_trace_across_nodes(network, tmp_path) -> None:
    """``hspmd train --nnodes 2 --trace``: every node's launcher traces (the clock sync and
    the gathering are collectives of all ranks; node 1 once skipped them and node 0 hung)."""
    trace = tmp_path / "run.json"
    cli = [sys.executable, "-m", "hspmd", "train", "--strategy", STRATEGY, "--global-batch", "4",
           "--seq-len", "32", "--steps", "2", "--quiet", "--nnodes", "2", "--master-port",
           "29523", "--trace", str(trace)]  # fmt: skip
    _run_nodes([cli, cli])  # node rank and master address from `netcluster exec`'s environment
    data = json.loads(trace.read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}  # both nodes' ranks, on node 0
    for rank in range(4):
        mine = [e for e in spans if e["pid"] == rank]
        assert sum(e["cat"] == "forward" for e in mine) == 8  # 4 micro-batches x 2 steps
        other_node = {2, 3} if rank < 2 else {0, 1}  # the stages' p2p cross the veth
        assert any(other_node & set(e["args"].get("peers", ())) for e in mine if e["cat"] == "comm")
    assert sorted(data["otherData"]["clocks"]) == ["0", "1", "2", "3"]


def test_elastic_across_nodes_survives_a_kill_in_node_1(network, capsys) -> None:
    """``--elastic --nnodes 2`` across the namespaces (issue 16's elastic item): rank 3, in
    node 1's namespace, is killed at step 3; both launchers go on to the end, and the
    losses node 0 prints equal the single-process reference's."""
    dp4 = "1x2: R0:L0-1; 1x2: R1:L0-1; 1x2: R2:L0-1; 1x2: R3:L0-1"
    run_args = ["--strategy", dp4, "--config", '{"num_layers": 2}', "--seq-len", "16",
                "--global-batch", "8", "--steps", "5", "--json"]  # fmt: skip
    cli = [sys.executable, "-m", "hspmd", "train", *run_args, "--elastic", "--hang-timeout",
           "10", "--inject-failure", "3@3", "--nnodes", "2", "--master-port", "29524"]  # fmt: skip
    procs = [run.spawn(i, cli, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(2)]  # fmt: skip
    try:
        outs = [p.communicate(timeout=400) for p in procs]
    finally:
        for proc in procs:
            run.stop(proc, grace_s=0)
    for node, (proc, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        assert proc.returncode == 0, f"node {node}: {err[-3000:]}"
    lines = [json.loads(x) for x in outs[0][0].splitlines() if x.startswith("{")]
    failures = [x for x in lines if x.get("event") == "failure"]
    assert [f["rank"] for f in failures] == [3], lines
    got = [x["loss"] for x in lines if "loss" in x and "event" not in x]
    assert main(["train", *run_args, "--reference"]) == 0
    ref = capsys.readouterr().out
    want = [json.loads(x)["loss"] for x in ref.splitlines() if x.startswith("{")]
    assert len(got) == 5 and max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
