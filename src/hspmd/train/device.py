"""Where a run computes: ``TrainConfig.runtime.device`` (``--device auto|cpu|cuda``) here.

One process per rank, one GPU per rank (DESIGN decision 8): nccl on CUDA, gloo on CPU::

    device  the ranks of a run (this launcher's)            the reference (one process)
    auto    CUDA (nccl) when torch sees a GPU per rank,      CUDA when torch sees a GPU,
            else CPU (gloo)                                  else CPU
    cuda    CUDA (nccl); refused with fewer GPUs than ranks  CUDA; refused without a GPU
    cpu     CPU (gloo)                                       CPU

Elastic runs (``--elastic``) are gloo only: ``auto`` is CPU there and ``cuda`` is refused
(their in-process regroup re-creates gloo groups, and an nccl communicator whose peer died
needs an abort that is not written).

>>> from hspmd.train.config import RuntimeConfig, TrainConfig
>>> run_device(TrainConfig(runtime=RuntimeConfig(device="cpu")), num_ranks=4), backend_of("cpu")
('cpu', 'gloo')
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from hspmd.train.config import TrainError

if TYPE_CHECKING:
    from hspmd.train.config import TrainConfig

__all__ = ["backend_of", "gpu_count", "reference_device", "run_device", "where"]

Placement = Literal["cpu", "cuda"]


def gpu_count() -> int:
    """CUDA devices torch sees here (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_device(config: TrainConfig, *, num_ranks: int) -> Placement:
    """Where ``num_ranks`` local ranks of ``config`` compute (the module docstring's table)."""
    gpus = gpu_count()
    if config.runtime.device == "cpu":
        return "cpu"
    if config.elastic.enabled:
        if config.runtime.device == "cuda":
            raise TrainError(
                "--elastic runs on CPU processes (gloo) only: its in-process regroup "
                "re-creates gloo groups, and nccl needs an abort of a dead peer's "
                "communicator that hspmd does not do yet; use --device cpu or auto"
            )
        return "cpu"
    if config.runtime.device == "cuda" and gpus < num_ranks:
        raise TrainError(
            f"--device cuda puts one rank on each GPU (nccl): {num_ranks} ranks here but "
            f"torch sees {gpus} GPUs; use --device cpu (gloo) or a strategy of at most "
            f"{gpus} ranks"
        )
    return "cuda" if gpus and gpus >= num_ranks else "cpu"


def reference_device(config: TrainConfig) -> torch.device:
    """The device of the reference run (one process; the module docstring's table)."""
    if config.runtime.device == "cpu":
        return torch.device("cpu")
    if gpu_count():
        return torch.device("cuda", torch.cuda.current_device())
    if config.runtime.device == "cuda":
        raise TrainError("--device cuda: torch sees no CUDA device here; use --device cpu")
    return torch.device("cpu")


def backend_of(device: Placement) -> str:
    """The process-group backend of ranks on ``device``: nccl on CUDA, gloo on CPU."""
    return "nccl" if device == "cuda" else "gloo"


def where(device: torch.device | str, *, num_ranks: int | None = None) -> str:
    """Where a run computes, in words: ``'on CPU'``, ``'on CUDA (NVIDIA H200)'``, or with
    ``num_ranks`` the backend too.

    >>> where("cpu", num_ranks=2), where("cpu")
    ('2 ranks on CPU (gloo)', 'on CPU')
    """
    cuda = torch.device(device).type == "cuda"
    if num_ranks is None:
        return f"on CUDA ({torch.cuda.get_device_name()})" if cuda else "on CPU"
    who = f"{num_ranks} rank{'s' if num_ranks != 1 else ''}"
    if cuda:
        return f"{who} on CUDA (nccl, {torch.cuda.get_device_name()})"
    return f"{who} on CPU (gloo)"
