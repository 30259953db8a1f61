"""`hspmd simulate` and `hspmd plan` for any model: a file the test writes (issue 12)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hspmd.cli import main
from hspmd.models.module import load_model
from hspmd.plan.strategy import check_strategy, parse_strategy
from tests.cost.test_captured import MODEL
from tests.planner.conftest import cluster_file


@pytest.fixture
def model_file(tmp_path: Path) -> str:
    path = tmp_path / "net.py"
    path.write_text(MODEL)
    return f"{path}:make"


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_simulate_and_plan(
    model_file: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = str(cluster_file(tmp_path / "c.json", fast=4, slow=4, per_node=4))
    common = ["--model", model_file, "--config", '{"num_layers": 4}', "--cluster", cluster,
              "--seq-len", "32", "--json"]  # fmt: skip
    strategy = "2x2: R0-1:L0-1 R4:L2-3; 4x1: R2-3:L0-3"
    assert main(["simulate", *common, "--strategy", strategy]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (
        data["fits"] and data["step_time_s"] > 0 and set(data["ranks"]) == {"0", "1", "2", "3", "4"}
    )
    assert main(["plan", *common, "--global-batch", "8"]) == 0
    chosen = json.loads(capsys.readouterr().out)
    # 24 hidden, 96 FFN and 30 tokens on nodes of 4: TP 1 or 2 only
    planned = parse_strategy(chosen["strategy"])
    assert {stage.tp for _, _, stage in planned.stages()} <= {1, 2}
    check_strategy(planned, load_model(model_file, {"num_layers": 4}), seq_len=32)
    assert main(["simulate", *common, "--strategy", "1x1: R0-3:L0-3"]) == 2  # TP 4
    assert "does not divide head.weight dim 0=30" in _err(capsys)


def test_simulate_from_a_plan_file(
    model_file: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from hspmd.cli import train

    parser = argparse.ArgumentParser(prog="hspmd")
    train.register(parser.add_subparsers(dest="command", required=True))
    plan = tmp_path / "plan.json"
    strategy = "2x1: R0-1:L0-1 R2:L2-3; 2x1: R3:L0-3"
    args = parser.parse_args(["train", "--model", model_file, "--seq-len", "16",
                              "--strategy", strategy, "--save-plan", str(plan)])  # fmt: skip
    assert args.func(args) == 0
    capsys.readouterr()
    cluster = str(cluster_file(tmp_path / "c.json", fast=4, slow=0))
    base = ["simulate", "--model", model_file, "--cluster", cluster, "--json"]
    assert main([*base, "--plan", str(plan)]) == 0
    from_plan = json.loads(capsys.readouterr().out)
    assert main([*base, "--strategy", strategy, "--seq-len", "16", "--dtype", "fp32"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] == from_plan["step_time_s"]


def test_uncostable_model_is_one_line(
    model_file: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = str(cluster_file(tmp_path / "c.json", fast=2, slow=0))
    argv = ["simulate", "--model", model_file, "--config", '{"max_seq_len": 1}',
            "--cluster", cluster, "--strategy", "1x1: R0:L0-3"]  # fmt: skip
    assert main(argv) == 2
    assert "max_seq_len=1 is below its TP degree 2: hspmd cannot measure" in _err(capsys)
