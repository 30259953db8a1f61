"""The cost model: where each line comes from, and its figures by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import DEFAULT_EFFICIENCY, KERNEL_OVERHEAD_S, LINK_OVERHEAD_S, CostModel
from tests.planner.conftest import cluster_file


def test_achieved_tflops_sets_matmul_and_hbm_bounds_bytes(fake_cluster: Path) -> None:
    cost = CostModel.of(load_cluster(fake_cluster))
    fast = cost.device("fast")
    assert fast.seconds("matmul", 50e12) == pytest.approx(1.0 + KERNEL_OVERHEAD_S)
    assert fast.seconds("norm", 1e9) == pytest.approx(1e-3 + KERNEL_OVERHEAD_S)
    # slowdown multiplies compute, not links
    assert cost.device("slow").seconds("matmul", 50e12) == pytest.approx(
        3 * (1.0 + KERNEL_OVERHEAD_S)
    )
    assert "slowdown x3" in cost.describe()


def test_peak_times_the_default_efficiency_when_nothing_is_given(tmp_path: Path) -> None:
    path = cluster_file(tmp_path / "c.json", fast=2, slow=0)
    text = path.read_text().replace('"achieved_tflops": 50, ', "")
    path.write_text(text)
    device = CostModel.of(load_cluster(path)).device("fast")
    assert device.seconds("matmul", 1e12) == pytest.approx(
        1e12 / (DEFAULT_EFFICIENCY * 100e12) + KERNEL_OVERHEAD_S
    )
    assert "assumed" in device.source


def test_links_inside_a_node_and_between_nodes(fake_cluster: Path) -> None:
    cost = CostModel.of(load_cluster(fake_cluster))
    # ring all-reduce over 2 ranks moves 2*(n-1)/n * size = size bytes per rank
    assert cost.collective("all-reduce", 1e9, (0, 1)) == pytest.approx(
        1e9 / 100e9 + LINK_OVERHEAD_S
    )
    assert cost.collective("all-reduce", 1e9, (0, 2)) == pytest.approx(1e9 / 10e9 + LINK_OVERHEAD_S)
    assert cost.send(1e9, 1, 2) == pytest.approx(1e9 / 10e9 + LINK_OVERHEAD_S)
    assert cost.send(1e9, 3, 3) == 0.0
    assert cost.collective("all-reduce", 1e9, (0,)) == 0.0


def test_paper_testbed_figures_are_marked_assumed() -> None:
    cluster = load_cluster("hetu-h800-h20")
    assumed = dict(cluster.assumed)
    assert "achieved_tflops" in assumed and "hbm_GBps" in assumed
    cost = CostModel.of(cluster)
    h800, h20 = cost.device("H800"), cost.device("H20")
    ratio = h20.seconds("matmul", 1e15) / h800.seconds("matmul", 1e15)
    assert ratio == pytest.approx(495 / 74, rel=1e-4)  # plus one launch overhead


def _profiled_cluster(tmp_path: Path, *, kind: str, sharing: tuple[float, ...]) -> Path:
    """Four ranks on one node of a kind profiled on a ``kind`` ("cpu" / "cuda") host."""
    import json

    from hspmd.cost.profile import COLLECTIVE_OPS, COMPUTE_OPS, Fit, LinkFit, Profile

    groups = ((2, Fit(0.0, 1e-3, 1.0)),)
    profile = Profile(
        kind=kind, device=kind, dtype="float32", threads=1, created="-", host={},
        compute={op: Fit(1e-10, 0.0, 1.0) for op in COMPUTE_OPS},
        links={"loopback": {op: LinkFit(Fit(0.0, 4e-3, 1.0), 4, groups) for op in COLLECTIVE_OPS}},
        core_sharing=sharing,
    )  # fmt: skip
    (tmp_path / "p.json").write_text(profile.to_json())
    gpu = {"memory_mb": 1000, "bf16_tflops": 1, "profile": "p.json",
           "intra_link": {"name": "loopback", "GBps": 1}}  # fmt: skip
    data = {"format": "hspmd.cluster/1", "name": "c", "gpu_kinds": {"k": gpu},
            "inter_link": {"name": "loopback", "GBps": 1},
            "nodes": [{"kind": "k", "count": 1, "gpus_per_node": 4}]}  # fmt: skip
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    return path


def test_cpu_profile_shares_cores_per_node_and_gpus_do_not(
    tmp_path: Path, fake_cluster: Path
) -> None:
    cpu = CostModel.of(load_cluster(_profiled_cluster(tmp_path, kind="cpu", sharing=(1.0, 1.5))))
    assert {cpu.share_of(r) for r in range(4)} == {"cores:node0"}
    assert cpu.pools()["cores:node0"].factor(2) == 1.5
    assert "sharing cores" in cpu.describe()
    # the same factors in a CUDA profile, or a kind without a profile: no pool
    cuda = CostModel.of(load_cluster(_profiled_cluster(tmp_path, kind="cuda", sharing=(1.0, 1.5))))
    gpus = CostModel.of(load_cluster(fake_cluster))
    assert cuda.pools() == {} == gpus.pools() and gpus.share_of(0) == cuda.share_of(0) == ""


def test_link_seconds_use_the_fit_of_the_nearest_group_size(tmp_path: Path) -> None:
    cost = CostModel.of(load_cluster(_profiled_cluster(tmp_path, kind="cpu", sharing=())))
    assert cost.collective("all-reduce", 1e6, (0, 1)) == pytest.approx(1e-3)
    assert cost.collective("all-reduce", 1e6, (0, 1, 2, 3)) == pytest.approx(4e-3)
    assert "groups of 2, 4" in cost.describe()


def test_emulated_nodes_on_one_host_share_one_pool(tmp_path: Path) -> None:
    import json

    from hspmd.cost.cluster import ClusterError

    path = _profiled_cluster(tmp_path, kind="cpu", sharing=(1.0, 1.5))
    data = json.loads(path.read_text())
    data["nodes"] = [{"kind": "k", "count": 2, "gpus_per_node": 2}]
    data["inter_link"] = {"name": "veth", "GBps": 0.05}
    path.write_text(json.dumps(data))
    apart = CostModel.of(load_cluster(path))
    assert [apart.share_of(r) for r in range(4)] == ["cores:node0"] * 2 + ["cores:node1"] * 2
    path.write_text(json.dumps({**data, "one_host": True}))
    together = CostModel.of(load_cluster(path))
    assert {together.share_of(r) for r in range(4)} == {"cores:host"}
    assert list(together.pools()) == ["cores:host"]
    # the veth has no profile: its bytes at its bandwidth, each call at the profiled
    # loopback's fixed cost for that group size (4 ms over 4 ranks, 1 ms over 2)
    seconds = together.collective("all-reduce", 1e6, (0, 2))  # across the two nodes
    assert seconds == pytest.approx(1e-3 + 2 * 0.5 * 1e6 / 0.05e9)
    assert "per-call overheads of k's profile" in together.describe()
    path.write_text(json.dumps({**data, "one_host": "yes"}))
    with pytest.raises(ClusterError, match="'one_host' is 'yes'"):
        load_cluster(path)


def test_a_shared_inter_link_is_split_among_the_flows_leaving_a_node(tmp_path: Path) -> None:
    import json

    from hspmd.cost.cluster import ClusterError

    path = cluster_file(tmp_path / "c.json", fast=4, slow=0)  # 2 nodes of 2, 10 GB/s a GPU
    per_gpu = CostModel.of(load_cluster(path))
    data = json.loads(path.read_text())
    data["inter_link"]["shared"] = True  # one 20 GB/s link a node, e.g. an emulated node's veth
    path.write_text(json.dumps(data))
    shared = CostModel.of(load_cluster(path))
    ring = (0, 1, 2, 3)  # one flow leaves each node: the whole node's link
    moved = 2 * 3 / 4 * 1e9  # ring all-reduce bytes per rank
    assert per_gpu.collective("all-reduce", 1e9, ring) == pytest.approx(
        moved / 10e9 + LINK_OVERHEAD_S
    )
    assert shared.collective("all-reduce", 1e9, ring) == pytest.approx(
        moved / 20e9 + LINK_OVERHEAD_S
    )
    # two rings side by side (the TP shards of a gradient sync): two flows split it
    assert shared.collective("all-reduce", 1e9, (0, 2), 2) == pytest.approx(
        per_gpu.collective("all-reduce", 1e9, (0, 2), 2)
    )
    # (0, 2, 1, 3) crosses four times: two flows leave each node
    assert shared.collective("all-reduce", 1e9, (0, 2, 1, 3)) == pytest.approx(
        moved / 10e9 + LINK_OVERHEAD_S
    )
    assert shared.collective("all-reduce", 1e9, (0, 1)) == per_gpu.collective(
        "all-reduce", 1e9, (0, 1)
    )
    data["inter_link"]["shared"] = "yes"
    path.write_text(json.dumps(data))
    with pytest.raises(ClusterError, match="inter_link.shared is 'yes'"):
        load_cluster(path)


def _profile_with_link(path: Path, link: str, *, slope: float, overhead: float) -> Path:
    """A profile whose compute lines are placeholders and whose ``link`` was timed across
    nodes (``hspmd profile --nnodes``): one line for rings of 4 and of 2."""
    from hspmd.cost.profile import COLLECTIVE_OPS, COMPUTE_OPS, Fit, LinkFit, Profile

    line = Fit(slope, overhead, 1.0)
    profile = Profile(
        kind="cpu", device="cpu", dtype="float32", threads=1, created="-", host={},
        compute={op: Fit(1e-12, 1e-5, 1.0) for op in COMPUTE_OPS},
        links={link: {op: LinkFit(line, 4, ((2, line),)) for op in COLLECTIVE_OPS}},
    )  # fmt: skip
    path.write_text(profile.to_json())
    return path


@pytest.mark.parametrize("shared", [True, False])
def test_a_link_measured_across_nodes_is_one_flows(tmp_path: Path, shared: bool) -> None:
    """A file's inter bandwidth is per rank; fits timed across nodes over rings with one
    flow leaving each node are one flow's: a ring gets them whole, rings side by side split
    them, and a send gets a rank's share of a shared link."""
    import json

    path = cluster_file(tmp_path / "c.json", fast=4, slow=0)  # 2 nodes of 2
    profile = _profile_with_link(tmp_path / "p.json", "ib", slope=1e-9, overhead=2e-3)
    data = json.loads(path.read_text())
    data["inter_link"]["shared"] = shared
    data["gpu_kinds"]["fast"]["profile"] = str(profile)
    path.write_text(json.dumps(data))
    cost = CostModel.of(load_cluster(path))
    moved = 2 * 3 / 4 * 1e9  # ring all-reduce bytes per rank
    assert cost.collective("all-reduce", 1e9, (0, 1, 2, 3)) == pytest.approx(2e-3 + moved * 1e-9)
    two = 2 * 1 / 2 * 1e9
    side_by_side = 2 if shared else 1  # two flows leave each node
    assert cost.collective("all-reduce", 1e9, (0, 2), 2) == pytest.approx(
        2e-3 + two * 1e-9 * side_by_side
    )
    share = 2 if shared else 1  # a node's two ranks share its one link
    assert cost.send(1e9, 0, 2) == pytest.approx(2e-3 + 1e9 * 1e-9 * share)
    assert "profile of fast" in cost.links["ib"].source
