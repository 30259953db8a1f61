"""Build, measure and tear down a real emulated network (root and iproute2, else skipped)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hspmd.cli import main
from hspmd.cost.cluster import load_cluster
from hspmd.netcluster import run
from hspmd.netcluster.spec import NetClusterError, NetSpec

ROOT = Path(__file__).resolve().parents[2]


def test_refuses_in_one_line_without_root(monkeypatch, capsys) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["netcluster", "up", "--nodes", "2", "--ranks-per-node", "1",
                 "--inter-gbps", "0.4"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "need root" in err


def test_up_measures_a_shaped_link_and_down_removes_all(netns, tmp_path, capsys) -> None:
    out = tmp_path / "cluster.json"
    argv = ["netcluster", "up", "--nodes", "2", "--ranks-per-node", "2", "--inter-gbps", "0.4"]
    try:
        assert main([*argv, "--out", str(out)]) == 0
        assert sorted(run.existing()) == ["hspmd-nc-hub", "hspmd-nc-n0", "hspmd-nc-n1"]
        cluster = load_cluster(out)
        measured = json.loads(out.read_text())["netcluster"]["measured"]
        # the shaped link carries 0.4 Gbit/s = 0.05 GB/s, less TCP/IP headers
        assert 0.035 <= measured["inter_GBps"] <= 0.051, measured
        assert measured["ratio"] > 5, measured
        assert cluster.topology().link(0, 2).name == "veth"
        addr = subprocess.run(run.exec_argv(1, ["ip", "-4", "-o", "addr", "show", "nc0"]),
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert "10.213.0.2/24" in addr
    finally:
        assert main(["netcluster", "down"]) == 0
    assert run.existing() == ()
    assert "hspmd-nc-" not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout


def test_a_nic_per_rank_network_sets_one_interface_per_local_rank(netns) -> None:
    with run.session(NetSpec(2, 2, 1.0, nic_per_rank=True)):
        assert run.nics_of(1) == ("nc0", "nc1")
        env = run.node_env(1)
        assert env["HSPMD_GLOO_IFNAMES"] == "nc0,nc1" and env["GLOO_SOCKET_IFNAME"] == "nc0"
        addr = subprocess.run(run.exec_argv(1, ["ip", "-4", "-o", "addr", "show", "nc1"]),
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert "10.213.1.2/24" in addr
    assert run.existing() == ()


def test_latency_needs_netem_and_a_refusal_leaves_nothing(netns) -> None:
    spec = NetSpec(2, 1, 1.0, latency_ms=2)
    try:
        run.up(spec)
    except NetClusterError as error:  # kernels without sch_netem (this machine's)
        assert "netem" in str(error) and "drop --latency-ms" in str(error)
    else:
        out = subprocess.run(run.exec_argv(0, ["tc", "qdisc", "show", "dev", "nc0"]),
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert "netem" in out and "delay 1ms" in out
    finally:
        run.down()
    assert run.existing() == ()


def test_a_failed_up_leaves_nothing(netns, monkeypatch) -> None:
    from hspmd.netcluster import spec as spec_module

    real = spec_module.up_commands
    bad = ("ip", "-n", "hspmd-nc-hub", "link", "set", "no-such-device", "up")
    monkeypatch.setattr(run, "up_commands", lambda s: (*real(s)[:8], bad))
    with pytest.raises(NetClusterError, match="no-such-device"):
        run.up(NetSpec(2, 1, 1.0))
    assert run.existing() == ()


def test_sigterm_inside_a_session_tears_down(netns) -> None:
    code = (
        "import time; from hspmd.netcluster import run; from hspmd.netcluster.spec import NetSpec\n"
        "with run.session(NetSpec(2, 1, 1.0)):\n"
        "    print('up', flush=True); time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        assert len(run.existing()) == 3
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        run.down()
    assert proc.returncode == 128 + signal.SIGTERM
    assert run.existing() == ()


def test_up_refuses_a_bad_profile_before_building(tmp_path, capsys) -> None:
    bad = tmp_path / "profile.json"
    bad.write_text("{}")
    assert main(["netcluster", "up", "--nodes", "2", "--ranks-per-node", "1", "--inter-gbps",
                 "0.4", "--profile", str(bad), "--out", str(tmp_path / "c.json")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "profile.json" in err
    assert not (tmp_path / "c.json").exists()


@pytest.mark.multiproc
def test_the_veth_timed_across_nodes_prices_calls_in_the_cluster_file(netns, tmp_path) -> None:
    """``profile_across`` (what ``up --profile`` runs) adds link "veth" to a profile; a
    cluster file naming it prices a call across the nodes by those lines."""
    from hspmd.cli.netcluster import profile_across
    from hspmd.cost.lines import CostModel
    from hspmd.netcluster.describe import KIND, cluster_json
    from tests.cost.test_lines import _profile_with_link

    spec = NetSpec(2, 2, 0.4)
    base = _profile_with_link(tmp_path / "base.json", "loopback", slope=1e-9, overhead=1e-3)
    both = tmp_path / "both.json"
    with run.session(spec):
        table = profile_across(spec, base, both, quick=True)
        data = cluster_json(spec, run.measure(spec), memory_mb=4000)
    assert "veth" in table
    data["gpu_kinds"][KIND]["profile"] = str(both)
    (tmp_path / "c.json").write_text(json.dumps(data))
    cost = CostModel.of(load_cluster(tmp_path / "c.json"), dtype="fp32")
    veth = cost.links["veth"]
    assert veth.per_flow and "profile of" in veth.source
    fit = veth.by_size["all-reduce"].for_size(4)
    assert cost.collective("all-reduce", 1 << 20, (0, 1, 2, 3)) == pytest.approx(
        fit.seconds(2 * 3 / 4 * (1 << 20))
    )
    # the shaped 0.4 Gbit/s: the 1 MiB calls take several ms more than the 64 KiB ones
    assert fit.per_unit_s > 1 / 0.2e9
