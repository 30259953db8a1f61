"""Checkpoints that load onto any strategy: safetensors shards plus a JSON manifest.

Layout of a checkpoint directory (only complete checkpoints carry a ``step-*`` name)::

    DIR/step-00000012/manifest.json          format, step, model, strategy, data position,
                                             Adam step, and per tensor: global shape, dtype,
                                             annotation (text) and which shard holds which box
    DIR/step-00000012/rank-00003.safetensors the pieces rank 3 wrote, keyed by tensor name
    DIR/.partial-step-00000013/              a save in progress (or killed): never loaded

Each distinct piece is written once, by the lowest rank holding it, and where subgroups are
duplicates only the first subgroup writes (``writers``). Saving is
atomic: shards and manifest go to ``.partial-step-N``, are fsynced, and the folder is renamed
to ``step-N`` (then the parent is fsynced and older checkpoints pruned, ``keep`` are kept). A
process killed at any point leaves the previous ``step-*`` whole.

Loading reshards: for each tensor, the new annotation's piece of this rank is a BSR table
(``hspmd.comm.bsr``) from the shards' boxes to it; each transfer is read with safetensors'
``get_slice``, so a rank reads only the boxes it needs::

    >>> import tempfile, torch
    >>> from hspmd.annotation import parse_annotation as A
    >>> from hspmd.plan.params import ParamSpec
    >>> w = torch.arange(8.0).reshape(4, 2)
    >>> old = {"w": ParamSpec("w", (4, 2), A("[0,1]{0:2}"))}
    >>> new = {"w": ParamSpec("w", (4, 2), A("[5,6]{1:2}"))}
    >>> folder = tempfile.mkdtemp()
    >>> _ = save(folder, step=1, model="m", strategy="s", specs=old,
    ...          tensors_by_rank={0: {"w": w[:2]}, 1: {"w": w[2:]}})
    >>> load(folder, new, rank=6)["w"].flatten().tolist()
    [1.0, 3.0, 5.0, 7.0]

Training state (a rank's parameters and Adam states): ``hspmd.checkpoint.state``;
docs/switching.md says how the trainer calls it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hspmd.annotation import DUP, PARTIAL, Annotation, Piece, Region, parse_annotation
from hspmd.comm.bsr import BsrEntry, BsrTable, schedule
from hspmd.comm.plan import local_box
from hspmd.comm.slices import holders_table
from hspmd.errors import AnnotationError, HspmdError
from hspmd.plan.identity import ModelIdentity
from hspmd.plan.params import ParamSpec

__all__ = [
    "CheckpointError",
    "Manifest",
    "TensorEntry",
    "commit",
    "foreign_checkpoint",
    "latest",
    "load",
    "read_manifest",
    "save",
    "write_shard",
    "writers",
]

FORMAT = "hspmd.checkpoint/1"
MANIFEST = "manifest.json"


class CheckpointError(HspmdError, ValueError):
    """A checkpoint that is missing, incomplete, corrupt, or does not fit what loads it."""


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def staging_dir(directory: str | Path, step: int) -> Path:
    """Where the shards of a save in progress go (the same path on every rank)."""
    return Path(directory) / f".partial-{step_name(step)}"


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def writers(annotation: Annotation, shape: tuple[int, ...]) -> dict[int, Region]:
    """The rank that writes each distinct piece (the lowest holder) and its box.

    >>> writers(parse_annotation("[3,1,2,0]{0:2,D:2}"), (4,))
    {1: ((0, 2),), 0: ((2, 4),)}
    >>> writers(parse_annotation("hD: [4,5]{0:2} [0]{}"), (4,))
    {4: ((0, 2),), 5: ((2, 4),)}
    """
    if annotation.hdim == PARTIAL or any(s.degree(PARTIAL) > 1 for s in annotation.states):
        raise CheckpointError(f"cannot save partial values ({annotation}): reduce them first")
    # duplicated across subgroups: the first subgroup alone holds everything
    keep = set(annotation.groups[0].ranks) if annotation.hdim == DUP else set(annotation.ranks)
    first: dict[Region, int] = {}
    for rank, piece in annotation.pieces(shape).items():
        if rank in keep:
            first[piece.region] = min(rank, first.get(piece.region, rank))
    return {rank: region for region, rank in first.items()}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One global tensor of a checkpoint and the shard boxes that hold it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    annotation: str
    shards: tuple[tuple[int, Region], ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "annotation": self.annotation,
            "shards": [[rank, [list(span) for span in box]] for rank, box in self.shards],
        }


@dataclass(frozen=True, slots=True)
class Manifest:
    """What a checkpoint holds; ``data_position`` is whatever the trainer needs to resume."""

    step: int
    model: str
    strategy: str
    tensors: tuple[TensorEntry, ...]
    data_position: Any = 0
    adam_step: int = 0
    # what made the data stream (data, batch, length, seed): a resume that differs is warned
    run: Mapping[str, Any] = field(default_factory=dict)
    # the model's structure (hspmd.plan.identity): a resume of another model is refused
    identity: ModelIdentity | None = None
    # a Hugging Face model's config.json (``hspmd export --format hf`` writes it back)
    model_config: Mapping[str, Any] | None = None

    def entry(self, name: str) -> TensorEntry:
        for entry in self.tensors:
            if entry.name == name:
                return entry
        raise CheckpointError(
            f"checkpoint of step {self.step} has no tensor {name!r}: it was saved from another "
            f"model or run (model {self.model!r}, strategy {self.strategy!r})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "step": self.step,
            "model": self.model,
            "strategy": self.strategy,
            "data_position": self.data_position,
            "adam_step": self.adam_step,
            "run": dict(self.run),
            **({"model_identity": self.identity.to_json()} if self.identity else {}),
            **({"model_config": dict(self.model_config)} if self.model_config else {}),
            "tensors": {t.name: t.to_json() for t in self.tensors},
        }


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shard(
    staging: str | Path,
    *,
    rank: int,
    specs: Mapping[str, ParamSpec],
    tensors: Mapping[str, torch.Tensor],
) -> Path:
    """Write the pieces ``rank`` is the writer of into ``staging`` (one shard, fsynced)."""
    folder = Path(staging)
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    for name, spec in specs.items():
        if rank not in spec.annotation:
            continue
        piece = spec.annotation.piece(rank, spec.shape)
        if name not in tensors:
            raise CheckpointError(f"rank {rank} holds {name} {spec.annotation} but gave no tensor")
        local = tensors[name]
        if tuple(local.shape) != piece.shape:
            raise CheckpointError(
                f"rank {rank}'s {name} has shape {list(local.shape)}, but its piece of "
                f"{spec} is {list(piece.shape)}: save the rank's local tensor"
            )
        if writers(spec.annotation, spec.shape).get(rank) == piece.region:
            out[name] = local.detach().cpu().contiguous()  # a GPU rank's state: to host
    seen: set[int] = set()
    for name, tensor in out.items():  # safetensors refuses tensors that share memory
        if tensor.numel() and tensor.untyped_storage().data_ptr() in seen:
            out[name] = tensor.clone()
        seen.add(out[name].untyped_storage().data_ptr())
    path = folder / shard_name(rank)
    save_file(out, str(path))
    _fsync(path)
    return path


def commit(
    directory: str | Path,
    *,
    step: int,
    model: str,
    strategy: str,
    specs: Mapping[str, ParamSpec],
    data_position: Any = 0,
    adam_step: int = 0,
    keep: int = 1,
    run: Mapping[str, Any] | None = None,
    identity: ModelIdentity | None = None,
    model_config: Mapping[str, Any] | None = None,
) -> Path:
    """Finish a save after every rank's ``write_shard``: check the shards, write the manifest,
    fsync, rename ``.partial-step-N`` to ``step-N``, prune. Called by one process."""
    folder, staging = Path(directory), staging_dir(directory, step)
    entries = [_checked_entry(staging, name, spec) for name, spec in specs.items()]
    manifest = Manifest(
        step, model, strategy, tuple(entries), data_position, adam_step, dict(run or {}),
        identity, model_config,
    )  # fmt: skip
    needed = {shard_name(rank) for e in entries for rank, _ in e.shards}
    for stale in staging.glob("rank-*.safetensors"):
        if stale.name not in needed:
            stale.unlink()
    path = staging / MANIFEST
    path.write_text(json.dumps(manifest.to_json(), indent=1))
    _fsync(path)
    _fsync(staging)
    final = folder / step_name(step)
    if final.exists():  # the same step saved again (e.g. after a resume): replace it
        shutil.rmtree(final)
    os.rename(staging, final)
    _fsync(folder)
    complete = sorted(p for p in folder.glob("step-*") if (p / MANIFEST).is_file())
    for old in complete[: max(0, len(complete) - keep)]:
        shutil.rmtree(old, ignore_errors=True)
    for partial in folder.glob(".partial-step-*"):
        shutil.rmtree(partial, ignore_errors=True)
    return final


def _checked_entry(staging: Path, name: str, spec: ParamSpec) -> TensorEntry:
    shards = tuple(sorted(writers(spec.annotation, spec.shape).items()))
    dtype = ""
    for rank, region in shards:
        path = staging / shard_name(rank)
        if not path.is_file():
            raise CheckpointError(f"rank {rank} wrote no shard to {staging}: it holds {name}")
        with safe_open(str(path), framework="pt") as f:
            if name not in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                raise CheckpointError(f"shard {path} lacks {name}: rank {rank} is its writer")
            view = f.get_slice(name)
            expected = [hi - lo for lo, hi in region]
            if list(view.get_shape()) != expected:
                raise CheckpointError(
                    f"shard {path} holds {name} as {view.get_shape()}, expected {expected}"
                )
            dtype = dtype or str(view.get_dtype())
    return TensorEntry(name, spec.shape, dtype, str(spec.annotation), shards)


def save(
    directory: str | Path,
    *,
    step: int,
    model: str,
    strategy: str,
    specs: Mapping[str, ParamSpec],
    tensors_by_rank: Mapping[int, Mapping[str, torch.Tensor]],
    data_position: Any = 0,
    adam_step: int = 0,
    keep: int = 1,
    on_shard: Callable[[int], None] | None = None,
    run: Mapping[str, Any] | None = None,
    identity: ModelIdentity | None = None,
) -> Path:
    """Save every rank's local tensors from one process (``write_shard`` per rank, then
    ``commit``). ``on_shard(rank)`` runs after each shard (tests inject failures there)."""
    staging = staging_dir(directory, step)
    for rank, tensors in sorted(tensors_by_rank.items()):
        write_shard(staging, rank=rank, specs=specs, tensors=tensors)
        if on_shard is not None:
            on_shard(rank)
    return commit(
        directory, step=step, model=model, strategy=strategy, specs=specs,
        data_position=data_position, adam_step=adam_step, keep=keep, run=run, identity=identity,
    )  # fmt: skip


def latest(directory: str | Path) -> Path:
    """The newest complete checkpoint in ``directory`` (or ``directory`` itself if it is one)."""
    folder = Path(directory)
    if (folder / MANIFEST).is_file():
        return folder
    complete = sorted(p for p in folder.glob("step-*") if (p / MANIFEST).is_file())
    if not complete:
        raise CheckpointError(
            f"no complete checkpoint in {folder}: expected a step-N folder with {MANIFEST}"
        )
    return complete[-1]


def foreign_checkpoint(save: str | Path, resume: str | Path | None) -> str | None:
    """The newest complete ``step-N`` already in ``save`` when a run saving there would not
    continue it (``resume`` is neither ``save`` nor one of its steps), else None. Saving
    prunes all but the newest step, so such a run would delete that checkpoint, or have its
    own older steps deleted as they are written."""
    folder = Path(save)
    held = sorted(p.name for p in folder.glob("step-*") if (p / MANIFEST).is_file())
    if not held:
        return None
    if resume is not None:
        source = Path(resume).resolve()
        if (source / MANIFEST).is_file():  # a step-N folder: its run's folder is the parent
            source = source.parent
        if source == folder.resolve():
            return None
    return held[-1]


def read_manifest(checkpoint: str | Path) -> Manifest:
    """The manifest of a checkpoint folder; CheckpointError for anything malformed."""
    path = Path(checkpoint) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"cannot read checkpoint manifest {path}: {error}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an hspmd checkpoint manifest (format {FORMAT})")
    try:
        tensors = tuple(_entry(name, e) for name, e in data["tensors"].items())
        return Manifest(
            int(data["step"]), str(data["model"]), str(data["strategy"]), tensors,
            data.get("data_position", 0), int(data.get("adam_step", 0)),
            dict(data.get("run", {})),
            _identity(data.get("model_identity"), path),
            data.get("model_config"),
        )  # fmt: skip
    except (KeyError, TypeError, ValueError, AttributeError, AnnotationError) as error:
        raise CheckpointError(f"corrupt checkpoint manifest {path}: {error!r}") from None


def _identity(data: Any, path: Path) -> ModelIdentity | None:
    """The manifest's model identity (None in checkpoints saved before they were kept)."""
    return None if data is None else ModelIdentity.from_json(data, where=str(path))


