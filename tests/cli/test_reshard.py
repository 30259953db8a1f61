"""`hspmd reshard`: text and JSON plans, simulated and multi-process dumps, clean errors."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import numpy as np
import pytest

from hspmd.annotation import parse_annotation
from hspmd.cli import main

SRC, DST, SHAPE = "[0,1,2,3]{P:2,0:2}", "h0: [0,1]{D:2} [2,3]{1:2}", "8,12"


def _expected(dst: str, shape: tuple[int, ...]) -> dict[int, np.ndarray]:
    value = np.arange(math.prod(shape), dtype=np.float64).reshape(shape)
    pieces = parse_annotation(dst).pieces(shape)
    return {r: value[tuple(slice(a, b) for a, b in p.region)] for r, p in pieces.items()}


def test_text_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reshard", "--src", SRC, "--dst", DST, "--shape", SHAPE]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"reshard {SRC} -> {DST} shape=[8, 12]")
    assert "rank 0: [0:4,0:12] -> [0:4,0:12]" in out
    assert "0: all-reduce group=[0,2]" in out
    assert "send [0:4,0:6] to 1" in out


def test_json_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reshard", "--src", SRC, "--dst", DST, "--shape", SHAPE, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kinds"] == ["all-reduce", "bsr"]
    assert data["steps"][0]["groups"] == [[0, 2], [1, 3]]
    assert data["per_rank"]["2"]["dst"] == [[4, 8], [0, 6]]


@pytest.mark.parametrize(
    ("src", "dst", "shape"),
    [
        (SRC, DST, (8, 12)),
        ("hP: [0,1]{1:2} [2,3,4,5]{1:4}", "hD: [0,1]{1:2} [2,3,4,5]{1:4}", (4, 8)),
        ("[0,1]{0:2}", "[2,3,4]{2:3}", (2, 4, 6)),
    ],
)
def test_simulate_dump(tmp_path: Path, src: str, dst: str, shape: tuple[int, ...]) -> None:
    args = ["reshard", "--src", src, "--dst", dst, "--shape", ",".join(map(str, shape))]
    assert main([*args, "--simulate", "--dump", str(tmp_path)]) == 0
    expected = _expected(dst, shape)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"rank{r}.npy" for r in expected)
    for rank, want in expected.items():
        got = np.load(tmp_path / f"rank{rank}.npy")
        if parse_annotation(dst).hdim != -2:
            np.testing.assert_allclose(got, want)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--src", "[0,1,2]{0:3}", "--dst", "[0]{}", "--shape", "8,12"], "does not divide"),
        (["--src", "[0,1]{0:2}", "--dst", "[0]{", "--shape", "8,12"], "cannot read"),
        (["--src", "[0]{}", "--dst", "[1]{}", "--shape", "8,x"], "bad --shape"),
        (["--src", "[0,1]{2:2}", "--dst", "[1]{}", "--shape", "8"], "has 1 dims"),
    ],
)
def test_errors_are_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["reshard", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("hspmd reshard: error:")


def test_nproc_without_runtime(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.import_module

    def fake_import(name: str, package: str | None = None) -> object:
        if name == "hspmd.runtime.plan_runs":
            raise ImportError("No module named 'hspmd.runtime.plan_runs'")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    args = ["reshard", "--src", "[0]{}", "--dst", "[1]{}", "--shape", "4", "--nproc", "2"]
    assert main(args) == 2
    assert "--nproc needs hspmd.runtime.plan_runs" in capsys.readouterr().err


@pytest.mark.multiproc
def test_nproc_dump_matches_simulator(tmp_path: Path) -> None:
    args = ["reshard", "--src", SRC, "--dst", DST, "--shape", SHAPE]
    assert main([*args, "--simulate", "--dump", str(tmp_path / "sim")]) == 0
    assert main([*args, "--nproc", "4", "--dump", str(tmp_path / "proc")]) == 0
    for rank in range(4):
        np.testing.assert_allclose(
            np.load(tmp_path / "proc" / f"rank{rank}.npy"),
            np.load(tmp_path / "sim" / f"rank{rank}.npy"),
        )


def test_simulate_with_nproc_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # Issue 17: both were accepted and the output did not say which one ran.
    args = ["reshard", "--src", SRC, "--dst", DST, "--shape", SHAPE]
    assert main([*args, "--simulate", "--nproc", "4"]) == 2
    err = capsys.readouterr().err
    assert "--simulate and --nproc 4 both run the plan" in err and err.count("\n") == 1


def test_simulate_says_it_ran_in_the_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reshard", "--src", SRC, "--dst", DST, "--shape", SHAPE, "--simulate"]) == 0
    out = capsys.readouterr().out
    assert "ran in the numpy simulator\nrank 0: shape [4, 12]" in out


def test_text_plan_has_no_step_that_moves_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    # Issue 17: rank 2 only copied its own piece, printed `bsr copy=1 send_to=[] recv_from=[]`.
    args = ["reshard", "--src", "[2,1]{D:2}", "--dst", "hP: [2,1]{D:2} [0]{}", "--shape", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "send_to=[] recv_from=[]" not in out
    assert "rank 2: [0:8] -> [0:8]\n    1: local slice" in out
