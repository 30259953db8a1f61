"""Held-out evaluation without processes: the flags, the held-out tokens never trained on,
the reference's evaluation (it changes nothing of the training), the forward-only
schedule, and the log files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hspmd.data.errors import DataError
from hspmd.specialize.schedule import forward_only, simulate
from hspmd.train.api import revise, train_config
from hspmd.train.batches import check_data, eval_batches, step_batches, step_documents
from hspmd.train.config import EvalConfig, EvalRecord, StepRecord, TrainConfig, TrainError
from hspmd.train.logs import RECORDS, RunLog
from hspmd.train.reference import run_reference

TINY = (("num_layers", 1),)


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSPMD_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def positions(tmp_path: Path) -> Path:
    """A flat token file whose id at position i is i: an id says where it was read."""
    path = tmp_path / "positions.bin"
    np.arange(4000, dtype=np.uint16).tofile(path)
    return path


def _config(**changes: object) -> TrainConfig:
    base = train_config(model_kwargs=TINY, seq_len=16, global_batch=4, steps=3,
                       data_max_bytes=1 << 16)  # fmt: skip
    return revise(base, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(every=2), r"--eval-every 2 needs held-out data: give --eval-split 0.01"),
        (dict(every=-1), r"--eval-every -1 --eval-batches 4: give N >= 0"),
        (dict(batches=0), r"--eval-batches 0: give N >= 0 steps .* and K >= 1 batches"),
        (dict(split=1.0), r"--eval-split 1.0: give the fraction of --data to hold out"),
        (dict(split=0.1, data="held.txt"), r"evaluate on one of them; drop --eval-split"),
    ],
)
def test_bad_flags_are_one_line_with_the_fix(changes: dict[str, object], message: str) -> None:
    with pytest.raises(TrainError, match=message):
        EvalConfig(**changes)  # type: ignore[arg-type]


def test_packed_steps_refuse_evaluation() -> None:
    with pytest.raises(TrainError, match=r"--eval-every 2 with --tokens-per-step: .* drop"):
        _config(step_tokens=128, evaluation=EvalConfig(every=2, split=0.1))


def test_held_out_tokens_are_never_trained_on(positions: Path) -> None:
    config = _config(model_kwargs=(("vocab_size", 4096), *TINY), data=str(positions),
                     steps=200, evaluation=EvalConfig(every=1, split=0.1, batches=3))  # fmt: skip
    trained = torch.cat([targets for _, targets in step_batches(config)])
    # the 224 windows of 16 (+1) in the 3600 first ids, in 200 x 4 rows: each one read
    assert int(trained.max()) == 224 * 16 < 3600
    held = eval_batches(config)
    assert len(held) == 3 and min(int(tokens.min()) for tokens, _ in held) >= 3600
    # the same windows for another seed and at every call (fixed, not drawn per step)
    other = eval_batches(revise(config, seed=5))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(held, other, strict=True))


def test_held_out_bytes_are_never_trained_on(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"a" * 900 + b"b" * 100)
    config = _config(data=str(text), steps=40, evaluation=EvalConfig(every=1, split=0.1, batches=1))
    assert all(int(t.max()) == ord("a") for t, _ in step_batches(config))
    ((tokens, targets),) = eval_batches(config)
    assert set(torch.cat([tokens, targets]).unique().tolist()) <= {0, ord("b")}


def test_packed_documents_end_before_the_held_out_part(positions: Path, tmp_path: Path) -> None:
    ids = np.arange(2, 3002, dtype=np.uint16)
    ids[49::50] = 1  # documents of 50 ids, each ending with id 1
    path = tmp_path / "docs.bin"
    ids.tofile(path)
    config = _config(model_kwargs=(("vocab_size", 4096), *TINY), data=str(path), eod_id=1,
                     step_tokens=128, seq_len=64, evaluation=EvalConfig(split=0.2))  # fmt: skip
    steps = step_documents(config, min_documents=1)
    seen = torch.cat([d for _ in range(60) for d in next(steps).documents])
    assert int(seen.max()) < 2400 + 2  # ids at positions >= 2400 are held out


def test_check_data_names_the_eval_data(positions: Path, tmp_path: Path) -> None:
    vocab = (("vocab_size", 4096), *TINY)
    few = _config(model_kwargs=vocab, data=str(positions),
                  evaluation=EvalConfig(every=1, split=0.01, batches=4))  # fmt: skip
    with pytest.raises(DataError, match=r"the held-out 0.01 of .*positions.bin holds 2 windows"):
        check_data(few)
    text = tmp_path / "held.txt"
    text.write_text("held-out text " * 100)
    mixed = _config(model_kwargs=vocab, data=str(positions),
                    evaluation=EvalConfig(every=1, data=str(text)))  # fmt: skip
    with pytest.raises(DataError, match=r"--eval-data .*held.txt is text \(the byte corpus\) "
                       r"but --data is a token file"):  # fmt: skip
        check_data(mixed)


def test_the_reference_evaluation_changes_no_training(tmp_path: Path) -> None:
    held = tmp_path / "held.txt"
    held.write_text("def held_out(x):\n    return x + 1\n" * 40)
    plain = run_reference(_config())
    seen: list[object] = []
    config = _config(evaluation=EvalConfig(every=2, data=str(held), batches=2))
    evaluated = run_reference(config, on_step=seen.append)
    assert evaluated.losses == plain.losses
    for name, value in plain.params.items():
        assert torch.equal(evaluated.params[name], value), name
    assert [type(r).__name__ for r in seen] == ["StepRecord", "StepRecord", "EvalRecord",
                                                "StepRecord"]  # fmt: skip
    (record,) = evaluated.evaluations
    assert record.step == 2 and record.batches == 2 and record.tokens == 2 * 4 * 16
    assert record.perplexity == pytest.approx(np.exp(record.loss))
    assert 0.0 < record.loss < 6.0


def test_the_forward_only_schedule_pairs_its_sends() -> None:
    stages = [forward_only(3, s, 4).actions for s in range(3)]
    assert str(forward_only(3, 0, 4)) == "Pre F0 F1 F2 F3"
    simulate(stages, rendezvous=True)  # no deadlock, one order between neighbours


def test_the_log_is_the_json_records_and_event_files(tmp_path: Path) -> None:
    records = [StepRecord(step=1, loss=5.5, tokens=512, seconds=0.25, lr=1e-3, grad_norm=2.0),
               EvalRecord(step=1, loss=5.0, batches=2, tokens=1024, seconds=0.1)]  # fmt: skip
    with RunLog(tmp_path, tensorboard=False) as log:
        for record in records:
            log(record)
    lines = (tmp_path / RECORDS).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [r.to_json() for r in records]
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with RunLog(tmp_path / "tb") as log:
        assert log.events
        for record in records:
            log(record)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "train/lr", "train/grad_norm",
                                             "train/tokens_per_s", "eval/loss", "eval/perplexity"}  # fmt: skip
    (point,) = events.Scalars("eval/perplexity")
    assert point.step == 1 and point.value == pytest.approx(np.exp(5.0), rel=1e-6)
    assert events.Scalars("train/tokens_per_s")[0].value == pytest.approx(2048)


def test_an_unwritable_log_folder_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(TrainError, match=r"--log-dir .*: cannot write there .*give a writable"):
        RunLog(blocker / "logs")