def _entry(name: str, data: dict[str, Any]) -> TensorEntry:
    shape = tuple(int(n) for n in data["shape"])
    annotation = parse_annotation(data["annotation"])
    annotation.check_shape(shape)
    shards = tuple(
        (int(rank), tuple((int(lo), int(hi)) for lo, hi in box)) for rank, box in data["shards"]
    )
    for _, box in shards:
        fits = len(box) == len(shape) and all(
            0 <= lo < hi <= n for (lo, hi), n in zip(box, shape, strict=True)
        )
        if not fits:
            raise ValueError(f"{name}: shard box {box} does not fit shape {list(shape)}")
    return TensorEntry(name, shape, str(data["dtype"]), str(annotation), shards)


def load(
    directory: str | Path,
    specs: Mapping[str, ParamSpec],
    rank: int,
    *,
    model: str | None = None,
) -> dict[str, torch.Tensor]:
    """``rank``'s pieces of every tensor of ``specs`` (new annotations), read from the newest
    complete checkpoint in ``directory``, resharding as needed. ``model`` (if given) must
    match the one saved where the checkpoint has no identity (``hspmd.plan.identity``: by
    structure, checked before launch, where it has one)."""
    checkpoint = latest(directory)
    manifest = read_manifest(checkpoint)
    if model is not None and manifest.identity is None and manifest.model != model:
        raise CheckpointError(
            f"checkpoint {checkpoint} holds model {manifest.model!r}, not {model!r}: "
            "resume with the same --model"
        )
    out: dict[str, torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        handles: dict[int, Any] = {}

        def shard(src: int) -> Any:
            if src not in handles:
                path = checkpoint / shard_name(src)
                if not path.is_file():
                    raise CheckpointError(f"checkpoint {checkpoint} is missing shard {path.name}")
                handles[src] = stack.enter_context(safe_open(str(path), framework="pt"))
            return handles[src]

        for name, spec in specs.items():
            if rank in spec.annotation:
                out[name] = _read_piece(manifest.entry(name), spec, rank, shard)
    return out


def _read_piece(entry: TensorEntry, spec: ParamSpec, rank: int, shard: Any) -> torch.Tensor:
    if entry.shape != spec.shape:
        raise CheckpointError(
            f"checkpoint has {entry.name} of shape {list(entry.shape)}, but the model wants "
            f"{list(spec.shape)}: it was saved from a different model"
        )
    piece = spec.annotation.piece(rank, spec.shape)
    boxes = dict(entry.shards)
    rows = holders_table(boxes, {rank: piece.region}, spec.shape)
    if any(not owners for _, owners, _ in rows):
        raise CheckpointError(
            f"the shards of {entry.name} do not cover rank {rank}'s piece {piece.region}: "
            "corrupt checkpoint manifest"
        )
    table = BsrTable(tuple(BsrEntry(*row) for row in rows))
    out: torch.Tensor | None = None
    for t in schedule([table], method="naive"):
        handle = shard(t.src)
        if entry.name not in handle.keys():  # noqa: SIM118
            raise CheckpointError(f"shard of rank {t.src} lacks {entry.name}: corrupt checkpoint")
        view = handle.get_slice(entry.name)
        stored = [hi - lo for lo, hi in boxes[t.src]]
        if list(view.get_shape()) != stored:
            raise CheckpointError(
                f"shard of rank {t.src} holds {entry.name} as {view.get_shape()}, the manifest "
                f"says {stored}: corrupt checkpoint"
            )
        part = view[local_box(Piece(boxes[t.src], ()), t.region)]
        if out is None:
            out = torch.empty(piece.shape, dtype=part.dtype)
        out[local_box(piece, t.region)] = part
    assert out is not None, f"no transfer serves {entry.name} on rank {rank}"
    return out
