"""hspmd.train.device: where a run's ranks and its reference compute (GPUs counted by a
stand-in: this machine has none)."""

from __future__ import annotations

import pytest
import torch

from hspmd.train import device
from hspmd.train.api import train_config
from hspmd.train.config import TrainError
from hspmd.train.device import backend_of, reference_device, run_device
from hspmd.train.reference import run_reference


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(device, "gpu_count", lambda: count)


@pytest.mark.parametrize(
    ("asked", "gpus", "ranks", "want"),
    [
        ("auto", 0, 1, "cpu"),
        ("auto", 4, 4, "cuda"),
        ("auto", 1, 4, "cpu"),  # fewer GPUs than ranks: gloo on CPU
        ("cpu", 8, 2, "cpu"),
        ("cuda", 2, 2, "cuda"),
    ],
)
def test_run_device(
    monkeypatch: pytest.MonkeyPatch, asked: str, gpus: int, ranks: int, want: str
) -> None:
    _gpus(monkeypatch, gpus)
    config = train_config(device=asked)  # type: ignore[arg-type]
    assert run_device(config, num_ranks=ranks) == want
    assert backend_of(want) == {"cpu": "gloo", "cuda": "nccl"}[want]  # type: ignore[arg-type]


def test_cuda_with_too_few_gpus_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 1)
    with pytest.raises(TrainError, match="4 ranks here but torch sees 1 GPUs") as error:
        run_device(train_config(device="cuda"), num_ranks=4)
    assert "\n" not in str(error.value) and "--device cpu" in str(error.value)


def test_elastic_runs_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 8)
    elastic = train_config(strategy="1x1: R0:L0-3; 1x1: R1:L0-3", global_batch=2, elastic=True)
    assert run_device(elastic, num_ranks=2) == "cpu"
    with pytest.raises(TrainError, match="--elastic runs on CPU processes"):
        run_device(train_config(strategy=elastic.strategy, global_batch=2, elastic=True,
                               device="cuda"), num_ranks=2)  # fmt: skip


def test_device_is_checked_and_the_reference_stays_on_cpu_without_a_gpu() -> None:
    with pytest.raises(TrainError, match="device='gpu'"):
        train_config(device="gpu")  # type: ignore[arg-type]
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert reference_device(train_config()) == torch.device("cpu")
    with pytest.raises(TrainError, match="no CUDA device"):
        reference_device(train_config(device="cuda"))
    config = train_config(global_batch=2, seq_len=8, steps=1, model_kwargs=(("num_layers", 1),))
    result = run_reference(config)
    assert result.peak_memory == {} and result.params["embed.weight"].device.type == "cpu"
