"""Pipelines simulated once per class of identical ones: the step and memory of ``predict``."""

from __future__ import annotations

from pathlib import Path

import pytest

from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.models.config import get_config
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.planner import zero_choice
from hspmd.planner.elastic import replan
from hspmd.planner.pipeline_classes import pipeline_classes, predict_by_class
from hspmd.planner.predict import predict
from hspmd.sim.engine import Task
from hspmd.sim.restrict import restricted
from tests.planner.conftest import cluster_file

MODEL = get_config("llama-32b")  # 60 layers
TWO_KINDS = CostModel.of(load_cluster("hetu-h800-h20"))  # R0-15 H800, R16-47 H20, nodes of 8
BF16 = StrategyOptions(dtype="bf16")
FOUR_H20 = "4*(4x1: R16-19:L0-29 R20-23:L30-59)"
THREE_H800 = "3x1: R0-1:L0-20 R2-3:L21-40 R4-5:L41-59"

CASES = [
    ("2*(2x1: R0-7:L0-59); 3x1: R16-19:L0-59; 2x1: R24-31:L0-59", BF16),
    (f"{FOUR_H20}; {THREE_H800}; 2x1: R6-7:L0-29 R12-13:L30-59", StrategyOptions(dtype="bf16", zero=1)),
    (f"{FOUR_H20}; {THREE_H800}", StrategyOptions(dtype="bf16", zero=3, sequence_parallel=True)),
    (f"{FOUR_H20}; {THREE_H800}", StrategyOptions(dtype="bf16", zero=2, zero_shares=(1, 1, 2, 1, 2))),
    ("5*(2x2: R0-3:L0-29:C2 R4-7:L30-59:RC3)", StrategyOptions(dtype="bf16", recompute=True)),
    ("2x1: R12-15:L0-29 R16-19:L30-59; 2x1: R4-7:L0-29 R8-11:L30-59; 2x1: R20-23:L0-29 "
     "R24-27:L30-59; 2x1: R28-31:L0-29 R32-35:L30-59", BF16),
]  # fmt: skip


@pytest.mark.parametrize(("text", "options"), CASES)
def test_by_class_is_predict_to_the_last_bit(text: str, options: StrategyOptions) -> None:
    strategy = parse_strategy(text)
    whole = predict(strategy, MODEL, TWO_KINDS, seq_len=4096, options=options)
    by_class = predict_by_class(strategy, MODEL, TWO_KINDS, seq_len=4096, options=options)
    assert by_class.step_time_s == whole.step_time_s
    assert dict(by_class.memory) == dict(whole.memory) and by_class.over == whole.over
    assert by_class.work == whole.work
    assert len(by_class.result.spans) <= len(whole.result.spans)


def test_classes_part_pipelines_by_what_their_tasks_read() -> None:
    options = StrategyOptions(dtype="bf16", zero=1, zero_shares=(1, 1, 2, 1, 1, 1, 1))
    strategy = parse_strategy(
        "4*(2x1: R16-19:L0-29 R20-23:L30-59); 3x1: R32-35:L0-29 R36-39:L30-59; "
        "2x1: R0-3:L0-29 R4-7:L30-59; 2x1: R12-15:L0-29 R40-43:L30-59"
    )  # fmt: skip
    # 2: its ZeRO share; 4: three micro-batches; 5: H800; 6: H800 then H20, across nodes
    assert pipeline_classes(strategy, TWO_KINDS, options) == [(0, 1, 3), (2,), (4,), (5,), (6,)]
    assert pipeline_classes(strategy, TWO_KINDS, BF16) == [(0, 1, 2, 3), (4,), (5,), (6,)]


def test_pipelines_sharing_cores_are_classes_of_their_own() -> None:
    # profiled CPU processes on one host: one pool of cores couples every pipeline
    cost = CostModel.of(load_cluster(Path(__file__).parent / "data" / "netcluster-2x2.json"))
    assert cost.share_of(0) == cost.share_of(3) == "cores:host"
    strategy = parse_strategy("2*(2x1: R0:L0-1 R1:L2-3)")
    config = get_config("llama-tiny", num_layers=4)
    assert pipeline_classes(strategy, cost, StrategyOptions()) == [(0,), (1,)]
    whole = predict(strategy, config, cost, seq_len=32, options=StrategyOptions())
    by_class = predict_by_class(strategy, config, cost, seq_len=32, options=StrategyOptions())
    assert by_class.step_time_s == whole.step_time_s


def test_restricted_keeps_the_kept_ranks_part_of_each_collective() -> None:
    tasks = [
        Task("f0", 0, "compute", 1.0, category="F"),
        Task("f1", 1, "compute", 1.0, category="F"),
        Task("f2", 2, "compute", 1.0, category="F"),
        Task("ar", 0, "comm", 2.0, category="comm", deps=("f0", "f1", "f2"), ranks=(0, 1, 2)),
    ]
    cut = restricted(tasks, {1, 2})
    assert [t.id for t in cut] == ["f1", "f2", "ar"]
    assert (cut[2].rank, cut[2].ranks, cut[2].deps) == (1, (1, 2), ("f1", "f2"))
    assert restricted(tasks, {0, 1, 2}) == tasks


def test_replan_is_the_per_pipeline_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-plan with one pipeline simulated per class chooses what simulating every pipeline
    chooses: the same strategy, options, step and switch."""
    path = cluster_file(tmp_path / "c.json", fast=16, slow=0, per_node=4)
    cost = CostModel.of(load_cluster(path), dtype="fp32")
    current = parse_strategy("8*(2x1: R0-1:L0-7)")

    def run() -> tuple[object, ...]:
        p = replan(get_config("llama-small"), cost, alive=range(14), current=current,
                   global_batch=32, seq_len=256, dtype="fp32")  # fmt: skip
        return str(p.strategy), p.options, p.step_time_s, p.moved_bytes, p.source

    by_class = run()
    assert max(map(len, pipeline_classes(parse_strategy(by_class[0]), cost, BF16))) > 1
    monkeypatch.setattr(zero_choice, "predict_by_class", predict)
    assert run() == by_class
