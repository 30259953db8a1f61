"""`--slowdown`: a slowed rank sleeps after each compute; the numbers do not change."""

from __future__ import annotations

import time

import pytest

from hspmd.cli.train import parse_slowdown
from hspmd.train.api import train_config
from hspmd.train.config import TrainError
from hspmd.train.slowdown import Slowdown, slowdown_of
from hspmd.train.trainer import check_config, train_many

_STRATEGY = "2x2: R0:L0-1; 2x2: R1:L0-1"  # two pipelines of one rank each
_TWO = (("num_layers", 2),)


def test_slowdown_sleeps_factor_minus_one_times_the_body() -> None:
    slow = Slowdown(3.0)
    begin = time.perf_counter()
    with slow:
        time.sleep(0.02)
    took = time.perf_counter() - begin
    assert slow.slept_s == pytest.approx(0.04, rel=0.5)
    assert took >= 0.02 + slow.slept_s
    assert slowdown_of(((1, 3.0),), 0).factor == 1.0 and not slowdown_of((), 0).active


def test_parse_slowdown() -> None:
    assert parse_slowdown("5=3, 2=1.5") == ((2, 1.5), (5, 3.0))
    assert parse_slowdown("") == ()
    with pytest.raises(TrainError, match="'2:3' is not RANK=FACTOR"):
        parse_slowdown("2:3")


def test_slowdown_values_are_checked() -> None:
    with pytest.raises(TrainError, match="factor 0.5 of rank 1 must be a finite number >= 1"):
        train_config(strategy=_STRATEGY, slowdown=((1, 0.5),))
    with pytest.raises(TrainError, match="rank listed twice"):
        train_config(strategy=_STRATEGY, slowdown=((1, 2.0), (1, 3.0)))
    with pytest.raises(TrainError, match=r"ranks \[4\] that the run's strategies do not use"):
        check_config(train_config(strategy=_STRATEGY, model_kwargs=_TWO, slowdown=((4, 2.0),)))


@pytest.mark.multiproc
def test_slowdown_keeps_the_losses_and_takes_longer() -> None:
    base = train_config(
        strategy=_STRATEGY, model_kwargs=_TWO, global_batch=8, seq_len=32,
        steps=4,
    )  # fmt: skip
    slowed = train_config(
        strategy=_STRATEGY, model_kwargs=_TWO, global_batch=8, seq_len=32,
        steps=4, slowdown=((1, 10.0),),
    )  # fmt: skip
    plain, slow = train_many([base, slowed])
    assert [r.loss for r in slow.records] == [r.loss for r in plain.records]
    # rank 0 reports; it waits for rank 1 in the gradient all-reduce. Step 1 warms up.
    plain_s = sum(r.seconds for r in plain.records[1:])
    slow_s = sum(r.seconds for r in slow.records[1:])
    assert slow_s > 1.5 * plain_s, (plain_s, slow_s)


def test_cli_refuses_a_bad_slowdown_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from hspmd.cli import main

    argv = ["train", "--strategy", _STRATEGY, "--slowdown", "1=0.5"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hspmd train: error: slowdown factor 0.5") and "\n" not in err
