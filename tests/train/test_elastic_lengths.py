"""An elastic run's packed steps without processes (``train.elastic_lengths``): documents by
step, the per-step choice and its fallbacks, the re-planned set taken and committed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from hspmd.cli.plan_lengths import read_length_plans
from hspmd.plan.strategy import Strategy, parse_strategy
from hspmd.train.api import revise, train_config
from hspmd.train.config import TrainConfig
from hspmd.train.elastic_lengths import Lengths, document_rows
from tests.cli.test_train_plans import LONG, SHORT, write_inputs


def _config(tmp_path: Path, **changes: object) -> TrainConfig:
    plans, data = write_inputs(tmp_path)
    base = train_config(
        elastic=True, step_tokens=256, seq_len=256, steps=4, data=str(data),
        length_plans=read_length_plans(json.loads(plans.read_text()), "plans"), strategy=SHORT,
    )  # fmt: skip
    return revise(base, **changes)  # type: ignore[arg-type]


def _layout(strategy: Strategy) -> tuple[tuple[tuple[int, ...], range], ...]:
    return tuple((st.ranks, st.layers) for _, _, st in strategy.stages())


def test_documents_are_a_function_of_the_step(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert config.batch.min_documents == 4  # a document a rank: any re-planned strategy takes it
    a, b = Lengths(config), Lengths(config)
    later = [a.documents(s).lengths for s in (1, 2, 3, 4)]
    assert b.documents(3).lengths == later[2] and b.documents(1).lengths == later[0]
    rows = list(document_rows(config))  # the reference's: the same documents, a row each
    assert [s.assignment.doc_lengths for s in rows] == later
    assert all(len(mb) == 1 for s in rows for mb in s.micro_batches)


def test_choice_per_step_and_a_widened_fallback(tmp_path: Path) -> None:
    lengths = Lengths(_config(tmp_path))
    chosen = [lengths.choose(s, None).strategy for s in (1, 2, 3, 4)]
    # both strategies run (one widened to more micro-batches where a step needs them)
    short, long = parse_strategy(SHORT), parse_strategy(LONG)
    assert {_layout(t) for t in chosen} == {_layout(short), _layout(long)}
    # one micro-batch a pipeline holds 6 of step 1's 8 documents of 30 tokens: widened
    plan = lengths.set.plans[0]
    assert plan is not None
    one = parse_strategy(SHORT.replace("2x1", "1x1"))
    narrow = dataclasses.replace(
        lengths.set, plans=(dataclasses.replace(plan, strategy=one),), strategies=(one,),
        switch=((0.0,),),
    )  # fmt: skip
    assert lengths.documents(1).lengths == (30,) * 8
    choice = lengths.choose(1, None, of=narrow)
    assert choice.strategy == short  # twice the micro-batches
    assert choice.batch.tokens == 240


def test_a_replanned_set_is_taken_and_committed(tmp_path: Path) -> None:
    lengths = Lengths(_config(tmp_path))
    record = lengths.replan_record(members=(0, 1, 2, 3), joined=(), alive=[0, 2, 3])
    json.dumps(record)  # published through the store
    strategy = lengths.take(record, step=2, renumbered={0: 0, 2: 1, 3: 2})
    assert set(strategy.ranks) <= {0, 2, 3}
    # nothing adopted before the recovery's state
    assert lengths.set.strategies == (parse_strategy(SHORT), parse_strategy(LONG))
    lengths.commit()
    assert all(set(s.ranks) <= {0, 1, 2} for s in lengths.set.strategies)
    assert all(len(s.pipelines) >= 2 for s in lengths.set.strategies)


def test_a_fixed_strategy_record_is_a_set_of_one(tmp_path: Path) -> None:
    lengths = Lengths(_config(tmp_path))
    given = parse_strategy("2x1: R0:L0-3; 2x1: R2:L0-3")
    record = {"strategy": given, "plan_seconds": 0.1}  # as decoded from the store
    assert lengths.take(record, step=1, renumbered={0: 0, 2: 1}) == given
    lengths.commit()
    moved = parse_strategy("2x1: R0:L0-3; 2x1: R1:L0-3")
    assert lengths.set.strategies == (moved,) and lengths.set.plans == (None,)
    assert lengths.choose(1, None).strategy == moved
