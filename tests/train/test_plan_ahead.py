"""Planning on a background worker (``hspmd.train.plan_ahead``): the same steps and choices
as the synchronous path, planned ahead of the consumer, errors delivered at their step."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hspmd.cli.plan_lengths import apply_plans, read_length_plans
from hspmd.plan.strategy import parse_strategy
from hspmd.train.active import strategy_options
from hspmd.train.api import train_config
from hspmd.train.compare import compare
from hspmd.train.config import TrainConfig
from hspmd.train.packing import plan_schedule, planned_steps
from hspmd.train.plan_ahead import PlanAhead
from hspmd.train.reference import run_reference
from hspmd.train.trainer import train_many
from tests.cli.test_train_plans import _pipe, write_inputs


def config(tmp_path: Path, steps: int) -> TrainConfig:
    plans, data = write_inputs(tmp_path)
    base = train_config(data=str(data), seq_len=256, step_tokens=256, steps=steps)
    return apply_plans(base, read_length_plans(json.loads(plans.read_text()), "plans"),
                       path=str(plans))  # fmt: skip


def test_the_worker_makes_the_synchronous_choices(tmp_path: Path) -> None:
    run = config(tmp_path, steps=6)
    ahead = PlanAhead(planned_steps(run), depth=2)
    time.sleep(0.5)  # the consumer is busy: the worker plans ahead meanwhile
    assert ahead.ready() == 2 and ahead.planned >= 2
    got = list(ahead)
    want = list(planned_steps(run))
    assert [(s.plan, s.predicted, s.assignment) for s in got] == [
        (s.plan, s.predicted, s.assignment) for s in want
    ]
    assert [s.plan for s in got] == [k for k, _, _ in plan_schedule(run)]
    assert len({s.plan for s in got}) == 2  # both strategies chosen: the choice is tested
    for a, b in zip(got, want, strict=True):
        for pa, pb in zip(a.micro_batches, b.micro_batches, strict=True):
            for ma, mb in zip(pa, pb, strict=True):
                assert ma.tokens.equal(mb.tokens) and ma.segments.equal(mb.segments)
    ahead.close()


def test_each_strategy_of_a_plans_file_keeps_its_recompute(tmp_path: Path) -> None:
    plans, data = write_inputs(tmp_path)
    text = json.loads(plans.read_text())
    text["strategies"][1] |= {"recompute": True, "recompute_layers": 1}
    base = train_config(data=str(data), seq_len=256, step_tokens=256, steps=2)
    run = apply_plans(base, read_length_plans(text, "plans.json"), path="plans.json")
    assert run.options.recompute and run.options.recompute_layers == 1  # the most any strategy asks
    short, long = (parse_strategy(e["strategy"]) for e in text["strategies"])
    assert not strategy_options(run, short).recompute  # but each runs its own
    assert strategy_options(run, long).recomputed(4) == 1


def test_an_error_reaches_the_consumer_at_its_step() -> None:
    def steps() -> Iterator[int]:
        yield 1
        raise ValueError("step 2 fits no strategy")

    ahead = PlanAhead(steps())
    assert next(ahead) == 1
    with pytest.raises(ValueError, match="step 2"):
        next(ahead)
    with pytest.raises(ValueError, match="depth=0"):
        PlanAhead(iter(()), depth=0)


def test_close_stops_a_worker_that_is_ahead() -> None:
    ahead = PlanAhead(iter(range(10**9)), depth=1)
    time.sleep(0.2)
    ahead.close()  # returns: the worker stops while its queue is full
    assert ahead.planned < 10


@pytest.mark.multiproc
def test_empty_micro_batches_are_skipped_and_equal_the_reference(tmp_path: Path) -> None:
    """Steps of 2-3 documents under three micro-batches a pipeline: the empty ones are
    skipped on every stage of a PP-2 pipeline alike; losses equal the reference."""
    strategy = "3x1: R0:L0-1 R1:L2-3; 3x1: R2-3:L0-3"
    plans = {
        "format": "hspmd.length-plans", "version": 1, "model": "llama-tiny",
        "cluster": "local-4", "tokens_per_step": 200, "max_len": 128, "histogram": {},
        "strategies": [{"max_len": 128, "strategy": strategy, "predicted_step_s": 0.1,
                        "sync_s": 0.0, "pipelines": [_pipe(1, 2, 128, 3), _pipe(2, 1, 128, 3)]}],
        "switch_s": [[0.0]],
    }  # fmt: skip
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": "y" * n}) + "\n" for n in [90, 60, 100] * 6))
    base = train_config(data=str(data), seq_len=128, step_tokens=200, steps=3)
    run = apply_plans(base, read_length_plans(plans, "plans.json"), path="plans.json")
    steps = list(planned_steps(run))
    assert any(0 in pipe for s in steps for pipe in s.assignment.lengths)  # empty ones
    (result,) = train_many([run], threads=1)
    reference = run_reference(run)
    assert compare(result, reference).ok
