"""`hspmd train --resume` when the checkpoint is already at or past ``--steps`` (issue 17)."""

from __future__ import annotations

import torch

from hspmd.annotation import parse_annotation as A
from hspmd.checkpoint.store import save
from hspmd.cli import main
from hspmd.plan.params import ParamSpec


def test_resume_at_final_step_says_nothing_to_do(tmp_path, capsys) -> None:
    specs = {"w": ParamSpec("w", (2,), A("[0]{}"))}
    save(tmp_path, step=10, model="llama-tiny", strategy="1x1: R0:L0-3", specs=specs,
         tensors_by_rank={0: {"w": torch.zeros(2)}})  # fmt: skip
    argv = ["train", "--strategy", "1x1: R0:L0-3", "--global-batch", "1", "--steps", "10"]
    assert main([*argv, "--resume", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "nothing to do: checkpoint" in err and "is at step 10" in err
