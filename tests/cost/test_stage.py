"""A stage's cost comes from the model's own cost function (hspmd.cost.stage)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.cost.stage import cost_of, stage_params, stage_work
from hspmd.models.config import LlamaConfig, get_config
from hspmd.models.cost_function import (
    ComputeLines,
    CostFunction,
    LinkLines,
    StageShape,
    StageWork,
)
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.planner.memory import rank_memory
from hspmd.planner.predict import predict


@dataclasses.dataclass(frozen=True)
class Doubled:
    """A cost function twice another's seconds, parameters and saved bytes."""

    inner: CostFunction

    @property
    def sequence_parallel(self) -> bool:
        return self.inner.sequence_parallel

    @property
    def context_parallel(self) -> bool:
        return self.inner.context_parallel

    @property
    def vocab_split(self) -> bool:
        return self.inner.vocab_split

    def part_params(self) -> tuple[int, int, int]:
        pre, layer, post = self.inner.part_params()
        return 2 * pre, 2 * layer, 2 * post

    def stage_params(self, num_layers: int, tp: int, *, first: bool, last: bool) -> int:
        return 2 * self.inner.stage_params(num_layers, tp, first=first, last=last)

    def saved_bytes(self, b: int, s: int, tp: int, *, elt: int, sequence_parallel: bool) -> float:
        return 2 * self.inner.saved_bytes(b, s, tp, elt=elt, sequence_parallel=sequence_parallel)

    def stage_work(
        self, shape: StageShape, *, device: ComputeLines, link: LinkLines, cp_link: LinkLines
    ) -> StageWork:
        w = self.inner.stage_work(shape, device=device, link=link, cp_link=cp_link)
        return StageWork(2 * w.forward_s, 2 * w.backward_s, 2 * w.tp_comm_s,
                         w.activation_bytes, 2 * w.forward_comm_s)  # fmt: skip


class OwnCost:
    """A Llama that brings another cost function: every other field is the config's."""

    def __init__(self, config: LlamaConfig) -> None:
        self._config = config
        self.cost = Doubled(config.cost)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)

    def __hash__(self) -> int:
        return hash(("doubled", self._config))


def test_the_planner_asks_the_model_for_its_cost() -> None:
    config = get_config("llama-tiny")
    own = OwnCost(config)
    cost = CostModel.of(load_cluster("hetu-h800-h20"))
    kw: dict[str, Any] = dict(micro_batch_size=2, seq_len=64, first=True, last=True)
    plain = stage_work(cost, config, (0, 1), 4, **kw)
    doubled = stage_work(cost, own, (0, 1), 4, **kw)  # type: ignore[arg-type]
    assert doubled.forward_s == 2 * plain.forward_s
    assert doubled.backward_s == 2 * plain.backward_s
    assert stage_params(own, 4, 2, first=True, last=True) == 2 * stage_params(  # type: ignore[arg-type]
        config, 4, 2, first=True, last=True
    )
    memory = dict(rank=0, tp=1, num_layers=4, first=True, last=True, in_flight_micro_batches=1,
                  micro_batch_size=2, seq_len=64, replicas=1, options=StrategyOptions())  # fmt: skip
    assert rank_memory(own, **memory).weights == 2 * rank_memory(config, **memory).weights  # type: ignore[arg-type]
    strategy = parse_strategy("1x1: R0:L0-3")
    options = StrategyOptions()
    mine = predict(strategy, own, cost, seq_len=64, options=options)  # type: ignore[arg-type]
    theirs = predict(strategy, config, cost, seq_len=64, options=options)
    assert mine.step_time_s > 1.5 * theirs.step_time_s


def test_a_llama_has_one_cost_function() -> None:
    config = get_config("llama-tiny")
    assert cost_of(config) is config.cost  # one per config
