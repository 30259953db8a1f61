"""The cost model: where each line comes from, and its figures by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from hspmd.planner.cost import DEFAULT_EFFICIENCY, KERNEL_OVERHEAD_S, LINK_OVERHEAD_S, CostModel
from hspmd.switch.cluster import load_cluster
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
