"""The plan files of hspmd (``hspmd.plan.choice``): what ``hspmd plan --out`` writes,
``hspmd train --plan`` (and explain, simulate) takes; each file names its format and its
model, and a file given to the wrong flag or for another model is one line naming the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hspmd.annotation import parse_annotation
from hspmd.checkpoint.store import save
from hspmd.cli import main
from hspmd.errors import StrategyError
from hspmd.models import get_model
from hspmd.plan.identity import ModelIdentity
from hspmd.plan.params import ParamSpec
from hspmd.train.api import train_config
from hspmd.train.trainer import check_config
from tests.planner.conftest import cluster_file

TWO = '{"num_layers": 2}'


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture
def strategy_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """``hspmd plan --out`` for a 2-layer llama-tiny on 4 local-sized ranks."""
    cluster = cluster_file(tmp_path / "c.json", fast=2, slow=2)
    out = tmp_path / "strategy.json"
    argv = ["plan", "--model", "llama-tiny", "--config", TWO, "--cluster", str(cluster),
            "--global-batch", "4", "--seq-len", "32", "--dtype", "fp32", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    return out


def test_train_takes_what_plan_writes(
    strategy_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = json.loads(strategy_file.read_text())
    assert data["format"] == "hspmd.strategy/1" and data["model"]["source"] == "llama-tiny"
    assert data["seq_len"] == 32 and data["global_batch"] == 4
    saved = tmp_path / "plan.json"  # the run of that strategy, as an annotation plan
    argv = ["train", "--config", TWO, "--plan", str(strategy_file), "--save-plan", str(saved)]
    assert main(argv) == 0, capsys.readouterr().err
    assert data["strategy"] in capsys.readouterr().out
    plan = json.loads(saved.read_text())
    assert plan["format"] == "hspmd.plan/1" and plan["strategy"] == data["strategy"]
    assert plan["model"] == data["model"] and plan["options"] == data["options"]
    assert plan["inputs"]["tokens"]["shape"][1] == 32
    for path in (strategy_file, saved):  # and the metadata commands take both
        assert main(["explain", "--model", "llama-tiny", "--config", TWO, "--plan", str(path)]) == 0
        capsys.readouterr()


def test_a_file_for_another_flag_names_the_flag(
    strategy_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lengths = tmp_path / "plans.json"
    lengths.write_text(json.dumps({"format": "hspmd.length-plans", "version": 1}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": None, "steps": 3}))
    cases = [
        (["train", "--plan", str(lengths)], f"give it to hspmd train as --plans {lengths}"),
        (["train", "--plans", str(strategy_file)], "a strategy file (format hspmd.strategy/1)"),
        (["train", "--plan", str(other)], "from hspmd plan --out) or an annotation plan"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in _err(capsys)


def test_a_plan_of_another_model_names_both(
    strategy_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "plan.json"
    assert (
        main(["train", "--config", TWO, "--plan", str(strategy_file), "--save-plan", str(saved)])
        == 0
    )
    capsys.readouterr()
    for path in (strategy_file, saved):
        assert main(["train", "--config", '{"num_layers": 3}', "--plan", str(path)]) == 2
        err = _err(capsys)
        assert "is for model llama-tiny {'num_layers': 2} (21 parameters" in err, err
        assert "this run's model is llama-tiny {'num_layers': 3} (30 parameters" in err, err


def test_files_of_hspmd_plan_before_formats_still_train(
    strategy_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = json.loads(strategy_file.read_text())
    for key in ("format", "options", "model", "seq_len", "global_batch"):
        del data[key]
    strategy_file.write_text(json.dumps(data))
    argv = ["train", "--config", TWO, "--plan", str(strategy_file), "--save-plan", "/dev/null"]
    assert main(argv) == 0, capsys.readouterr().err


def test_a_checkpoint_of_another_model_is_refused_before_launch(tmp_path: Path) -> None:
    two = ModelIdentity.of(get_model("llama-tiny", num_layers=2), source="llama-tiny",
                           kwargs={"num_layers": 2})  # fmt: skip
    w = ParamSpec("w", (2,), parse_annotation("[0]{}"))
    save(tmp_path, step=1, model="llama-tiny", strategy="1x1: R0:L0-1", specs={"w": w},
         tensors_by_rank={0: {"w": torch.zeros(2)}}, identity=two)  # fmt: skip
    config = train_config(strategy="1x1: R0:L0-2", global_batch=1, resume=str(tmp_path),
                         model_kwargs=(("num_layers", 3),))  # fmt: skip
    with pytest.raises(StrategyError, match=r"checkpoint .* is for model llama-tiny \{'num_l"):
        check_config(config)
    check_config(train_config(strategy="1x1: R0:L0-1", global_batch=1, resume=str(tmp_path),
                             model_kwargs=(("num_layers", 2),)))  # fmt: skip
