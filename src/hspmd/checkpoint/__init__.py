"""Checkpoints: safetensors shards with a manifest, saved atomically, loaded onto any strategy.

``hspmd.checkpoint.store``: generic tensors (``save``, ``write_shard`` + ``commit``, ``load``).
``hspmd.checkpoint.state``: a rank's parameters and Adam states (``save_rank_state``,
``commit_rank_states``, ``load_rank_state``), the trainer's entry points.
"""

from hspmd.checkpoint.state import (
    RankState,
    commit_rank_states,
    load_rank_state,
    save_rank_state,
    state_specs,
)
from hspmd.checkpoint.store import (
    CheckpointError,
    Manifest,
    TensorEntry,
    commit,
    latest,
    load,
    read_manifest,
    save,
    staging_dir,
    write_shard,
    writers,
)

__all__ = [
    "CheckpointError",
    "Manifest",
    "RankState",
    "TensorEntry",
    "commit",
    "commit_rank_states",
    "latest",
    "load",
    "load_rank_state",
    "read_manifest",
    "save",
    "save_rank_state",
    "staging_dir",
    "state_specs",
    "write_shard",
    "writers",
]
