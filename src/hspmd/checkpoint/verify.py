"""A checkpoint checked whole before anything loads it: one line, not a rank's traceback.

``check_checkpoint(DIR)`` reads the manifest of the newest complete checkpoint and the
header of every shard it names (``hspmd.tensorfiles``): each shard must exist, parse, be
as long as its header says (a truncated copy is named with its size), and hold every box
the manifest places in it at the box's shape. Nothing reads tensor data, so this costs a
few file opens however large the checkpoint; safetensors keeps no checksums, so a flipped
bit inside the data is not caught (copy checkpoints with a tool that verifies them).

    >>> import tempfile, torch
    >>> from hspmd.annotation import parse_annotation as A
    >>> from hspmd.checkpoint.store import save
    >>> from hspmd.plan.params import ParamSpec
    >>> folder = tempfile.mkdtemp()
    >>> specs = {"w": ParamSpec("w", (4,), A("[0,1]{0:2}"))}
    >>> path = save(folder, step=1, model="m", strategy="s", specs=specs,
    ...             tensors_by_rank={0: {"w": torch.zeros(2)}, 1: {"w": torch.ones(2)}})
    >>> check_checkpoint(folder).step
    1
    >>> with open(path / "rank-00001.safetensors", "r+b") as f:
    ...     _ = f.truncate(70)
    >>> check_checkpoint(folder)
    Traceback (most recent call last):
    ...
    hspmd.checkpoint.store.CheckpointError: checkpoint .../step-00000001: .../rank-00001.safetensors is truncated: 70 bytes, its header needs 72 (w ends at byte 72): copy it again
"""

from __future__ import annotations

from pathlib import Path

from hspmd.checkpoint.store import CheckpointError, Manifest, latest, read_manifest, shard_name
from hspmd.tensorfiles import TensorFileError, TensorHeader, read_header

__all__ = ["check_checkpoint"]


def check_checkpoint(directory: str | Path) -> Manifest:
    """The manifest of the newest complete checkpoint in ``directory``, every shard checked
    (module docstring); CheckpointError naming the first fault and the fix."""
    folder = latest(directory)
    manifest = read_manifest(folder)
    headers: dict[int, dict[str, TensorHeader]] = {}
    for entry in manifest.tensors:
        for rank, box in entry.shards:
            if rank not in headers:
                path = folder / shard_name(rank)
                if not path.is_file():
                    raise CheckpointError(
                        f"checkpoint {folder} lacks {path.name} (rank {rank} wrote "
                        f"{entry.name}): copy the whole folder again"
                    )
                try:
                    headers[rank] = read_header(path)
                except TensorFileError as error:
                    raise CheckpointError(f"checkpoint {folder}: {error}") from None
            found = headers[rank].get(entry.name)
            expected = tuple(hi - lo for lo, hi in box)
            if found is None or found.shape != expected:
                held = "nothing" if found is None else list(found.shape)
                raise CheckpointError(
                    f"checkpoint {folder}: {shard_name(rank)} holds {held} of {entry.name}, "
                    f"the manifest says {list(expected)}: corrupt checkpoint, copy it again"
                )
    return manifest
