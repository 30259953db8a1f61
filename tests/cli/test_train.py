"""`hspmd train`: resume, save, defaults and warnings as issue 17 asked."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from hspmd.annotation import parse_annotation as A
from hspmd.checkpoint.store import save
from hspmd.cli import build_parser, main
from hspmd.cli import train as train_cli
from hspmd.cli.train import config_from_args, progress, resume_warnings, warnings_of
from hspmd.errors import HspmdError
from hspmd.plan.params import ParamSpec
from hspmd.train.api import train_config
from hspmd.train.config import StepRecord
from hspmd.train.sections import TrainError
from hspmd.train.trainer import check_config


def test_resume_at_final_step_says_nothing_to_do(tmp_path, capsys) -> None:
    specs = {"w": ParamSpec("w", (2,), A("[0]{}"))}
    save(tmp_path, step=10, model="llama-tiny", strategy="1x1: R0:L0-3", specs=specs,
         tensors_by_rank={0: {"w": torch.zeros(2)}})  # fmt: skip
    argv = ["train", "--strategy", "1x1: R0:L0-3", "--global-batch", "1", "--steps", "10"]
    assert main([*argv, "--resume", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "nothing to do: checkpoint" in err and "is at step 10" in err


def test_save_into_another_runs_checkpoints_is_refused(tmp_path, capsys) -> None:
    # saving prunes all but the newest step-N: a new run there would lose one of the two
    specs = {"w": ParamSpec("w", (2,), A("[0]{}"))}
    save(tmp_path, step=4, model="llama-tiny", strategy="1x1: R0:L0-3", specs=specs,
         tensors_by_rank={0: {"w": torch.zeros(2)}})  # fmt: skip
    argv = ["train", "--strategy", "1x1: R0:L0-3", "--global-batch", "1", "--steps", "2"]
    assert main([*argv, "--save", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--save {tmp_path} already holds checkpoint step-00000004 of another run" in err
    assert f"--resume {tmp_path} to continue" in err and "Traceback" not in err
    assert (tmp_path / "step-00000004" / "manifest.json").is_file()
    # continuing it is allowed, from the folder or from its step folder
    argv[-1] = "4"
    assert main([*argv, "--save", str(tmp_path), "--resume", str(tmp_path)]) == 0
    step = str(tmp_path / "step-00000004")
    assert main([*argv, "--save", str(tmp_path), "--resume", step]) == 0


def test_help_example_is_a_valid_run() -> None:
    # Issue 17: the --switch example used TP 4, which does not divide llama-tiny's 2 kv heads.
    doc = train_cli.__doc__ or ""
    strategy = re.search(r'--strategy "([^"]+)"', doc)
    switch = re.search(r'--switch (\d+)="([^"]+)"', doc)
    batch = re.search(r"--global-batch (\d+)", doc)
    assert strategy and switch and batch
    config = train_config(
        strategy=strategy.group(1),
        global_batch=int(batch.group(1)),
        switches=((int(switch.group(1)), switch.group(2)),),
    )
    check_config(config)


def _save_fake(directory: Path, *, step: int) -> None:
    specs = {"w": ParamSpec("w", (2,), A("[0]{}"))}
    save(directory, step=step, model="llama-tiny", strategy="1x1: R0:L0-3", specs=specs,
         tensors_by_rank={0: {"w": torch.zeros(2)}})  # fmt: skip


def test_resume_with_other_data_flags_is_warned(tmp_path: Path) -> None:
    specs = {"w": ParamSpec("w", (2,), A("[0]{}"))}
    saved = train_config(strategy="1x1: R0:L0-3", global_batch=4, seed=3)
    save(tmp_path, step=2, model="llama-tiny", strategy="1x1: R0:L0-3", specs=specs,
         tensors_by_rank={0: {"w": torch.zeros(2)}}, run=saved.data_identity())  # fmt: skip
    same = train_config(strategy="1x1: R0:L0-3", global_batch=4, seed=3, resume=str(tmp_path))
    assert resume_warnings(same) == []
    other = train_config(strategy="1x1: R0:L0-3", global_batch=8, seed=3, resume=str(tmp_path))
    (warning,) = resume_warnings(other)
    assert "--global-batch 8 where the checkpoint was saved with 4" in warning


def test_resume_of_a_checkpoint_without_run_flags_warns_nothing(tmp_path: Path) -> None:
    _save_fake(tmp_path, step=2)  # saved before checkpoints recorded the data flags
    assert resume_warnings(train_config(strategy="1x1: R0:L0-3", resume=str(tmp_path))) == []


def test_resume_at_final_step_json_is_one_object(tmp_path: Path, capsys) -> None:
    _save_fake(tmp_path, step=10)
    argv = ["train", "--strategy", "1x1: R0:L0-3", "--steps", "10", "--json"]
    assert main([*argv, "--resume", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {
        "nothing_to_do": True, "checkpoint_step": 10, "steps": 10, "resume": str(tmp_path),
    }  # fmt: skip
    assert err.count("\n") == 1 and err.startswith("nothing to do: checkpoint is at step 10")


def test_progress_bar_after_resume_counts_to_the_total(capsys) -> None:
    # Issue 17: resumed at step 10 of 14, the bar ended at 4/14.
    config = train_config(strategy="1x1: R0:L0-3", global_batch=1, steps=14)
    with progress(config, title="1 ranks", as_json=False, done=10, terminal=True) as on_step:
        for step in range(11, 15):
            on_step(StepRecord(step=step, loss=1.0, tokens=64, seconds=0.1))
    out = capsys.readouterr().out
    assert re.findall(r"(?<!\d)\d+/14", out) == ["14/14"]
    assert "640 tokens/s" in out


def test_plain_progress_doctest() -> None:
    import doctest

    import hspmd.cli.progress

    assert doctest.testmod(hspmd.cli.progress).failed == 0


def test_progress_off_a_terminal_is_plain_lines_and_quiet_is_silent(capsys) -> None:
    config = train_config(strategy="1x1: R0:L0-3", global_batch=1, steps=14)
    with progress(config, title="1 ranks", as_json=False, done=10) as on_step:  # not a tty
        for step in range(11, 15):
            on_step(StepRecord(step=step, loss=1.0, tokens=64, seconds=0.1))
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["11/14", "12/14", "13/14", "14/14"]
    assert lines[0].startswith("step 11/14  loss 1.000000  640 tokens/s  eta 0:00:")
    assert lines[-1].endswith("eta 0:00:00") and "\x1b" not in "".join(lines)  # no escapes
    with progress(config, title="1 ranks", as_json=False, quiet=True) as on_step:
        on_step(StepRecord(step=1, loss=1.0, tokens=64, seconds=0.1))
    assert capsys.readouterr().out == ""


def _args(*argv: str):
    return build_parser().parse_args(["train", *argv])


def test_global_batch_defaults_to_the_strategy() -> None:
    # Issue 17: it defaulted to 8 whatever the strategy, and the error named a number not typed.
    config = config_from_args(_args("--strategy", "2x1: R0:L0-3; 4x1: R1:L0-3"))
    assert config.batch.global_batch == 6
    assert config_from_args(_args("--reference")).batch.global_batch == 8
    given = config_from_args(_args("--strategy", "2x1: R0:L0-3", "--global-batch", "2"))
    assert given.batch.global_batch == 2


def test_help_shows_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: the strategy's sum of COUNT x SIZE; 8 without a strategy)" in out
    assert "--seq-len SEQ_LEN tokens per sequence (default: 64)" in out
    assert "--seed SEED seed of weights and data order (default: 0)" in out


@pytest.mark.parametrize(
    ("argv", "warning"),
    [
        (["--save-every", "2"], "--save-every 2 without --save saves nothing"),
        (["--save", "d", "--save-every", "9"], "--save-every 9 is past --steps 5"),
        (["--save", "d", "--save-every", "2"], "--save-every 2 does not divide --steps 5"),
        (["--zero", "3"], "--zero 3 shards over data-parallel replicas, and '1x1: R0:L0-3' has"),
        (["--switch", "7=1x1: R0:L0-3"], "--switch 7='1x1: R0:L0-3' never runs: step 7 is past"),
    ],
)
def test_warnings(argv: list[str], warning: str) -> None:
    args = _args("--strategy", "1x1: R0:L0-3", *argv)
    assert warnings_of(args, config_from_args(args)) == [warning + warning_tail(warning)]


def warning_tail(warning: str) -> str:
    return {
        "--save-every 2 without --save saves nothing": ": add --save DIR",
        "--save-every 9 is past --steps 5": ": nothing is saved",
        "--zero 3 shards over data-parallel replicas, and '1x1: R0:L0-3' has": " one pipeline: "
        "it shards nothing (give the strategy a second pipeline for it to shard over, or drop "
        "--zero)",
        "--save-every 2 does not divide --steps 5": ": the last checkpoint is step 4, the "
        "steps after it are not saved (give --steps 6 or a --save-every that divides 5)",
    }.get(warning, " --steps 5")


def test_errors_name_the_switch_they_are_about() -> None:
    # Issue 17: with several strategies, an error did not say which one it was about.
    from hspmd.errors import StrategyError

    args = _args("--strategy", "1x1: R0:L0-3", "--switch", "3=1x1: R0:L0-9")
    with pytest.raises(StrategyError, match=r"^--switch 3: stage R0:L0-9 .* holds layers up to 9"):
        check_config(config_from_args(args))
    args = _args("--strategy", "1x1: R0:L0-9", "--switch", "3=1x1: R0:L0-3")
    with pytest.raises(StrategyError, match=r"^--strategy: stage R0:L0-9"):
        check_config(config_from_args(args))


def test_no_warnings_for_a_plain_run() -> None:
    args = _args("--strategy", "1x1: R0:L0-3", "--save", "d", "--switch", "3=1x1: R0:L0-3")
    assert warnings_of(args, config_from_args(args)) == []


@pytest.mark.multiproc
def test_save_and_resume_say_what_they_did(tmp_path: Path, capsys) -> None:
    argv = ["train", "--strategy", "1x1: R0:L0-3", "--seq-len", "16", "--save", str(tmp_path)]
    assert main([*argv, "--steps", "2"]) == 0
    assert f"checkpoint of step 2 saved in {tmp_path / 'step-00000002'}" in capsys.readouterr().err
    assert main([*argv, "--steps", "3", "--resume", str(tmp_path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line)["step"] for line in out.splitlines()] == [3]
    assert (
        f"resuming {tmp_path / 'step-00000002'} (saved after step 2) at step 3: "
        "strategy '1x1: R0:L0-3'"
    ) in err
    assert f"checkpoint of step 3 saved in {tmp_path / 'step-00000003'}" in err
    assert "warning" not in err
    assert main([*argv, "--steps", "4", "--resume", str(tmp_path), "--seed", "7"]) == 0
    assert "resuming with --seed 7 where the checkpoint was saved with 0" in capsys.readouterr().err


def test_several_nodes_need_a_master_address(monkeypatch, capsys) -> None:
    monkeypatch.delenv("HSPMD_MASTER_ADDR", raising=False)
    argv = ["train", "--strategy", "2x1: R0:L0-1 R1:L2-3", "--steps", "1", "--nnodes", "2"]
    assert main(argv) == 2
    assert "--nnodes 2 needs --master-addr" in capsys.readouterr().err


def test_a_sequence_longer_than_the_model_names_the_fix() -> None:
    args = _args("--strategy", "1x1: R0:L0-3", "--seq-len", "1024")
    with pytest.raises(TrainError, match=r"give --seq-len 512 or less, or a model with more"):
        check_config(config_from_args(args))
    args = _args("--strategy", "1x1: R0:L0-3", "--tokens-per-step", "2048", "--max-seq-len", "1024")
    with pytest.raises(TrainError, match=r"give --max-seq-len 512 or less"):
        check_config(config_from_args(args))


def test_a_plan_sets_the_length_and_batch_flags_cannot_contradict_it(tmp_path) -> None:
    # the plan's length used to be applied after the model was checked at the default 64
    plan, model = (
        str(tmp_path / "p.json"),
        ["--model", "llama-tiny", "--config", '{"max_seq_len": 32}'],
    )
    argv = [*model, "--cluster", "h200x8", "--global-batch", "4", "--seq-len", "32", "--out", plan]
    assert main(["plan", *argv]) == 0
    config = train_cli.planned_config(_args(*model, "--plan", plan))
    assert (config.batch.seq_len, config.batch.global_batch) == (32, 4)
    assert train_cli.planned_config(_args(*model, "--plan", plan, "--seq-len", "32"))
    for flag, value, planned in (("--seq-len", "16", 32), ("--global-batch", "8", 4)):
        with pytest.raises(
            TrainError, match=rf"^{flag} {value} differs from --plan .*'s {planned}"
        ):
            train_cli.planned_config(_args(*model, "--plan", plan, flag, value))


def test_a_missing_config_file_is_named() -> None:
    # it said "is not JSON (Expecting value: line 1 column 1)"
    with pytest.raises(HspmdError, match=r"^--config 'missing.json': no such file"):
        config_from_args(_args("--config", "missing.json"))


def test_zero_warns_only_without_replicas() -> None:
    for strategy in ("1x1: R0:L0-3; 1x1: R1:L0-3", "1x2: R0-1:L0-3:C2"):
        args = _args("--strategy", strategy, "--zero", "1")
        assert warnings_of(args, config_from_args(args)) == []
    args = _args(
        "--strategy", "1x1: R0:L0-3", "--zero", "1", "--switch", "3=1x1: R0:L0-3; 1x1: R1:L0-3"
    )
    assert warnings_of(args, config_from_args(args)) == []


@pytest.mark.parametrize("value", ["-1e-3", "-1E-3", "-.001", "-0.001"])
def test_a_negative_value_in_exponent_notation_is_a_value(value: str) -> None:
    # argparse took "-1e-3" for a flag: "argument --lr: expected one argument"
    args = _args("--strategy", "1x1: R0:L0-3", "--lr", value)
    assert args.lr == -0.001
    with pytest.raises(HspmdError, match=r"^--lr -0.001: give a learning rate of at least 0"):
        config_from_args(args)


@pytest.mark.parametrize("flag", ["--save", "--resume"])
def test_the_reference_refuses_checkpoint_flags(flag: str, tmp_path, capsys) -> None:
    # it trained from step 1 and saved nothing, silently
    argv = ["train", "--reference", "--global-batch", "1", "--steps", "1", flag, str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--reference does not take {flag} {tmp_path}" in err and "Traceback" not in err
