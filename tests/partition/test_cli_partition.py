"""`hspmd partition`: sizes, table and JSON output, placement file, clear errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hspmd.cli import partition as cli
from hspmd.errors import HspmdError, PartitionError
from hspmd.partition.graph import OpGraph
from hspmd.partition.io import read_placement, save_graph_json


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["partition", *argv])
    return int(args.func(args))


@pytest.fixture
def graph_file(tmp_path: Path) -> Path:
    num = 12
    edges = [(i, i + 1) for i in range(5)] + [(i, i + 1) for i in range(6, 11)] + [(5, 11)]
    g = OpGraph.build(
        "two_chains",
        [f"op{i}" for i in range(num)],
        time_us=[100.0] * num,
        out_bytes=[1000] * num,
        residual_bytes=[10**6] + [0] * (num - 1),
        edges=edges,
    )
    save_graph_json(tmp_path / "g.json", g)
    return tmp_path / "g.json"


def test_parse_size() -> None:
    assert cli.parse_size("16GiB") == 16 * 2**30
    assert cli.parse_size("500MB") == 500 * 10**6
    assert cli.parse_size("1.5kib") == 1536
    assert cli.parse_size("123") == 123
    with pytest.raises(PartitionError, match="16GiB"):
        cli.parse_size("lots")


def test_json_output_and_placement(graph_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = graph_file.parent / "p.txt"
    argv = [str(graph_file), "--devices", "2", "--memory", "64MiB", "--out", str(out), "--json"]
    assert _run(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["devices"] == 2 and summary["nodes"] == 12
    assert summary["makespan_us"] < 1200.0  # the two chains run side by side
    assert max(summary["peak_bytes"]) <= 64 * 2**20
    from hspmd.partition.io import load_graph

    place = read_placement(out, load_graph(graph_file))
    assert sorted(set(place.tolist())) == [0, 1]


def test_table_output(graph_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(graph_file), "--devices", "2", "--latency-us", "5", "--bandwidth-gbps", "10"]
    assert _run(argv) == 0
    text = capsys.readouterr().out
    assert "makespan" in text and "peak GiB" in text


def test_errors_say_what_is_missing(graph_file: Path) -> None:
    with pytest.raises(HspmdError, match="exceeds the sum of caps"):
        _run([str(graph_file), "--devices", "2", "--memory", "100KB"])
    with pytest.raises(HspmdError, match="3 sizes for 2 devices"):
        _run([str(graph_file), "--devices", "2", "--memory", "1GB,1GB,1GB"])
