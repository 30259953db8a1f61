"""ZeRO-2 and ZeRO-3 (docs/zero.md): equal to the single-device reference under DP, DP x TP,
heterogeneous pipelines (uneven shares), PP with recompute, SP, bf16, a live switch and a
resume; memory in the order of the stages; exact counts of ZeRO-3's gathers; the refusals.

One launch runs every case in order (``train_many``); the resume case reads the checkpoint
the case before it wrote.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hspmd.errors import StrategyError
from hspmd.plan.schema import build_plan, plan_from_json, plan_to_json
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.specialize.executable import build_executable
from hspmd.specialize.explain import explain, render
from hspmd.train.api import revise, train_config
from hspmd.train.compare import compare
from hspmd.train.config import AdamConfig, TrainConfig, TrainError
from hspmd.train.reference import TrainResult, run_reference
from hspmd.train.trainer import check_config, train_many
from hspmd.train.zero_units import insert_points

BASE = train_config(
    model_kwargs=(("num_layers", 2),), seq_len=16, global_batch=4, steps=3,
    adam=AdamConfig(lr=1e-3),
)  # fmt: skip
DP = "2x1: R0:L0-1; 2x1: R1:L0-1"
HETERO = "2x1: R0:L0 R1:L1; 1x2: R2:L0-1"  # PP beside one stage, other micro-batch counts


def _cases(root: Path) -> dict[str, dict[str, Any]]:
    ckpt = str(root / "zero3")
    return {
        # lock step: reduced in every B (2 micro-batches), per-layer gathers
        "ZeRO-2 DP": dict(strategy=DP, zero=2),
        "ZeRO-2 heterogeneous, uneven shares": dict(
            strategy="2x1: R0-1:L0-1; 1x2: R2:L0-1", zero=2, zero_shares=(1.0, 3.0)
        ),
        "ZeRO-3 DP": dict(strategy=DP, zero=3),
        "ZeRO-3 DP x TP, TP differs, grad accumulation": dict(
            strategy="2x1: R0-1:L0-1; 2x1: R2:L0-1", zero=3, grad_accum=2
        ),
        "ZeRO-3 PP, recompute, no overlap": dict(
            strategy="2x1: R0:L0 R1:L1; 2x1: R2:L0 R3:L1", zero=3, recompute=True,
            zero_overlap=False,
        ),
        "ZeRO-3 SP, TP differs": dict(
            strategy="2x1: R0-1:L0-1; 2x1: R2:L0-1", zero=3, sequence_parallel=True
        ),
        # different schedules: gathered once per step
        "ZeRO-3 heterogeneous, uneven shares, clipping": dict(
            strategy=HETERO, zero=3, zero_shares=(2.0, 1.0), clip_grad_norm=1.0
        ),
        "ZeRO-3 switch": dict(
            strategy=DP, zero=3, switches=((3, "1x2: R0-1:L0-1; 1x2: R2:L0 R3:L1"),)
        ),
        "ZeRO-3 save": dict(strategy=DP, zero=3, steps=2, save=ckpt),
        "ZeRO-3 resume on other replicas": dict(strategy=HETERO, zero=3, resume=ckpt),
        "bf16 ZeRO-3 SP": dict(
            strategy="2x1: R0-1:L0-1; 2x1: R2:L0-1", zero=3, sequence_parallel=True,
            dtype="bf16",
        ),
        **{f"memory ZeRO-{z}": dict(strategy=DP, zero=z, measure_memory=True) for z in range(4)},
    }  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[TrainConfig, TrainResult]]:
    cases = _cases(tmp_path_factory.mktemp("zero"))
    configs = [revise(BASE, **changes) for changes in cases.values()]
    results = train_many(configs, threads=1, timeout_s=900, trace=True)
    return {name: (c, r) for name, c, r in zip(cases, configs, results, strict=True)}


def _reference(config: TrainConfig) -> TrainResult:
    plain = dict(strategy=None, zero=0, zero_shares=(), switches=(), save=None, resume=None)
    return run_reference(revise(config, **plain, dtype="fp32", steps=3))


EQUAL = [n for n in _cases(Path(".")) if not n.startswith(("memory", "bf16", "ZeRO-3 save"))]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", EQUAL)
def test_zero_equals_the_reference(runs: Any, name: str) -> None:
    config, result = runs[name]
    reference = _reference(config)
    if config.checkpoint.resume:  # steps 3 on, from the checkpoint of step 2
        assert [r.step for r in result.records] == [3]
        assert result.losses[0] == pytest.approx(reference.losses[2], rel=1e-5)
        reference = dataclasses.replace(reference, records=reference.records[2:])
    comparison = compare(result, reference, config=config)
    assert comparison.ok, str(comparison)


@pytest.mark.multiproc
def test_bf16_zero3_is_near_the_fp32_reference(runs: Any) -> None:
    config, result = runs["bf16 ZeRO-3 SP"]
    reference = _reference(config)
    for got, want in zip(result.losses, reference.losses, strict=True):
        assert got == pytest.approx(want, rel=1e-3)
    for name, want in reference.params.items():
        assert float((result.params[name] - want).norm() / want.norm()) < 5e-2, name


@pytest.mark.multiproc
def test_state_memory_falls_with_each_stage(runs: Any) -> None:
    peaks = [runs[f"memory ZeRO-{z}"][1].state_peak for z in range(4)]
    assert all(set(p) == {0, 1} for p in peaks), peaks
    # fp32 ZeRO-1 on 2 replicas: its master shards and their gradients (8P/2) weigh what
    # it saves on the moments (8P/2): 16P either way; then each stage saves more
    zero0, zero1, zero2, zero3 = (p[0] for p in peaks)
    assert zero0 == zero1 > zero2 > zero3, (zero0, zero1, zero2, zero3)
    assert zero3 < 0.7 * zero0, (zero0, zero3)  # shards (1/2) plus a gathered layer


@pytest.mark.multiproc
def test_zero3_gathers_per_layer_in_lock_step_and_once_per_step_otherwise(runs: Any) -> None:
    """Rank 0 of DP 2 x 2 micro-batches: units embed, layer 0, layer 1, norm + head; each F
    gathers 4, each B 2 (the head is still gathered from the F, the embedding's backward
    reads no weight); reduces: one bucket per unit per B. The heterogeneous strategy's rank 0 (stage L0 of its pipeline) gathers once
    per step and reduces its one bucket in the step's last B."""
    for name, gathers, reduces in (
        ("ZeRO-3 DP", 2 * (4 + 2), 2 * 4),
        ("ZeRO-3 heterogeneous, uneven shares, clipping", 1, 1),
    ):
        trace = runs[name][1].trace
        assert trace is not None
        steps = Counter(
            e["name"] for e in trace["traceEvents"]
            if e.get("pid") == 0 and e["name"] in ("zero-gather", "zero-reduce")
        )  # fmt: skip
        # the last step's count, plus the final gather of the pieces
        assert steps["zero-gather"] == 3 * gathers + 1, (name, steps)
        assert steps["zero-reduce"] == 3 * reduces, (name, steps)


