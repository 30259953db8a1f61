"""Cluster files: the shipped testbeds, the topology they give, malformed files refused."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from hspmd.cost.cluster import ClusterError, cluster_from_json, load_cluster, shipped_clusters


def test_shipped_clusters() -> None:
    assert {"hetu-h800-h20", "h20x32"} <= set(shipped_clusters())
    hetero = load_cluster("hetu-h800-h20")
    assert hetero.num_ranks == 48
    assert [hetero.kind_of(r).name for r in (0, 15, 16, 47)] == ["H800", "H800", "H20", "H20"]
    assert hetero.kind("H800").bf16_tflops == 990 and hetero.kind("H20").memory_mb == 97871
    assert any(field.startswith("inter_link") for field, _ in hetero.assumed)
    topo = hetero.topology()
    assert len(topo.nodes) == 6 and topo.nodes[2].ranks == tuple(range(16, 24))
    assert topo.bandwidth(0, 7) == 200e9 and topo.bandwidth(16, 23) == 450e9
    assert topo.link(7, 8).name == "ib" and topo.bandwidth(15, 16) == 50e9
    assert load_cluster("h20x32").num_ranks == 32


def test_shipped_cluster_names_a_measured_profile_beside_it() -> None:
    from hspmd.cost.lines import CostModel

    cost = CostModel.of(load_cluster("h200x8"))  # its profile: clusters/profiles/
    assert "NVIDIA H200" in cost.describe()
    # the measured bf16 matmul rate: 1 PFLOP in 1.2-1.6 s (0.6-0.85 of the 989 peak)
    assert 1.2 < cost.device("H200").seconds("matmul", 1e15) < 1.6


def test_load_by_path(tmp_path: Path) -> None:
    data = json.loads((resources.files("hspmd") / "clusters" / "h20x32.json").read_text())
    data["nodes"][0]["count"] = 2
    path = tmp_path / "small.json"
    path.write_text(json.dumps(data))
    assert load_cluster(path).num_ranks == 16
    assert load_cluster(str(path)).name == "h20x32"


GOOD = {
    "format": "hspmd.cluster/1",
    "gpu_kinds": {"A": {"memory_mb": 1, "bf16_tflops": 1, "intra_link": {"name": "nv", "GBps": 1}}},
    "inter_link": {"name": "ib", "GBps": 1},
    "nodes": [{"kind": "A", "count": 1, "gpus_per_node": 2}],
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "x"}, "format"),
        ({"nodes": []}, "'nodes' is empty"),
        ({"nodes": [{"kind": "B", "count": 1, "gpus_per_node": 2}]}, "nodes[0].kind"),
        ({"nodes": [{"kind": "A", "count": 0, "gpus_per_node": 2}]}, "nodes[0].count"),
        ({"inter_link": {"name": "ib", "GBps": -1}}, "inter_link.GBps"),
        ({"gpu_kinds": {"A": {"memory_mb": 1}}}, "gpu_kinds.A"),
        ({"inter_link": None}, "'inter_link' must be"),
    ],
)
def test_malformed(change: dict[str, object], message: str) -> None:
    cluster_from_json(GOOD)
    with pytest.raises(ClusterError, match=message.replace("[", r"\[").replace("]", r"\]")):
        cluster_from_json({**GOOD, **change})


def test_unknown_name_and_not_json(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="shipped names"):
        load_cluster("no-such-cluster")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ClusterError, match="not JSON"):
        load_cluster(bad)
    with pytest.raises(ClusterError, match="rank 2"):
        cluster_from_json(GOOD).kind_of(2)
