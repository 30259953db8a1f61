"""The emulator reproduces the published figures of data/pardnn exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hspmd.errors import PartitionError
from hspmd.partition.emulate import CommModel, emulate, memory_peaks, schedule
from hspmd.partition.graph import OpGraph
from hspmd.partition.io import load_graph, read_placement

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "pardnn"
needs_data = pytest.mark.skipif(
    not (DATA / "results_authors_vs_baselines.json").exists(),
    reason=f"shared ParDNN graphs not found at {DATA}",
)


def _published() -> list[dict]:
    path = DATA / "results_authors_vs_baselines.json"
    if not path.exists():
        return []
    rows = json.loads(path.read_text())
    return [r for r in rows if (DATA / f"{r['graph']}.json").exists()]


_GRAPHS: dict[str, OpGraph] = {}


def _graph(name: str) -> OpGraph:
    if name not in _GRAPHS:
        _GRAPHS[name] = load_graph(DATA / f"{name}.json")
    return _GRAPHS[name]


def _unknown_sizes(name: str) -> int:
    """Ops whose size the source gave as -1: the figures count them as -1 byte, we as 0."""
    doc = json.loads((DATA / f"{name}.json").read_text())
    return sum(1 for n in doc["nodes"] if n["out_bytes"] < 0)


def _check(graph: OpGraph, place: np.ndarray, k: int, row: dict, who: str) -> None:
    em = emulate(graph, place)
    assert em.makespan_us == pytest.approx(row[f"{who}_makespan_us"], rel=1e-6)
    assert int(em.peak_bytes.max()) == row[f"{who}_peak_max_bytes"]
    slack = _unknown_sizes(row["graph"]) * (k - 1)
    assert abs(em.comm_bytes - row[f"{who}_comm_bytes"]) <= slack


@needs_data
@pytest.mark.parametrize("row", _published(), ids=lambda r: f"{r['graph']}-K{r['K']}")
def test_reproduces_authors_and_round_robin(row: dict) -> None:
    graph, k = _graph(row["graph"]), row["K"]
    authors = read_placement(DATA / f"{row['graph']}.authors-{k}.place", graph)
    _check(graph, authors, k, row, "authors")
    rr = np.empty(graph.num_nodes, dtype=np.int64)
    rr[graph.topo_order] = np.arange(graph.num_nodes) % k
    _check(graph, rr, k, row, "rr")
    single = emulate(graph, np.zeros(graph.num_nodes, dtype=np.int64))
    assert single.makespan_us == pytest.approx(row["single_makespan_us"], rel=1e-6)
    assert int(single.peak_bytes[0]) == row["single_peak_bytes"]


def _chain() -> OpGraph:
    # a -> b -> c, plus a -> c; 1 MB outputs; residual on a
    return OpGraph.build(
        "chain",
        ("a", "b", "c"),
        time_us=[10.0, 20.0, 30.0],
        out_bytes=[1_400_000, 2_800_000, 0],
        residual_bytes=[100, 0, 0],
        edges=[(0, 1), (1, 2), (0, 2)],
    )


def test_times_and_transfers_by_hand() -> None:
    g = _chain()
    em = emulate(g, np.array([0, 1, 0]))
    # a: 0-10; b waits for a's output: 10 + 25 + 10 = 45, runs 45-65;
    # c waits for b's output: 65 + 25 + 20 = 110, runs 110-140
    assert em.start_us.tolist() == [0.0, 45.0, 110.0]
    assert em.makespan_us == 140.0
    assert em.comm_bytes == 1_400_000 + 2_800_000
    # device 0: residual 100; a's output is a residual op's state (not counted again);
    # b's copy arrives at its finish (65) and lives until c starts (110)
    assert em.peak_bytes.tolist() == [100 + 2_800_000, 1_400_000 + 2_800_000]


def test_ready_order_breaks_ties_by_topological_index() -> None:
    g = OpGraph.build(
        "fan",
        ("s", "x", "y"),
        time_us=[1.0, 5.0, 5.0],
        out_bytes=[0, 0, 0],
        residual_bytes=[0, 0, 0],
        edges=[(0, 2), (0, 1)],
    )
    # successors keep their input order: y (index 2) is listed first, so it runs first
    start, _ = schedule(g, np.zeros(3, dtype=np.int64))
    assert start.tolist() == [0.0, 6.0, 1.0]


def test_peaks_of_a_single_device_and_comm_model() -> None:
    g = _chain()
    start, finish = schedule(g, np.zeros(3, dtype=np.int64), comm=CommModel(0.0, 1.0))
    peaks = memory_peaks(g, np.zeros(3, dtype=np.int64), start=start, finish=finish)
    assert peaks.tolist() == [100 + 2_800_000]
    assert str(CommModel()) == "25 us + bytes / 140000 B/us"
    with pytest.raises(PartitionError, match="bandwidth"):
        CommModel(bytes_per_us=0.0)


def test_rejects_bad_placements() -> None:
    g = _chain()
    with pytest.raises(PartitionError, match="3 device ids"):
        emulate(g, np.array([0, 1]))
    with pytest.raises(PartitionError, match="ids start at 0"):
        emulate(g, np.array([0, -1, 0]))
