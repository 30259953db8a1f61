"""`hspmd train --resume` when the checkpoint is already at or past ``--steps`` (issue 17)."""

from __future__ import annotations

import re

import torch

from hspmd.annotation import parse_annotation as A
from hspmd.checkpoint.store import save
from hspmd.cli import main
from hspmd.cli import train as train_cli
from hspmd.plan.params import ParamSpec
from hspmd.train.config import TrainConfig
from hspmd.train.trainer import check_config


def test_resume_at_final_step_says_nothing_to_do(tmp_path, capsys) -> None:
    specs = {"w": ParamSpec("w", (2,), A("[0]{}"))}
    save(tmp_path, step=10, model="llama-tiny", strategy="1x1: R0:L0-3", specs=specs,
         tensors_by_rank={0: {"w": torch.zeros(2)}})  # fmt: skip
    argv = ["train", "--strategy", "1x1: R0:L0-3", "--global-batch", "1", "--steps", "10"]
    assert main([*argv, "--resume", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "nothing to do: checkpoint" in err and "is at step 10" in err


def test_help_example_is_a_valid_run() -> None:
    # Issue 17: the --switch example used TP 4, which does not divide llama-tiny's 2 kv heads.
    doc = train_cli.__doc__ or ""
    strategy = re.search(r'--strategy "([^"]+)"', doc)
    switch = re.search(r'--switch (\d+)="([^"]+)"', doc)
    batch = re.search(r"--global-batch (\d+)", doc)
    assert strategy and switch and batch
    config = TrainConfig(
        strategy=strategy.group(1),
        global_batch=int(batch.group(1)),
        switches=((int(switch.group(1)), switch.group(2)),),
    )
    check_config(config)
