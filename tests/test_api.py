"""The public API (``hspmd.api``, docs/api.md): typed keywords, the exported names, the
verbs without processes, and docs/api.md's examples as doctests."""

from __future__ import annotations

import dataclasses
import doctest
from pathlib import Path
from typing import Any, get_type_hints

import pytest

import hspmd
import hspmd.api
from hspmd.errors import HspmdError
from hspmd.train.api import RunOptions
from hspmd.train.config import SECTIONS, TrainConfig, TrainError

DOCS = Path(__file__).parents[1] / "docs" / "api.md"


def test_docs_api_examples() -> None:
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testfile(str(DOCS), module_relative=False, optionflags=flags)
    assert result.failed == 0 and result.attempted > 10, result


def test_every_public_name_loads_from_hspmd() -> None:
    assert set(hspmd.__all__) == {*hspmd.api.__all__, "__version__"}
    for name in hspmd.api.__all__:
        assert getattr(hspmd, name) is getattr(hspmd.api, name), name


def test_run_options_are_train_config_fields_with_their_types() -> None:
    for name, kind in get_type_hints(RunOptions).items():
        if name in ("lr", "model_kwargs", "zero1"):  # zero1: the synonym of zero=1
            continue
        owner: Any = TrainConfig  # the field's dataclass: TrainConfig, or its section's
        field = name
        if name in SECTIONS:
            section, field = SECTIONS[name]
            owner = get_type_hints(TrainConfig)[section]
        fields = {f.name for f in dataclasses.fields(owner)}
        assert field in fields, f"RunOptions.{name} is no field of {owner.__name__}"
        widened = ("global_batch", "switches", "slowdown", "grow", "zero_shares", "inject",
                   "tp_rules", "no_decay")  # fmt: skip
        if name not in widened:
            assert kind == get_type_hints(owner)[field], (name, kind)
    documented = DOCS.read_text()
    missing = [n for n in get_type_hints(RunOptions) if f"`{n}`" not in documented]
    assert not missing, f"docs/api.md does not list {missing}"


def test_fit_takes_lr_and_the_strategys_batch() -> None:
    """The docstring example of fit (issue 36): a heterogeneous strategy's global batch and
    ``lr`` by keyword."""
    config = hspmd.train_config("llama-tiny", "2x1: R0-1:L0-1; 2x1: R2:L0-1", steps=10,
                                lr=1e-3, model_kwargs={"num_layers": 2})  # fmt: skip
    assert config.batch.global_batch == 4 and config.adam.lr == 1e-3
    from hspmd.train.trainer import check_config

    check_config(config)  # the strategy trains this config (no StrategyError)
    with pytest.raises(TrainError, match="unknown option 'learning_rate'"):
        hspmd.train_config("llama-tiny", learning_rate=1e-3)  # type: ignore[call-arg]


def test_build_refuses_what_only_fit_runs() -> None:
    class NoWorld:  # refused before the world is used
        rank, world_size = 0, 2

    options: dict[str, Any] = {"switches": ((2, "1x1: R0-1:L0-3"),)}
    with pytest.raises(TrainError, match="build does not take switches"):
        hspmd.build("llama-tiny", "2x1: R0:L0-3", world=NoWorld(), **options)  # type: ignore[arg-type]


def test_the_recipe_by_flat_names_as_the_cli_flags() -> None:
    """``fit(weight_decay=0.1, ...)`` as ``hspmd train --weight-decay 0.1`` (the recipe's
    flat names win over ``adam``'s fields); a misspelt keyword names the closest one."""
    flat = hspmd.train_config("llama-tiny", weight_decay=0.1, lr_schedule="cosine",
                              warmup_steps=2, min_lr=1e-5, no_decay=["*.bias"], beta2=0.95,
                              adam=hspmd.AdamConfig(weight_decay=0.5, eps=1e-6))  # fmt: skip
    assert flat.adam == hspmd.AdamConfig(
        weight_decay=0.1, lr_schedule="cosine", warmup_steps=2, min_lr=1e-5,
        no_decay=("*.bias",), beta2=0.95, eps=1e-6,
    )  # fmt: skip
    with pytest.raises(TrainError, match="unknown option 'weight_decy': did you mean 'weight_decay'"):  # fmt: skip
        hspmd.train_config("llama-tiny", weight_decy=0.1)  # type: ignore[call-arg]
    with pytest.raises(TrainError, match="--lr-schedule 'cos': choose one of constant, cosine"):
        hspmd.train_config("llama-tiny", lr_schedule="cos")  # type: ignore[arg-type]


def test_metadata_verbs_refuse_a_length_past_the_model() -> None:
    # simulate and plan_strategy costed llama-tiny (512 positions) at any length; fit refused it
    s = "1x1: R0:L0-3"
    for verb in (
        lambda: hspmd.explain("llama-tiny", s, seq_len=1024),
        lambda: hspmd.simulate("llama-tiny", s, cluster="h200x8", seq_len=1024),
        lambda: hspmd.plan_strategy("llama-tiny", cluster="h200x8", global_batch=8, seq_len=1024),
    ):
        with pytest.raises(HspmdError, match=r"seq_len=1024 exceeds .*max_seq_len=512"):
            verb()


def test_fit_refuses_to_save_into_another_runs_checkpoint(tmp_path: Path) -> None:
    # saving prunes all but the newest step-N: the new run's steps, or the old one, were lost
    import torch

    from hspmd.annotation import parse_annotation
    from hspmd.checkpoint.store import save
    from hspmd.plan.params import ParamSpec

    specs = {"w": ParamSpec("w", (2,), parse_annotation("[0]{}"))}
    save(tmp_path, step=4, model="llama-tiny", strategy="1x1: R0:L0-3", specs=specs,
         tensors_by_rank={0: {"w": torch.zeros(2)}})  # fmt: skip
    with pytest.raises(TrainError, match=r"already holds checkpoint step-00000004 .* resume="):
        hspmd.fit("llama-tiny", "1x1: R0:L0-3", steps=1, seq_len=16, save=str(tmp_path))
    assert (tmp_path / "step-00000004" / "manifest.json").is_file()
