"""The compiled kernels (numba, optional) give exactly the pure-Python results."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from hspmd.partition import native
from hspmd.partition.eft import eft_placement
from hspmd.partition.emulate import CommModel, emulation_of, schedule
from hspmd.partition.generate import layered_graph
from hspmd.partition.graph import longest_paths
from hspmd.partition.io import load_graph
from hspmd.partition.pardnn import partition

# partition(layered_graph(3000, seed=1), num_devices=K) at commit 37131c0 (pure Python):
# sha256 of the placement as int64 (first 16 hex digits), and the emulated makespan
FINGERPRINTS = {
    2: ("25701f784b9d1cc4", 131254.2013214285),
    4: ("3c77d66a613e28ea", 122604.10030714287),
}


@pytest.fixture(scope="module")
def graph():  # type: ignore[no-untyped-def]
    return layered_graph(3000, seed=1)


@pytest.mark.parametrize("k", [2, 4])
def test_partition_matches_the_stored_fingerprint(graph, k: int) -> None:  # type: ignore[no-untyped-def]
    result = partition(graph, num_devices=k)
    digest = hashlib.sha256(result.placement.astype(np.int64).tobytes()).hexdigest()[:16]
    assert (digest, result.emulation.makespan_us) == FINGERPRINTS[k]


def _both(monkeypatch: pytest.MonkeyPatch, run):  # type: ignore[no-untyped-def]
    if not native.ENABLED:
        pytest.skip("numba is not installed: only the pure-Python path exists")
    compiled = run()
    monkeypatch.setattr(native, "ENABLED", False)
    reference = run()
    monkeypatch.setattr(native, "ENABLED", True)
    return compiled, reference


def test_kernels_equal_the_python_loops(graph, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    place = rng.integers(0, 3, graph.num_nodes)
    alive = rng.random(graph.num_nodes) < 0.7
    edge = rng.random(graph.num_edges) * 50.0
    comm = CommModel(latency_us=5.0, bytes_per_us=1e4)
    up = longest_paths(graph, node_w=graph.time_us, edge_w=edge)[1]

    def run():  # type: ignore[no-untyped-def]
        return (
            longest_paths(graph, node_w=graph.time_us, edge_w=edge),
            longest_paths(graph, node_w=graph.time_us, edge_w=edge, alive=alive),
            schedule(graph, place, comm=comm),
            eft_placement(graph, num_devices=3, comm=comm),
            eft_placement(graph, num_devices=4, comm=comm, priority=-up),
            partition(graph, num_devices=3, comm=comm).placement,  # mapping, refinement
        )

    compiled, reference = _both(monkeypatch, run)
    for got, want in zip(compiled, reference, strict=True):
        for a, b in zip(
            got if isinstance(got, tuple) else (got,),
            want if isinstance(want, tuple) else (want,),
            strict=True,
        ):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)


DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "pardnn"


@pytest.mark.skipif(not (DATA / "widedeep.json").exists(), reason=f"no shared graphs at {DATA}")
def test_authors_graph_same_placement_and_makespan(monkeypatch: pytest.MonkeyPatch) -> None:
    g = load_graph(DATA / "widedeep.json")  # colocation groups, 3480 ops

    def run():  # type: ignore[no-untyped-def]
        r = partition(g, num_devices=4)
        return r.placement, r.emulation.makespan_us

    (place, makespan), (ref_place, ref_makespan) = _both(monkeypatch, run)
    np.testing.assert_array_equal(place, ref_place)
    assert makespan == ref_makespan


@pytest.mark.skipif(not (DATA / "vgg.json").exists(), reason=f"no shared graphs at {DATA}")
def test_capped_authors_graph_same_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    g = load_graph(DATA / "vgg.json")  # memory repair: schedules and level passes
    single = schedule(g, np.zeros(g.num_nodes, dtype=np.int64))
    cap = int(
        0.8
        * emulation_of(
            g, np.zeros(g.num_nodes, np.int64), start=single[0], finish=single[1]
        ).peak_bytes.max()
    )

    def run():  # type: ignore[no-untyped-def]
        r = partition(g, num_devices=2, memory_bytes=cap)
        return r.placement, r.emulation.makespan_us

    (place, makespan), (ref_place, ref_makespan) = _both(monkeypatch, run)
    np.testing.assert_array_equal(place, ref_place)
    assert makespan == ref_makespan
