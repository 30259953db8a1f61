"""Small fake clusters for planner tests, written as real cluster files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


def cluster_file(
    path: Path, *, fast: int, slow: int, per_node: int = 2, slowdown: float = 3.0,
    memory_mb: float = 80000,
) -> Path:  # fmt: skip
    """``fast`` ranks of kind "fast" then ``slow`` ranks of kind "slow" (``slowdown`` x)."""
    kinds: dict[str, Any] = {
        "fast": {"memory_mb": memory_mb, "bf16_tflops": 100, "achieved_tflops": 50,
                 "hbm_GBps": 1000, "intra_link": {"name": "nvlink", "GBps": 100}},
    }  # fmt: skip
    nodes = [{"kind": "fast", "count": fast // per_node, "gpus_per_node": per_node}]
    if slow:
        kinds["slow"] = dict(kinds["fast"], slowdown=slowdown)
        nodes.append({"kind": "slow", "count": slow // per_node, "gpus_per_node": per_node})
    data = {
        "format": "hspmd.cluster/1", "name": f"fake-{fast}f{slow}s", "gpu_kinds": kinds,
        "inter_link": {"name": "ib", "GBps": 10}, "nodes": nodes,
    }  # fmt: skip
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def fake_cluster(tmp_path: Path) -> Path:
    return cluster_file(tmp_path / "fake.json", fast=2, slow=2)
