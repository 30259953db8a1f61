"""The trace recorder: spans and comm steps in one process, then a real traced run whose
comm events match the comm counts, with aligned clocks."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from typing import Any

import pytest

from hspmd.runtime.counting import count_comm
from hspmd.runtime.launch import launch
from hspmd.runtime.trace import COMM, COMPUTE, NULL, RankTrace, Recorder, chrome_trace
from hspmd.runtime.world import World
from hspmd.train.api import train_config
from hspmd.train.config import TrainConfig
from hspmd.train.loop import run_rank
from hspmd.train.reference import run_reference


def _spans(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def test_spans_and_comm_steps_are_recorded_in_order() -> None:
    rec = Recorder(0)
    with rec.span("F", cat="forward", micro_batch=1):
        with rec.comm_step("all-gather"):
            rec.op("all_gather", (0, 1), 64)
        rec.op("all_reduce", (0, 2), 8)  # outside any step: an event of its own
    end = rec.begin("Post", cat="post")
    end()
    names = [(e[0], e[1], e[2]) for e in rec.events]
    assert names == [
        ("all-gather", "comm", COMM),
        ("all-reduce", "comm", COMM),
        ("F", "forward", COMPUTE),
        ("Post", "post", COMPUTE),
    ]
    gather = rec.events[0][5]
    assert gather == {"kind": "all-gather", "peers": [0, 1], "bytes": 64,
                      "ops": {"all_gather": 1}}  # fmt: skip
    assert rec.events[2][5] == {"micro_batch": 1}
    for _, _, _, begin, end_ns, _ in rec.events:
        assert end_ns >= begin


def test_null_recorder_records_nothing() -> None:
    assert not NULL.enabled
    with NULL.span("F", cat="forward", micro_batch=0):
        pass
    NULL.begin("step 1", cat="step")()
    assert NULL.span("a", cat="b") is NULL.span("c", cat="d")  # one shared no-op


def test_chrome_trace_puts_ranks_on_rank_0s_clock() -> None:
    # rank 1's clock runs 1000 ns behind rank 0's: its events shift forward by 1000 ns
    zero = RankTrace(0, (("F", "forward", 0, 5_000, 7_000, None),), 0, 0, 4_000)
    one = RankTrace(1, (("B", "backward", 0, 4_000, 6_000, {"micro_batch": 0}),), 1_000, 50, 4_000)
    trace = chrome_trace([one, zero], meta={"model": "x"})
    spans = _spans(trace)
    assert [(e["pid"], e["ts"], e["dur"]) for e in spans] == [(0, 1.0, 2.0), (1, 1.0, 2.0)]
    assert trace["otherData"]["clocks"]["1"] == {"offset_us": 1.0, "uncertainty_us": 0.05}
    assert trace["otherData"]["model"] == "x"
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "thread_name"}  # fmt: skip
    assert names[(1, 0)] == "compute" and names[(1, 1)] == "comm"
    json.dumps(trace)  # plain JSON


# -- a real run ----------------------------------------------------------------------------

# Pipeline 0: a TP2 stage then a TP1 stage (TP collectives, a BSR boundary); pipeline 1: one
# rank; then a switch to two TP2 pipelines (fused BSR) and a checkpoint save.
_CONFIG = dict(
    strategy="2x2: R0-1:L0-1 R2:L2-3; 2x2: R3:L0-3",
    switches=((2, "2x2: R0-1:L0-3; 2x2: R2-3:L0-3"),),
    global_batch=8, seq_len=16, steps=3, save_every=3,
)  # fmt: skip


def _traced_rank(
    world: World, config: TrainConfig
) -> tuple[RankTrace, dict[str, int], int, list[float]]:
    rec = Recorder.start(world)
    with count_comm(world) as log:
        out = run_rank(world, config, rec=rec)
    return rec.export(), log.counts(), log.nbytes(), [r.loss for r in out["records"]]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[Any]]:
    save = str(tmp_path_factory.mktemp("ckpt"))
    config = train_config(**_CONFIG, save=save)  # type: ignore[arg-type]
    out = launch(_traced_rank, 4, args=(config,), threads=1, timeout_s=600)
    return chrome_trace([part for part, *_ in out]), out


@pytest.mark.multiproc
def test_a_traced_run_trains_as_the_reference(traced: tuple[dict[str, Any], list[Any]]) -> None:
    _, out = traced
    reference = run_reference(train_config(**{**_CONFIG, "switches": ()}))  # type: ignore[arg-type]
    assert out[0][3] == pytest.approx(list(reference.losses), rel=1e-5)


@pytest.mark.multiproc
def test_events_per_rank(traced: tuple[dict[str, Any], list[Any]]) -> None:
    trace, _ = traced
    by_rank: dict[int, Counter[str]] = defaultdict(Counter)
    for e in _spans(trace):
        by_rank[e["pid"]][e["cat"]] += 1
    assert sorted(by_rank) == [0, 1, 2, 3]
    for rank, cats in by_rank.items():
        # 2 micro-batches per step, 3 steps, on every rank (all train in both strategies)
        assert cats["forward"] == cats["backward"] == 6, (rank, cats)
        assert cats["step"] == cats["post"] == 3 and cats["setup"] == 1
        assert cats["switch"] == 1 and cats["checkpoint"] == 1
        assert cats["comm"] > 0
    kinds = {e["name"] for e in _spans(trace) if e["cat"] == "comm"}
    assert {"all-reduce", "send", "recv", "fused-bsr"} <= kinds, kinds


@pytest.mark.multiproc
def test_times_are_monotone_and_nested_per_thread(
    traced: tuple[dict[str, Any], list[Any]],
) -> None:
    trace, _ = traced
    rows: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in _spans(trace):
        assert e["dur"] >= 0
        rows[e["pid"], e["tid"]].append(e)
    assert {tid for _, tid in rows} == {COMPUTE, COMM}
    for (pid, tid), events in rows.items():
        starts = [e["ts"] for e in events]
        assert starts == sorted(starts), (pid, tid)
        open_ends: list[float] = []  # spans on one thread nest or follow each other
        for e in events:
            while open_ends and open_ends[-1] <= e["ts"]:
                open_ends.pop()
            end = e["ts"] + e["dur"]
            assert not open_ends or end <= open_ends[-1] + 1e-3, (pid, tid, e)
            open_ends.append(end)
        if tid == COMM:  # communication steps never overlap
            for a, b in zip(events, events[1:], strict=False):
                assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (pid, a, b)


def _check_counts(trace: dict[str, Any], out: list[Any]) -> None:
    """On every rank the comm events' ops and bytes sum to what count_comm counted."""
    for rank, (_, counts, nbytes, _) in enumerate(out):
        comm = [e for e in _spans(trace) if e["pid"] == rank and e["cat"] == "comm"]
        ops: Counter[str] = Counter()
        for e in comm:
            ops.update(e["args"]["ops"])
            assert e["args"]["kind"] == e["name"]
            assert rank in e["args"]["peers"] or not e["args"]["ops"]
        assert dict(ops) == counts, rank
        assert sum(e["args"]["bytes"] for e in comm) == nbytes, rank


