"""Checkpoints: round trip, reshard on load, atomic saves (SIGKILL, injected failure), errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hspmd.checkpoint import (
    CheckpointError,
    commit_rank_states,
    latest,
    load,
    load_rank_state,
    save,
    save_rank_state,
)
from hspmd.models import get_config, init_parameter
from hspmd.plan.params import ParamSpec, parameter_annotations, state_annotations
from hspmd.plan.strategy import parse_strategy

CONFIG = get_config("llama-tiny", num_layers=2)
A = "1x1: R0-1:L0-0 R2:L1-1; 1x1: R3:L0-1"
B = "1x1: R1:L0-0 R4-5:L1-1; 2x1: R0,2:L0-1"
GLOBAL = {name: init_parameter(name, CONFIG, seed=1) for name in parameter_annotations(
    parse_strategy(A), CONFIG)}  # fmt: skip


def specs(strategy: str, *, zero1: bool = False) -> dict[str, ParamSpec]:
    if zero1:
        return state_annotations(parse_strategy(strategy), CONFIG, zero1=True)
    return parameter_annotations(parse_strategy(strategy), CONFIG)


def local(specs_: dict[str, ParamSpec], rank: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    out = {}
    for name, spec in specs_.items():
        if rank in spec.annotation:
            piece = spec.annotation.piece(rank, spec.shape)
            out[name] = (GLOBAL[name] * scale)[tuple(slice(a, b) for a, b in piece.region)].clone()
    return out


def by_rank(strategy: str, scale: float = 1.0) -> dict[int, dict[str, torch.Tensor]]:
    s = specs(strategy)
    return {r: local(s, r, scale) for r in parse_strategy(strategy).ranks}


def assemble(specs_: dict[str, ParamSpec], pieces: dict[int, dict[str, torch.Tensor]]) -> dict:
    out = {name: torch.full(spec.shape, float("nan")) for name, spec in specs_.items()}
    for rank, tensors in pieces.items():
        for name, tensor in tensors.items():
            piece = specs_[name].annotation.piece(rank, specs_[name].shape)
            out[name][tuple(slice(a, b) for a, b in piece.region)] = tensor
    return out


def test_round_trip_same_strategy(tmp_path: Path) -> None:
    saved = by_rank(A)
    save(tmp_path, step=4, model="llama-tiny", strategy=A, specs=specs(A),
         tensors_by_rank=saved, data_position={"batches": 4})  # fmt: skip
    for rank, tensors in saved.items():
        loaded = load(tmp_path, specs(A), rank, model="llama-tiny")
        assert loaded.keys() == tensors.keys()
        assert all(torch.equal(loaded[n], tensors[n]) for n in tensors)
    # duplicates are written once: pipeline 1 (rank 3) repeats pipeline 0, so it has no shard
    names = sorted(p.name for p in latest(tmp_path).iterdir())
    assert names == ["manifest.json", *(f"rank-0000{r}.safetensors" for r in range(3))]


def test_save_a_load_b_gives_the_same_global_tensors(tmp_path: Path) -> None:
    save(tmp_path, step=1, model="llama-tiny", strategy=A, specs=specs(A),
         tensors_by_rank=by_rank(A))  # fmt: skip
    for new in (specs(B), specs(B, zero1=True), specs("1x1: R7:L0-1")):
        pieces = {r: load(tmp_path, new, r) for r in range(8)}
        whole = assemble(new, pieces)
        assert all(torch.equal(whole[n], GLOBAL[n]) for n in GLOBAL)
    assert load(tmp_path, specs(B), 6) == {}  # rank 6 holds nothing under B


def test_rank_state_resumes_onto_another_strategy(tmp_path: Path) -> None:
    old, new = specs(A), specs(B)
    for rank in parse_strategy(A).ranks:
        save_rank_state(tmp_path, step=2, rank=rank, params=local(old, rank),
                        exp_avg=local(old, rank, 2.0), exp_avg_sq=local(old, rank, 3.0),
                        param_specs=old)  # fmt: skip
    commit_rank_states(tmp_path, step=2, model="llama-tiny", strategy=A, param_specs=old,
                       adam_step=2, data_position=2)  # fmt: skip
    states = {r: load_rank_state(tmp_path, rank=r, param_specs=new) for r in range(6)}
    assert {s.step for s in states.values()} == {2} and states[0].adam_step == 2
    for attr, scale in (("params", 1.0), ("exp_avg", 2.0), ("exp_avg_sq", 3.0)):
        whole = assemble(new, {r: getattr(s, attr) for r, s in states.items()})
        assert all(torch.equal(whole[n], GLOBAL[n] * scale) for n in GLOBAL)


def test_injected_failure_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    save(tmp_path, step=1, model="llama-tiny", strategy=A, specs=specs(A),
         tensors_by_rank=by_rank(A))  # fmt: skip

    def fail(rank: int) -> None:
        if rank == 2:
            raise OSError("disk full (injected)")

    with pytest.raises(OSError, match="injected"):
        save(tmp_path, step=2, model="llama-tiny", strategy=A, specs=specs(A),
             tensors_by_rank=by_rank(A, 5.0), on_shard=fail)  # fmt: skip
    assert latest(tmp_path).name == "step-00000001"
    loaded = load(tmp_path, specs(A), 3)
    assert torch.equal(loaded["embed.weight"], GLOBAL["embed.weight"])
    save(tmp_path, step=3, model="llama-tiny", strategy=A, specs=specs(A),
         tensors_by_rank=by_rank(A, 5.0))  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003"]  # pruned, cleaned


KILLED = textwrap.dedent(
    """
    import sys, time, torch
    sys.path.insert(0, {tests!r})
    from test_checkpoint import A, by_rank, specs
    from hspmd.checkpoint import save
    torch.set_num_threads(1)
    save({folder!r}, step=1, model="llama-tiny", strategy=A, specs=specs(A), tensors_by_rank=by_rank(A))
    def hang(rank):
        if rank == 1:
            print("midway", flush=True)
            time.sleep(60)
    save({folder!r}, step=2, model="llama-tiny", strategy=A, specs=specs(A),
         tensors_by_rank=by_rank(A, 5.0), on_shard=hang)
    """
)


def test_sigkill_during_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    script = KILLED.format(tests=str(Path(__file__).parent), folder=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "midway"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert (tmp_path / ".partial-step-00000002").is_dir()
    assert latest(tmp_path).name == "step-00000001"
    pieces = {r: load(tmp_path, specs(B), r) for r in range(6)}
    whole = assemble(specs(B), pieces)
    assert all(torch.equal(whole[n], GLOBAL[n]) for n in GLOBAL)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    save(tmp_path, step=1, model="llama-tiny", strategy=A, specs=specs(A),
         tensors_by_rank=by_rank(A))  # fmt: skip
    return latest(tmp_path)


def _edit(folder: Path, change: object) -> None:
    path = folder / "manifest.json"
    data = json.loads(path.read_text())
    change(data)  # type: ignore[operator]
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(format="other"), "not an hspmd checkpoint"),
        (lambda d: d.pop("tensors"), "corrupt checkpoint manifest"),
        (lambda d: d["tensors"]["norm.weight"].update(shape=[3]), "corrupt"),
        (lambda d: d["tensors"]["norm.weight"].update(shards=[[0, [[0, 99]]]]), "does not fit"),
        (lambda d: d["tensors"]["norm.weight"].update(shards=[[2, [[0, 8]]]]), "do not cover"),
        (lambda d: d["tensors"].pop("head.weight"), "no tensor 'head.weight'"),
        (lambda d: d.update(model="llama-small"), "holds model 'llama-small'"),
    ],
)
def test_corrupt_manifests_refused(saved: Path, change: object, message: str) -> None:
    _edit(saved, change)
    with pytest.raises(CheckpointError, match=message):
        load(saved.parent, specs(A), 2, model="llama-tiny")


def test_other_corruptions(saved: Path) -> None:
    (saved / "rank-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing shard"):
        load(saved.parent, specs(A), 2)
    other = parameter_annotations(parse_strategy(A), get_config("llama-tiny", num_layers=2,
                                                               hidden_size=32))  # fmt: skip
    with pytest.raises(CheckpointError, match="different model"):
        load(saved.parent, other, 0)
    (saved / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        load(saved.parent, specs(A), 0)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load(saved.parent / "nothing", specs(A), 0)
    with pytest.raises(CheckpointError, match="piece of"):
        save(saved.parent, step=5, model="m", strategy=A, specs=specs(A),
             tensors_by_rank={0: {n: torch.zeros(1) for n in GLOBAL}})  # fmt: skip
