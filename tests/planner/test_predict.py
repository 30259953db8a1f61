"""The step prediction: schedules as tasks (checked by hand), memory by hand, segments."""

from __future__ import annotations

from pathlib import Path

import pytest

from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.cost.stage import StageWork, layer_params
from hspmd.models.config import LlamaConfig, get_config
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.planner.memory import OVERHEAD_BYTES, in_flight, rank_memory
from hspmd.planner.predict import _pipeline_tasks, predict, segments
from hspmd.sim.engine import simulate
from hspmd.specialize.schedule import make_schedule


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_equal_stages_take_m_plus_s_minus_one_slots(fake_cluster: Path, schedule: str) -> None:
    # F = 1, B = 2, free sends: both schedules take (m + S - 1) * (F + B) = (4 + 3 - 1) * 3.
    cost = CostModel.of(load_cluster(fake_cluster))
    pipe = parse_strategy("4x1: R0:L0-1 R1:L2-2 R2:L3-3").pipelines[0]
    works = [StageWork(1.0, 2.0, 0.0, 0.0)] * 3
    result = simulate(_pipeline_tasks(0, pipe, works, cost, schedule))
    assert result.makespan == pytest.approx(18.0)
    # each stage runs its actions in the order the runtime's schedule lists them
    for s in range(3):
        spans = sorted(
            (sp for sp in result.spans if sp.task_id.startswith(f"p0s{s}") and sp.category in "FB"),
            key=lambda sp: sp.start,
        )
        want = [str(a) for a in make_schedule(schedule, 3, s, 4) if a.kind in ("F", "B")]
        assert [sp.label for sp in spans] == want


def test_one_f_one_b_by_hand_with_sends(fake_cluster: Path) -> None:
    # 2 stages, m = 2, F = 1, B = 2; each activation and gradient send takes x seconds
    # (50 GB over the 100 GB/s NVLink of node 0, plus the link's overhead).
    cost = CostModel.of(load_cluster(fake_cluster))
    nbytes = 50e9
    pipe = parse_strategy("2x1: R0:L0-1 R1:L2-3").pipelines[0]
    works = [StageWork(1.0, 2.0, 0.0, nbytes)] * 2
    send = cost.send(nbytes, 0, 1)
    result = simulate(_pipeline_tasks(0, pipe, works, cost, "1f1b"))
    # s0: F0 [0,1] F1 [1,2]; s1: F0 [1+x, 2+x] B0 [2+x, 4+x] F1 [4+x, 5+x] B1 [5+x, 7+x];
    # s0: B0 [4+2x, 6+2x] B1 [7+2x, 9+2x]  (x = one send)
    assert result.span("p0s1B0").start == pytest.approx(2 + send)
    assert result.span("p0s0B0").start == pytest.approx(4 + 2 * send)
    assert result.makespan == pytest.approx(9 + 2 * send)


def test_memory_by_hand() -> None:
    config = LlamaConfig(num_layers=2)
    p = layer_params(config)
    mem = rank_memory(
        config, rank=0, tp=1, num_layers=1, first=False, last=False, in_flight_micro_batches=2,
        micro_batch_size=1, seq_len=8, replicas=2,
        options=StrategyOptions(zero=1, dtype="bf16"),
    )  # fmt: skip
    assert (mem.weights, mem.gradients, mem.optimizer) == (2 * p, 4 * p, 12 * p / 2)
    # per token of a layer (LlamaCost.token_bytes), H = 64, F = 128, q = 64, kv = 32,
    # 4 heads, bf16: norms 2 (2H + 4), matmul inputs 2 (2H), attention 2 (2q + 2kv) + 4 x 4,
    # MLP 3 (2F); 8 tokens of each of 2 micro-batches in flight
    per_token = 2 * (2 * 64 + 4) + 4 * 64 + 2 * (128 + 64) + 16 + 6 * 128
    assert (config.hidden_size, config.intermediate_size, config.num_kv_heads) == (64, 128, 2)
    assert mem.activations == 2 * 8 * per_token
    assert (
        mem.logits == 0 and mem.peak == 2 * p + 4 * p + 6 * p + 2 * 8 * per_token + OVERHEAD_BYTES
    )
    assert in_flight("1f1b", 4, 1, 8) == 3 and in_flight("gpipe", 4, 1, 8) == 8
    assert in_flight("1f1b", 4, 0, 2) == 2


def test_segments_follow_every_pipelines_cuts() -> None:
    config = get_config("llama-tiny")
    strategy = parse_strategy("2x1: R0:L0-1 R1:L2-3; 2x1: R2:L0-2 R3:L3-3")
    got = [(s.first, s.last, s.holders) for s in segments(strategy, config)]
    assert got == [(0, 1, ((0, 0), (1, 0))), (2, 2, ((0, 1), (1, 0))), (3, 3, ((0, 1), (1, 1)))]


