"""Graph and placement files: JSON round trip, the authors' formats."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hspmd.errors import PartitionError
from hspmd.partition.graph import OpGraph
from hspmd.partition.io import (
    load_authors_graph,
    load_graph,
    read_placement,
    save_graph_json,
    write_placement,
)


def _graph() -> OpGraph:
    return OpGraph.build(
        "tiny",
        ("v", "v/read", "mm", "assign"),
        time_us=[1.0, 2.0, 30.0, 4.0],
        out_bytes=[64, 64, 128, 0],
        residual_bytes=[64, 0, 0, 0],
        edges=[(0, 1), (1, 2), (0, 3), (2, 3)],
        colocate=[-1, -1, -1, 0],
    )


def test_json_round_trip(tmp_path: Path) -> None:
    g = _graph()
    save_graph_json(tmp_path / "g.json", g)
    back = load_graph(tmp_path / "g.json")
    assert back.names == g.names and back.name == "tiny"
    for field in ("time_us", "out_bytes", "residual_bytes", "src", "dst", "colocate"):
        assert np.array_equal(getattr(back, field), getattr(g, field))


def test_placement_round_trip_and_errors(tmp_path: Path) -> None:
    g = _graph()
    write_placement(tmp_path / "p.txt", g, np.array([0, 1, 1, 0]), header="made by a test")
    text = (tmp_path / "p.txt").read_text()
    assert text.startswith("# made by a test\nv 0\n")
    assert read_placement(tmp_path / "p.txt", g).tolist() == [0, 1, 1, 0]
    (tmp_path / "bad.txt").write_text("v 0\nnope 1\n")
    with pytest.raises(PartitionError, match="'nope' is not in graph"):
        read_placement(tmp_path / "bad.txt", g)
    (tmp_path / "short.txt").write_text("v 0\n")
    with pytest.raises(PartitionError, match="3 ops have no device"):
        read_placement(tmp_path / "short.txt", g)


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(PartitionError, match="does not exist"):
        load_graph(tmp_path / "none.json")
    (tmp_path / "g.txt").write_text("")
    with pytest.raises(PartitionError, match=r"\.json or \.dot"):
        load_graph(tmp_path / "g.txt")
    (tmp_path / "bad.json").write_text('{"nodes": [{"time_us": 1}]}')
    with pytest.raises(PartitionError, match="schema"):
        load_graph(tmp_path / "bad.json")


def test_authors_dot_and_side_files(tmp_path: Path) -> None:
    (tmp_path / "net.dot").write_text(
        'digraph G {\nsrc->"W";\n"W"->"W/read";\nW/read->MatMul;\nW->W/Assign;\nMatMul->snk;\n}\n'
    )
    (tmp_path / "nodes_average_durations.txt").write_text("w::3\nmatmul::40\nw/assign::5\n")
    (tmp_path / "tensors_sz.txt").write_text("w::4096\nw/read::4096\nmatmul::-1\n")
    (tmp_path / "var_nodes.txt").write_text("w\n")
    (tmp_path / "ref_nodes.txt").write_text("w/assign\n")
    g = load_graph(tmp_path / "net.dot")
    assert g.names == ("W", "W/read", "MatMul", "W/Assign")
    assert g.time_us.tolist() == [3.0, 1.0, 40.0, 5.0]
    assert g.out_bytes.tolist() == [4096, 4096, 0, 0]
    assert g.residual_bytes.tolist() == [4096, 0, 0, 0]
    assert g.colocate.tolist() == [-1, -1, -1, 0]
    (tmp_path / "collocations.txt").write_text("w/read::matmul\n")
    (tmp_path / "memory.txt").write_text("w::8192\n")
    g2 = load_authors_graph(tmp_path / "net.dot")
    assert g2.colocate.tolist() == [-1, -1, 1, 0]
    assert g2.residual_bytes.tolist() == [8192, 0, 0, 0]


def test_a_graph_file_that_is_not_json_is_a_partition_error(tmp_path: Path) -> None:
    bad = tmp_path / "g.json"
    bad.write_text("not json")
    with pytest.raises(PartitionError, match="cannot be read as JSON"):
        load_graph(bad)
