"""`--picture` of `hspmd explain` and `hspmd switch-cost`: valid PNG/SVG files, one-line errors."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from hspmd.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = "3x1: R0-1:L0-1 R2:L2-3; 1x2: R3:L0-3"
EXPLAIN = ["explain", "--model", "llama-tiny", "--strategy", TINY]
SWITCH = [
    "switch-cost", "--model", "llama-tiny", "--cluster", "h20x32", "--failed", "3",
    "--from", "2x1: R0-1:L0-3; 2x1: R2-3:L0-3", "--to", "1x1: R8-9:L0-1 R4:L2-3",
]  # fmt: skip


def assert_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC
    height, width, channels = matplotlib.image.imread(path).shape
    assert height > 100 and width > 100 and channels in (3, 4)


def assert_svg(path: Path) -> ET.Element:
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    return root


def test_explain_png_with_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.png"
    assert main([*EXPLAIN, "--cluster", "hetu-h800-h20", "--picture", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"picture: {out}" in text
    assert "rank 3 (H800): pipeline 1" in text
    assert_png(out)


def test_explain_svg_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    out = tmp_path / "plan.svg"
    assert main([*EXPLAIN, "--cluster", "h20x32", "--json", "--picture", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)  # still exactly one JSON object
    assert {r["gpu_kind"] for r in data["ranks"]} == {"H20"}
    assert data["gradient_sync_by_layers"] == [  # TP2 + TP1, then TP1 + TP1
        {"layers": [0, 1], "kinds": ["split-all-reduce"]},
        {"layers": [2, 3], "kinds": ["all-reduce"]},
    ]
    assert_svg(out)


def test_switch_cost_png_and_svg(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png, svg = tmp_path / "switch.png", tmp_path / "switch.svg"
    assert main([*SWITCH, "--algo", "relay", "--picture", str(png)]) == 0
    assert f"picture: {png}" in capsys.readouterr().out
    assert_png(png)
    assert main([*SWITCH, "--algo", "per-tensor", "--json", "--picture", str(svg)]) == 0
    assert capsys.readouterr().out.startswith("{")
    assert_svg(svg)


@pytest.mark.parametrize("argv", [EXPLAIN, SWITCH], ids=["explain", "switch-cost"])
def test_bad_extension_one_line(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "plan.jpg"
    assert main([*argv, "--picture", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert repr(str(bad)) in err and "plan.png or plan.svg" in err
    assert not bad.exists()


def test_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "nowhere" / "plan.png"
    assert main([*EXPLAIN, "--picture", str(out)]) == 2
    err = capsys.readouterr().err
    assert "does not exist: create it first" in err and err.count("\n") == 1


def test_cluster_too_small(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["explain", "--model", "llama-tiny", "--strategy", "1x1: R31-32:L0-3"]
    assert main([*argv, "--cluster", "h20x32"]) == 2
    assert "has 32 ranks" in capsys.readouterr().err


def test_matplotlib_only_when_drawing() -> None:
    code = (
        "import sys; from hspmd.cli import build_parser; build_parser(); "
        "import hspmd.viz; assert 'matplotlib' not in sys.modules, 'imported eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_partition_png_and_single_device_makespan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from hspmd.partition.generate import layered_graph
    from hspmd.partition.io import save_graph_json

    graph = tmp_path / "g.json"
    save_graph_json(graph, layered_graph(400, seed=1))
    out = tmp_path / "placement.png"
    argv = ["partition", str(graph), "--devices", "3", "--memory", "1GiB", "--picture", str(out)]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["picture"] == str(out)
    assert data["single_device_makespan_us"] >= data["makespan_us"] > 0
    assert_png(out)
    assert main(argv) == 0
    assert "(one device: " in capsys.readouterr().out
    bad = tmp_path / "placement.gif"
    assert main([*argv[:-1], str(bad)]) == 2  # refused before partitioning
    assert "placement.png or placement.svg" in capsys.readouterr().err