def test_prediction_reports_over_memory(tmp_path: Path) -> None:
    from tests.planner.conftest import cluster_file

    path = cluster_file(tmp_path / "tiny.json", fast=2, slow=0, memory_mb=1)
    cost = CostModel.of(load_cluster(path), dtype="fp32")
    p = predict(parse_strategy("4x1: R0:L0-3; 4x1: R1:L0-3"), get_config("llama-tiny"), cost,
                seq_len=32, options=StrategyOptions())  # fmt: skip
    assert not p.fits and set(p.over) == {0, 1}
    peak, cap = p.over[0]
    assert peak > cap == 1e6


def test_shared_cores_slow_the_ranks_that_compute_at_once(tmp_path: Path) -> None:
    """DP4 on a host where 4 processes at once compute 2x slower: every task twice as long;
    a 4-stage pipeline, mostly one stage at a time, much less."""
    from tests.cost.test_lines import _profiled_cluster

    config = get_config("llama-tiny")
    opts = StrategyOptions(dtype="fp32")
    alone = CostModel.of(
        load_cluster(_profiled_cluster(tmp_path, kind="cpu", sharing=())), dtype="fp32"
    )
    shared = CostModel.of(
        load_cluster(_profiled_cluster(tmp_path, kind="cpu", sharing=(1.0, 1.0, 1.5, 2.0))),
        dtype="fp32",
    )
    dp = parse_strategy("1x1: R0:L0-3; 1x1: R1:L0-3; 1x1: R2:L0-3; 1x1: R3:L0-3")
    a, s = (predict(dp, config, c, seq_len=16, options=opts) for c in (alone, shared))
    f = a.result.span("p0s0F0")
    assert s.result.span("p0s0F0").duration == pytest.approx(2 * f.duration)
    # two 2-stage pipelines: at most 4 compute at once, only in the steady state
    pp = parse_strategy("4x1: R0:L0-1 R1:L2-3; 4x1: R2:L0-1 R3:L2-3")
    a2, s2 = (predict(pp, config, c, seq_len=16, options=opts) for c in (alone, shared))
    assert a2.step_time_s < s2.step_time_s < 2 * a2.step_time_s


def test_shared_cores_slow_tp_collectives_only_beyond_their_group(tmp_path: Path) -> None:
    from tests.cost.test_lines import _profiled_cluster

    config = get_config("llama-tiny")
    opts = StrategyOptions(dtype="fp32")
    path = _profiled_cluster(tmp_path, kind="cpu", sharing=(1.0, 3.0))
    cost = CostModel.of(load_cluster(path), dtype="fp32")
    p = predict(parse_strategy("1x1: R0-1:L0-3"), config, cost, seq_len=16, options=opts)
    work = p.work[(0, 0)]
    compute, comm = p.result.span("p0s0F0:compute"), p.result.span("p0s0F0")
    # the 2-rank compute task weighs 2: x3; its collectives (1 ms per 2-rank call) were
    # profiled with their 2 ranks active: as measured
    assert compute.duration == pytest.approx(3 * (work.forward_s - work.forward_comm_s))
    assert comm.duration == pytest.approx(work.forward_comm_s) and work.forward_comm_s > 0
    # beside another TP pair (4 processes busy: 3 x 4 / 2 = 6 against 3) they take twice that
    two = parse_strategy("1x1: R0-1:L0-3; 1x1: R2-3:L0-3")
    q = predict(two, config, cost, seq_len=16, options=opts)
    assert q.result.span("p0s0F0").duration == pytest.approx(2 * work.forward_comm_s)


def test_gradient_sync_overlaps_the_last_backward_on_gpus(tmp_path: Path) -> None:
    """As the runtime issues it (hspmd.train.overlap): the sync of the last layers runs
    beside the backward of the first; on CPU processes sharing cores it waits. TP 2: each
    split weight is a plan of its own (llama-tiny's whole pieces fit one bucket, which is
    issued when the embedding's gradient is final, as the runtime does)."""
    from tests.cost.test_lines import _profiled_cluster

    config = get_config("llama-tiny")  # 4 layers
    dp = parse_strategy("4x1: R0-1:L0-3; 4x1: R2-3:L0-3")
    opts = StrategyOptions(dtype="fp32")
    gpus = CostModel.of(load_cluster(_profiled_cluster(tmp_path, kind="cuda", sharing=())))
    p = predict(dp, config, gpus, seq_len=16, options=opts)
    last_b = p.result.span("p0s0B3")
    first = p.result.span("sync3-3")  # layer 3's gradients are final first
    assert first.start < last_b.end <= p.result.span("sync0-0").start
    assert p.result.span("p0s0B3@L1").end == pytest.approx(last_b.start)  # pieces in a row
    cpus = CostModel.of(load_cluster(_profiled_cluster(tmp_path, kind="cpu", sharing=(1.0, 1.5))))
    q = predict(dp, config, cpus, seq_len=16, options=opts)
    assert q.result.span("sync0-3").start == q.result.span("p0s0B3").end