# -- without processes --------------------------------------------------------------------


def test_stages_and_shares_are_checked_in_one_line() -> None:
    with pytest.raises(StrategyError, match="zero=4: choose a ZeRO stage 0, 1, 2 or 3"):
        StrategyOptions(zero=4)
    with pytest.raises(StrategyError, match="with a ZeRO stage"):
        StrategyOptions(zero_shares=(1.0, 2.0))
    with pytest.raises(StrategyError, match="zero=5: choose"):  # the config's options
        train_config(zero=5)
    with pytest.raises(StrategyError, match="zero_shares has 3 weights for 2 pipelines"):
        check_config(revise(BASE, strategy=DP, zero=3, zero_shares=(1, 2, 3)))
    with pytest.raises(TrainError, match="--elastic does not take --zero"):
        revise(BASE, strategy=DP, zero=3, elastic=True)
    with pytest.raises(TrainError, match="--zero 2 adds nothing under switch mode 'weights'"):
        revise(BASE, strategy=DP, zero=2, switch_mode="weights")


def test_plan_json_carries_the_stage_and_the_shares() -> None:
    strategy = parse_strategy("1x1: R0:L0-1; 1x1: R1-2:L0-1")
    options = StrategyOptions(zero=3, zero_shares=(3.0, 1.0))
    plan = build_plan(strategy, BASE.model_config(), seq_len=16, options=options)
    data = plan_to_json(plan)
    assert data["options"]["zero"] == 3 and data["options"]["zero_shares"] == [3.0, 1.0]
    assert str(plan.table("optimizer_states")["layers.0.attn.wq.weight"].annotation) == (
        "h1(48,16): [0]{} [1,2]{0:2}"
    )
    assert plan_from_json(data) == plan
    old = {**data, "options": {"zero1": True}}  # a file from before the stages
    assert plan_from_json(old).options.zero == 1


