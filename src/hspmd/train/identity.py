"""The identity of a run's model (``hspmd.plan.identity``), and the checks of files that
carry one against it: plan files (``hspmd.train.planfile``) and checkpoints (``--resume``).

>>> from hspmd.train.config import ModelChoice
>>> config = TrainConfig(model=ModelChoice(overrides=(("num_layers", 2),)))
>>> str(model_identity(config))
"llama-tiny {'num_layers': 2} (21 parameters, fingerprint a21a568118c16226)"
"""

from __future__ import annotations

from hspmd.checkpoint.store import CheckpointError, latest
from hspmd.checkpoint.verify import check_checkpoint
from hspmd.plan.identity import ModelIdentity, check_identity
from hspmd.train.config import TrainConfig

__all__ = ["check_resume_identity", "model_identity"]


def model_identity(config: TrainConfig) -> ModelIdentity:
    """``config``'s model: its source, keyword arguments and structural fingerprint."""
    return ModelIdentity.of(
        config.model_config(), source=config.model.source, kwargs=dict(config.model.overrides)
    )


def check_resume_identity(config: TrainConfig) -> None:
    """With ``config.checkpoint.resume``: the newest checkpoint there must be whole (every shard's
    header read: ``hspmd.checkpoint.verify``) and hold this run's model by structure (one
    line naming both, before any process starts); checkpoints saved before identities were
    recorded, and folders a run earlier in the same launch has yet to fill, are not
    checked here (their tensors still are, on load)."""
    if not config.checkpoint.resume:
        return
    try:
        folder = latest(config.checkpoint.resume)
    except CheckpointError:  # none yet: a run earlier in the same launch saves it
        return  # (train_many); loading names a folder that stays empty
    saved = check_checkpoint(folder).identity
    if saved is not None:
        check_identity(
            saved, model_identity(config), what=f"checkpoint {folder}",
            fix="resume with its --model and --config",
        )  # fmt: skip
