"""hspmd.train.sections: TrainConfig's sections, the flat-name map and its one route."""

from __future__ import annotations

import dataclasses
from typing import Any, get_type_hints

import pytest

from hspmd.errors import HspmdError
from hspmd.plan.strategy import parse_strategy
from hspmd.train.config import TrainConfig
from hspmd.train.sections import (
    SECTIONS,
    BatchConfig,
    CheckpointConfig,
    ElasticConfig,
    FaultConfig,
    RuntimeConfig,
    SwitchingConfig,
    routed,
)


def test_the_config_is_sections_and_three_values() -> None:
    kinds = get_type_hints(TrainConfig)
    flat = [
        f.name
        for f in dataclasses.fields(TrainConfig)
        if not dataclasses.is_dataclass(kinds[f.name])
    ]
    assert flat == ["strategy", "steps", "seed"]
    for name, (section, field) in SECTIONS.items():
        assert field in {f.name for f in dataclasses.fields(kinds[section])}, name


def test_routed_sets_each_flat_name_in_its_section_and_keeps_the_rest() -> None:
    base = TrainConfig(batch=BatchConfig(seq_len=32), checkpoint=CheckpointConfig(save="ckpt"))
    config = routed(base, {"seq_len": 16, "save_every": 3, "hang_timeout": 5.0, "steps": 7,
                           "data": "corpus.txt", "switch_mode": "weights"})  # fmt: skip
    assert (config.batch.seq_len, config.batch.global_batch) == (16, 8)
    assert (config.checkpoint.save, config.checkpoint.every) == ("ckpt", 3)
    assert config.elastic.hang_timeout == 5.0 and config.steps == 7
    assert config.data.path == "corpus.txt" and config.switching.mode == "weights"
    assert base.batch.seq_len == 32  # a value: the base is unchanged


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: BatchConfig(seq_len=0), "seq_len=0 must be at least 1"),
        (lambda: BatchConfig(step_tokens=8, seq_len=16), "--tokens-per-step 8 is below"),
        (lambda: RuntimeConfig(device="tpu"), "device='tpu': choose one of auto, cpu, cuda"),
        (lambda: CheckpointConfig(every=0), "save_every=0 must be at least 1"),
        (lambda: ElasticConfig(spares=1), "--spares and --grow are for elastic runs"),
        (lambda: FaultConfig(slowdown=((1, 0.5),)), "slowdown factor 0.5 of rank 1"),
        (lambda: SwitchingConfig(algo="relay"), "'relay' needs nodes to relay through"),
        (lambda: SwitchingConfig(switches=((1, parse_strategy("1x1: R0:L0-3")),)),
         "switch steps [1]"),
    ],
)  # fmt: skip
def test_each_section_checks_its_own_fields(build: Any, message: str) -> None:
    with pytest.raises(HspmdError) as caught:
        build()
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_what_spans_sections_is_checked_by_the_config() -> None:
    with pytest.raises(HspmdError, match="--elastic does not take --switch-mode weights"):
        TrainConfig(elastic=ElasticConfig(enabled=True), switching=SwitchingConfig(mode="weights"))
    with pytest.raises(HspmdError, match="without --elastic only a kill in forward"):
        routed(TrainConfig(), {"inject": (_hang(),)})


def _hang() -> Any:
    from hspmd.train.faults import parse_injections

    return parse_injections(["1@2:forward:hang"])[0]
