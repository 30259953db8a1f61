"""Training: the reference run, the per-rank loop, the local-process trainer.

>>> from hspmd.plan.strategy import parse_strategy
>>> from hspmd.train import TrainConfig
>>> TrainConfig(strategy=parse_strategy("4x2: R0:L0-3")).tokens_per_step
512
"""

from hspmd.train.config import (
    AdamConfig,
    BatchConfig,
    CheckpointConfig,
    ElasticConfig,
    EvalConfig,
    EvalRecord,
    FaultConfig,
    ModelChoice,
    RuntimeConfig,
    StepRecord,
    SwitchingConfig,
    TrainConfig,
    TrainError,
)
from hspmd.train.reference import TrainResult, run_reference
from hspmd.train.trainer import check_config, train, train_many

__all__ = [
    "AdamConfig",
    "BatchConfig",
    "CheckpointConfig",
    "ElasticConfig",
    "EvalConfig",
    "EvalRecord",
    "FaultConfig",
    "ModelChoice",
    "RuntimeConfig",
    "StepRecord",
    "SwitchingConfig",
    "TrainConfig",
    "TrainError",
    "TrainResult",
    "check_config",
    "run_reference",
    "train",
    "train_many",
]