@pytest.mark.multiproc
def test_one_comm_event_per_step_matches_the_comm_counts(
    traced: tuple[dict[str, Any], list[Any]],
) -> None:
    _check_counts(*traced)


@pytest.mark.multiproc
def test_zero1_sequence_parallel_and_a_relayed_switch_match_the_counts() -> None:
    config = train_config(
        strategy="2x2: R0-1:L0-1 R2:L2-3; 2x2: R3:L0-3", global_batch=8, seq_len=16,
        steps=2, zero=1, sequence_parallel=True, switch_algo="relay", ranks_per_node=2,
        switches=((2, "2x2: R0-1:L0-3; 2x2: R2-3:L0-3"),),
    )  # fmt: skip
    out = launch(_traced_rank, 4, args=(config,), threads=1, timeout_s=600)
    trace = chrome_trace([part for part, *_ in out])
    _check_counts(trace, out)
    kinds = {e["name"] for e in _spans(trace) if e["cat"] == "comm"}
    # layers 0-1 (TP 2 beside TP 1): point to point; layers 2-3 (one rank each): a collective;
    # the gathers after Adam in one batch
    want = {"split-reduce-scatter", "reduce-scatter", "zero-gather", "relay-round"}
    assert want <= kinds, sorted(kinds)


@pytest.mark.multiproc
def test_clocks_line_a_send_up_with_its_receive(
    traced: tuple[dict[str, Any], list[Any]],
) -> None:
    """The k-th pipeline send from a to b is received in b's k-th receive from a: on the
    aligned clocks the receive ends after the send began (to within the sync's error)."""
    trace, _ = traced
    sends, recvs = defaultdict(list), defaultdict(list)
    for e in _spans(trace):
        if e["cat"] == "comm" and e["name"] in ("send", "recv"):
            me = e["pid"]
            for peer in e["args"]["peers"]:
                if peer != me:
                    key = (me, peer) if e["name"] == "send" else (peer, me)
                    (sends if e["name"] == "send" else recvs)[key].append(e)
    clocks = trace["otherData"]["clocks"]
    assert sends and sends.keys() == recvs.keys()
    for (a, b), sent in sends.items():
        got = recvs[(a, b)]
        assert len(sent) == len(got), (a, b)
        slack = clocks[str(a)]["uncertainty_us"] + clocks[str(b)]["uncertainty_us"]
        for s, r in zip(sent, got, strict=True):
            assert r["ts"] + r["dur"] + slack >= s["ts"], (a, b, s, r)
    for rank in ("1", "2", "3"):  # one machine, one monotonic clock: offsets within error
        assert abs(clocks[rank]["offset_us"]) <= clocks[rank]["uncertainty_us"] + 50.0


@pytest.mark.multiproc
def test_one_launcher_per_node_gathers_every_rank_on_node_0() -> None:
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from hspmd.runtime.launch import NodeSpec
    from hspmd.train.trainer import train

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    kwargs = {"strategy": "2x1: R0:L0-3; 2x1: R1:L0-3", "global_batch": 4, "seq_len": 16,
              "steps": 2}  # fmt: skip
    code = (
        "from hspmd.runtime.launch import NodeSpec\n"
        "from hspmd.train.api import train_config\n"
        "from hspmd.train.trainer import train\n"
        f"r = train(train_config(**{kwargs!r}), trace=True,\n"
        f"          node=NodeSpec(1, 2, '127.0.0.1', {port}), threads=1)\n"
        "print(r.trace is None)"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root / 'src'}:{root}"}
    other = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        config = train_config(**kwargs)  # type: ignore[arg-type]
        here = train(config, trace=True, node=NodeSpec(0, 2, "127.0.0.1", port), threads=1)
        out, _ = other.communicate(timeout=300)
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
    assert out.strip() == "True"  # node 1 keeps nothing: node 0 has the run's trace
    assert here.trace is not None
    spans = [e for e in here.trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert sum(e["cat"] == "forward" and e["pid"] == 1 for e in spans) == 4