def test_explain_says_how_zero3_gathers() -> None:
    config = BASE.model_config()
    for text, how in ((DP, "per layer in every F and B"), (HETERO, "once per step")):
        e = explain(config, parse_strategy(text), StrategyOptions(zero=3), seq_len=16)
        out = render(e)
        # one rank per replica's stage: the pieces line up, a reduce-scatter collective
        assert how in out and "Post:                reduce-scatter" in out, out
        assert "gathers (" in out, out


def test_units_are_the_same_on_replicas_of_different_tp() -> None:
    """The replicas of a layer gather the same parameters in the same order, whatever the
    reshards their TP degree puts between a layer's nodes."""
    config = revise(BASE, model="hspmd.models.examples:gpt2").model_config()
    strategy = parse_strategy("2x1: R0-1:L0-1; 2x1: R2:L0-1")
    found = []
    for rank in (0, 2):
        exe = build_executable(config, strategy, StrategyOptions(), rank, seq_len=16, seed=0)
        names = {n: n for n in config.parameter_shapes() if n in exe.params}
        found.append(insert_points(exe.graph_module, names))
    assert found[0] == found[1]
    assert [len(u.names) for u in found[0]] == [2, 16, 16, 3]  # wte and wpe, 2 layers, ln_f
    assert [u.backward for u in found[0]] == [False, True, True, True]


def test_the_simulator_prices_zero3_gathers_and_the_model_its_memory() -> None:
    """Lock step: ZeRO-3 costs at least ZeRO-2's step (the same reduces, cut per layer, and
    its gathers, partly hidden behind compute; ZeRO-1 may cost more than both: the runtime
    gathers its fp32 masters one by one, and the simulator prices that). Different schedules: one gather of the stage per step, in the F's (the step
    may even shorten: Post's all-gather after Adam goes)."""
    from hspmd.cost.cluster import load_cluster
    from hspmd.cost.lines import CostModel
    from hspmd.models.config import get_config
    from hspmd.planner.predict import predict

    config, cost = get_config("llama-32b"), CostModel.of(load_cluster("h20x32"))
    for text in (
        "16x1: R0-7:L0-29 R8-15:L30-59; 16x1: R16-23:L0-29 R24-31:L30-59",
        "16x1: R0-7:L0-29 R8-15:L30-59; 16x1: R16-23:L0-59",
    ):
        got = {
            z: predict(parse_strategy(text), config, cost, seq_len=4096,
                       options=StrategyOptions(zero=z, sequence_parallel=True, dtype="bf16"))
            for z in (1, 2, 3)
        }  # fmt: skip
        if text.endswith("L30-59"):  # lock step
            assert got[3].step_time_s >= got[2].step_time_s, text
        f1, f3 = (got[z].work[(0, 0)].forward_s for z in (1, 3))
        assert f3 > f1, text  # the gathers, in the forward
    # the last, different schedules: the stage whole through the step, and its stored shards
    assert got[3].memory[16].weights > got[1].memory[16].weights
