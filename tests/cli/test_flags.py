"""The training flags are stated once (``hspmd.cli.flags``): every ``TrainConfig`` field has
exactly one flag, each command that takes a flag of ``train`` takes it with the same help,
``config_from_args`` sets the field the table names, and docs/cli.md mentions every flag of
every command."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import pytest

from hspmd.cli import build_parser
from hspmd.cli.flags import FLAGS, NOT_FLAGS, TRAIN_FLAGS
from hspmd.cli.train import config_from_args
from hspmd.train.config import TrainConfig

DOCS = Path(__file__).parents[2] / "docs" / "cli.md"

# Flags named as a flag of `train` that mean something else in that command.
DIFFERENT = {
    "explain": {"--model": "any preset, the metadata-only ones too",
                "--seq-len": "defaults to the model's maximum",
                "--cluster": "gives the GPU kinds, not the nodes of switches"},
    "simulate": {"--model": "any preset (required)", "--cluster": "the cluster predicted on",
                 "--seq-len": "defaults to the model's maximum",
                 "--dtype": "bf16 by default (fp32 for CPU runs)",
                 "--global-batch": "no reference run: no default without a strategy"},
    "plan": {"--model": "any preset (required)", "--cluster": "the cluster planned on",
             "--seq-len": "defaults to the model's maximum", "--dtype": "bf16 by default",
             "--global-batch": "no strategy yet: no default", "--zero1": "auto by default",
             "--zero": "auto by default: chosen per plan",
             "--data": "the corpus whose lengths are planned for",
             "--tokens-per-step": "the steps planned for", "--max-seq-len": "likewise",
             "--slowdown": "the ranks planned as slower, not an emulation"},
    "switch-cost": {"--model": "any preset, the metadata-only ones too",
                    "--config": "a factory's keyword arguments only",
                    "--cluster": "the cluster estimated on"},
    "profile": {"--dtype": "the dtype compute is measured in"},
    "partition-capture": {"--device": "the roofline device a capture is costed for"},
    "tokenize": {"--tokenizer": "the tokenizer that writes the file (required)",
                 "--eod-id": "the id written after each document"},
    "export": {"--dtype": "the exported weights' dtype, not the compute dtype"},
}  # fmt: skip


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings if o.startswith("--")}


def test_every_field_has_exactly_one_flag() -> None:
    # TrainConfig's fields, with its sections' as <section>.<field> (adam.lr, batch.seq_len)
    kinds = typing.get_type_hints(TrainConfig)
    sections = {
        f.name for f in dataclasses.fields(TrainConfig) if dataclasses.is_dataclass(kinds[f.name])
    }
    assert {"adam", "batch", "data", "options", "runtime"} <= sections
    fields = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in sections]
    for name in sorted(sections):
        fields += [f"{name}.{f.name}" for f in dataclasses.fields(kinds[name])]
    named = [flag.field for flag in TRAIN_FLAGS if flag.field is not None]
    for name in fields:
        count = named.count(name) + (name in NOT_FLAGS)
        assert count == 1, f"TrainConfig.{name}: {count} flags; add one to TRAIN_FLAGS"
    assert set(named) <= set(fields), set(named) - set(fields)
    assert len(FLAGS) == len(TRAIN_FLAGS)


@pytest.mark.parametrize("command", ["train", "demo"])
def test_train_and_demo_take_every_flag_as_stated(command: str) -> None:
    options = _options(_commands()[command])
    for flag in TRAIN_FLAGS:
        action = options[flag.name]
        assert action.help == flag.help, flag.name
        assert action.type == flag.type and action.metavar == flag.metavar, flag.name
        assert action.choices == flag.choices, flag.name
        if command == "train":
            want = False if flag.action == "store_true" else flag.default
            assert action.default == want, flag.name


def test_other_commands_share_the_help_of_train() -> None:
    for name, parser in _commands().items():
        if name in ("train", "demo"):
            continue
        for option, action in _options(parser).items():
            if option in FLAGS and option not in DIFFERENT.get(name, {}):
                flag = FLAGS[option]
                assert action.help == flag.help, f"hspmd {name} {option}"
                assert action.choices == flag.choices, f"hspmd {name} {option}"
    explain = _options(_commands()["explain"])
    assert {"--zero1", "--schedule", "--dtype", "--strategy"} <= explain.keys()


# argv that sets each flag's field away from its default (with what else it needs)
ITEMS = Path(__file__).parents[1] / "models" / "data" / "image_items.py"
SAMPLES: dict[str, list[str]] = {
    "--model": ["--model", "llama-small"],
    "--config": ["--config", '{"num_layers": 2}'],
    "--strategy": ["--strategy", "2x1: R0:L0-3"],
    "--global-batch": ["--global-batch", "4"],
    "--seq-len": ["--seq-len", "32"],
    "--steps": ["--steps", "7"],
    "--seed": ["--seed", "3"],
    "--lr": ["--lr", "0.01"],
    "--lr-schedule": ["--lr-schedule", "cosine"],
    "--warmup-steps": ["--warmup-steps", "2"],
    "--decay-steps": ["--decay-steps", "4"],
    "--min-lr": ["--min-lr", "1e-5"],
    "--weight-decay": ["--weight-decay", "0.1"],
    "--no-decay": ["--no-decay", "*.bias"],
    "--betas": ["--betas", "0.8,0.95"],
    "--eps": ["--eps", "1e-6"],
    "--clip-grad-norm": ["--clip-grad-norm", "1.0"],
    "--grad-accum": ["--grad-accum", "2"],
    "--eval-every": ["--eval-every", "2", "--eval-split", "0.1"],
    "--eval-batches": ["--eval-batches", "2"],
    "--eval-data": ["--eval-data", "held.txt", "--eval-every", "2"],
    "--eval-split": ["--eval-split", "0.1"],
    "--data": ["--data", "corpus.txt"],
    "--dataset": ["--model", f"{ITEMS}:make", "--dataset", f"{ITEMS}:images"],
    "--data-max-bytes": ["--data-max-bytes", "100"],
    "--data-dtype": ["--data-dtype", "uint32"],
    "--eod-id": ["--eod-id", "0"],
    "--tokenizer": ["--tokenizer", "tokenizer.json"],
    "--data-cache": ["--data-cache", "cache"],
    "--schedule": ["--schedule", "gpipe"],
    "--dtype": ["--dtype", "bf16"],
    "--zero": ["--zero", "2"],
    "--zero-shares": ["--zero-shares", "3,1", "--zero", "3"],
    "--sequence-parallel": ["--sequence-parallel"],
    "--recompute": ["--recompute"],
    "--recompute-layers": ["--recompute-layers", "2", "--recompute"],
    "--no-overlap": ["--no-overlap"],
    "--zero-no-overlap": ["--zero-no-overlap"],
    "--switch": ["--switch", "3=2x1: R0:L0-3"],
    "--switch-mode": ["--switch-mode", "weights"],
    "--switch-algo": ["--switch-algo", "relay", "--ranks-per-node", "2"],
    "--cluster": ["--cluster", "h20x32"],
    "--ranks-per-node": ["--ranks-per-node", "2"],
    "--save": ["--save", "ckpt"],
    "--save-every": ["--save-every", "2"],
    "--resume": ["--resume", "ckpt"],
    "--elastic": ["--elastic"],
    "--hang-timeout": ["--hang-timeout", "5"],
    "--inject-failure": ["--inject-failure", "1@2"],
    "--spares": ["--spares", "1", "--elastic"],
    "--grow": ["--grow", "3=1", "--spares", "1", "--elastic"],
    "--tokens-per-step": ["--tokens-per-step", "128"],
    "--long-docs": ["--long-docs", "drop"],
    "--slowdown": ["--slowdown", "1=2"],
    "--device": ["--device", "cpu"],
}
# --plans reads a plans file of `hspmd plan --data` (tests/cli/test_plan_lengths.py);
# --max-seq-len sets seq_len in --seq-len's place, --zero1 sets zero in --zero's (below)
UNSAMPLED = {"--plans", "--max-seq-len", "--zero1"}


def _value(config: TrainConfig, field: str) -> Any:
    value: Any = config
    for part in field.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize(
    "flag", [f for f in TRAIN_FLAGS if f.name not in UNSAMPLED], ids=lambda f: f.name
)
def test_each_flag_sets_its_field(flag: Any) -> None:
    parser = build_parser()
    base = config_from_args(parser.parse_args(["train"]))
    config = config_from_args(parser.parse_args(["train", *SAMPLES[flag.name]]))
    assert flag.field is not None
    assert _value(config, flag.field) != _value(base, flag.field), flag.name
    packed = parser.parse_args(["train", "--tokens-per-step", "128", "--max-seq-len", "32"])
    assert config_from_args(packed).batch.seq_len == 32
    assert config_from_args(parser.parse_args(["train", "--zero1"])).zero == 1


def test_zero1_is_zero_1_and_refuses_another_stage() -> None:
    from hspmd.cli import main

    parser = build_parser()
    config = config_from_args(parser.parse_args(["train", "--zero1", "--zero", "1"]))
    assert (config.zero, config.zero1) == (1, True)
    assert main(["train", "--zero1", "--zero", "3", "--steps", "1"]) == 2


def _sections() -> dict[str, str]:
    parts = re.split(r"^## ", DOCS.read_text(), flags=re.MULTILINE)
    return {m.group(1): p for p in parts if (m := re.match(r"`hspmd ([\w-]+)`", p))}


def test_docs_mention_every_flag_of_every_command() -> None:
    sections = _sections()
    for name, parser in _commands().items():
        text = sections[name] + (sections["train"] if name == "demo" else "")
        for option in _options(parser):
            if option != "--help":
                assert re.search(re.escape(option) + r"(?![\w-])", text), (
                    f"docs/cli.md's `hspmd {name}` section does not mention {option}"
                )


@pytest.mark.parametrize(
    "argv",
    [["bogus"], ["train", "--long-docs", "maybe"], ["netcluster", "up", "--nodes", "2"], []],
)
def test_usage_errors_are_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from hspmd.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "error:" in err and "--help" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--strategy", "1x1: R0:L0-3", "--save-plan", "{tmp}/no/x.json"], "--save-plan"),
        (["partition-capture", "transformer-small", "--out", "{tmp}/no/x.json"], "does not exist"),
        (
            [
                "netcluster",
                "up",
                "--nodes",
                "2",
                "--ranks-per-node",
                "1",
                "--inter-gbps",
                "0.4",
                "--out",
                "{tmp}/no/c.json",
            ],
            "does not exist",
        ),  # before any namespace is made
        (["profile", "--nproc", "1", "--out", "{tmp}/no/p.json"], "does not exist"),
        (
            [
                "plan",
                "--model",
                "llama-32b",
                "--cluster",
                "h20x32",
                "--global-batch",
                "64",
                "--out",
                "{tmp}/no/p.json",
            ],
            "does not exist",
        ),  # before the search
    ],
)
def test_unwritable_outputs_are_one_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hspmd.cli import main

    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--nnodes", "0"], "--nnodes 0"),
        (["--data-max-bytes", "0"], "--data-max-bytes 0"),
        (["--config", '{"num_layers": 0}'], "num_layers=0"),
        (["--elastic", "--spares", "-1"], "--spares -1"),
        (["--lr", "-1"], "learning rate"),
    ],
)
def test_bad_train_values_are_refused_in_one_line(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from hspmd.cli import main

    argv = ["train", "--strategy", "2x1: R0:L0-3; 2x1: R1:L0-3", "--steps", "1", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
