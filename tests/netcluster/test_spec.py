"""The pure part: a NetSpec and the commands it implies (no root needed)."""

from __future__ import annotations

import pytest

from hspmd.cost.cluster import cluster_from_json
from hspmd.netcluster.describe import Measured, cluster_json
from hspmd.netcluster.spec import (
    HUB,
    NetClusterError,
    NetSpec,
    down_commands,
    render,
    up_commands,
)


def test_every_command_names_only_our_namespaces() -> None:
    spec = NetSpec(3, 2, 0.4, latency_ms=2)
    lines = [render(c) for c in up_commands(spec)]
    for line in lines:
        assert line.startswith(
            (
                "ip netns add hspmd-nc-",
                "ip netns exec hspmd-nc-",
                "ip -n hspmd-nc-",
                "ip link add name",
            )
        )
        if line.startswith("ip link add"):  # a veth made with both ends in our namespaces
            assert line.count("netns hspmd-nc-") == 2
    assert lines.count(f"ip netns add {HUB}") == 1
    assert sum(line.startswith("ip netns add") for line in lines) == 4


def test_both_directions_of_each_link_are_shaped() -> None:
    spec = NetSpec(2, 1, 0.25, latency_ms=4)
    lines = [render(c) for c in up_commands(spec)]
    rates = [line for line in lines if "htb rate 250mbit ceil 250mbit" in line]
    assert [line.split()[3] for line in rates] == [
        "hspmd-nc-n0", HUB, "hspmd-nc-n1", HUB
    ]  # fmt: skip
    assert sum("netem delay 2ms" in line for line in lines) == 4  # half the round trip each
    assert not any("netem" in render(c) for c in up_commands(NetSpec(2, 1, 0.25)))


def test_addresses_are_private_and_distinct() -> None:
    spec = NetSpec(4, 1, 1.0)
    addresses = [spec.address(i) for i in range(4)]
    assert addresses == ["10.213.0.1", "10.213.0.2", "10.213.0.3", "10.213.0.4"]
    assert [spec.node_of(r) for r in range(4)] == [0, 1, 2, 3]


def test_down_deletes_ours_nodes_first_and_nothing_else() -> None:
    commands = down_commands(("hspmd-nc-hub", "mine", "hspmd-nc-n1", "hspmd-nc-n0"))
    assert [c[-1] for c in commands] == ["hspmd-nc-n1", "hspmd-nc-n0", "hspmd-nc-hub"]
    assert down_commands(("a", "b")) == ()


@pytest.mark.parametrize(
    ("args", "flag"),
    [((1, 2, 0.4), "--nodes 1"), ((2, 0, 0.4), "--ranks-per-node 0"),
     ((2, 2, 0.0), "--inter-gbps 0"), ((2, 2, 1.0, -1.0), "--latency-ms -1")],
)  # fmt: skip
def test_bad_specs_name_the_flag(args: tuple, flag: str) -> None:
    with pytest.raises(NetClusterError, match=flag):
        NetSpec(*args)


def test_cluster_file_loads_with_per_rank_inter_bandwidth() -> None:
    spec = NetSpec(3, 2, 0.4)
    data = cluster_json(spec, Measured(loopback_Bps=1.5e9, inter_Bps=4.8e7), memory_mb=500)
    cluster = cluster_from_json(data)
    assert cluster.num_ranks == 6
    topo = cluster.topology()
    assert topo.link(0, 1).name == "loopback" and topo.link(0, 1).bandwidth == 1.5e9
    assert topo.link(1, 2).name == "veth" and topo.link(1, 2).bandwidth == pytest.approx(2.4e7)
    assert data["netcluster"]["measured"]["ratio"] == pytest.approx(31.25)
    assert data["netcluster"]["master_addr"] == "10.213.0.1"


@pytest.mark.parametrize("module", ["spec", "describe"])
def test_doctests(module: str) -> None:
    import doctest
    import importlib

    assert doctest.testmod(importlib.import_module(f"hspmd.netcluster.{module}")).failed == 0


def test_a_nic_per_rank_gives_each_local_rank_a_subnet_and_a_shaped_veth() -> None:
    spec = NetSpec(2, 3, 0.4, nic_per_rank=True)
    assert spec.nics == ("nc0", "nc1", "nc2")
    assert [spec.address(1, k) for k in range(3)] == ["10.213.0.2", "10.213.1.2", "10.213.2.2"]
    lines = [render(c) for c in up_commands(spec)]
    assert sum(line.startswith("ip link add name nc") for line in lines) == 6
    assert "ip link add name nc2 netns hspmd-nc-n1 type veth peer name p1k2 netns " \
        "hspmd-nc-hub" in lines  # fmt: skip
    assert sum("htb rate 400mbit" in line for line in lines) == 12  # both ends of 6 veths
    assert sum("arp_ignore=1" in line for line in lines) == 4  # all + default, 2 nodes
    data = cluster_json(spec, Measured(loopback_Bps=1e9, inter_Bps=5e7), memory_mb=1)
    assert data["inter_link"]["GBps"] == 0.05  # not shared: one veth per rank
    assert data["netcluster"]["nics"] == ["nc0", "nc1", "nc2"]
