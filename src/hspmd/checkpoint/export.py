"""A checkpoint of any strategy written back as one consolidated safetensors file.

``export_checkpoint(CKPT, OUT, format="hf")`` writes ``OUT/model.safetensors`` (every
parameter whole, under its own name, in the config's dtype or ``dtype``) and
``OUT/config.json`` (the Hugging Face config the checkpoint recorded), which
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads; tied weights are stored
once, under the first name, as ``save_pretrained`` does. ``format="safetensors"`` writes the
weights alone (any model).

The file is streamed: its header is computed from the manifest (names, shapes, dtype), then
each tensor is assembled from the shard boxes that hold it (``safe_open(...).get_slice``),
cast, and appended, so the process holds one tensor at a time, never the model::

    manifest  param/w [4, 2]  shards: rank 0 rows 0-2, rank 1 rows 2-4
    export    w <- rank-00000[0:2] ++ rank-00001[0:2]    (then the next tensor)

The file is written as ``.model.safetensors.partial`` and renamed when complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open

from hspmd.checkpoint.store import CheckpointError, Manifest, TensorEntry, shard_name
from hspmd.checkpoint.verify import check_checkpoint

__all__ = ["DTYPES", "ExportResult", "export_checkpoint", "write_streamed"]

DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float32": (torch.float32, "F32"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float16": (torch.float16, "F16"),
}
PREFIX = "param/"
WEIGHTS = "model.safetensors"
# what a Hugging Face folder holds beside its weights, copied from an hf:DIR source if it
# is still there (a tokenizer, the generation defaults)
_BESIDE = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "generation_config.json",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What ``export_checkpoint`` wrote."""

    folder: Path
    step: int
    tensors: int
    bytes: int
    dtype: str
    copied: tuple[str, ...]  # files copied from the hf:DIR source


def export_checkpoint(
    checkpoint: str | Path, out: str | Path, *, format: Literal["hf", "safetensors"] = "hf",
    dtype: str | None = None,
) -> ExportResult:  # fmt: skip
    """Write the newest checkpoint in ``checkpoint`` to the folder ``out`` (module docstring)."""
    manifest = check_checkpoint(checkpoint)
    config = dict(manifest.model_config or {})
    if format == "hf" and not config:
        raise CheckpointError(
            f"checkpoint of model {manifest.model!r} records no Hugging Face config: export "
            "--format safetensors (weights only), or train an hf:DIR model (or an HF factory)"
        )
    chosen = dtype or _config_dtype(config)
    if chosen not in DTYPES:
        raise CheckpointError(f"--dtype {chosen!r}: choose one of {', '.join(DTYPES)}")
    folder = _out_folder(Path(out))
    entries = [e for e in manifest.tensors if e.name.startswith(PREFIX)]
    size = _write_weights(Path(checkpoint), manifest, entries, folder, chosen)
    copied: tuple[str, ...] = ()
    if format == "hf":
        config["dtype"] = chosen
        if "torch_dtype" in config:
            config["torch_dtype"] = chosen
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        copied = _copy_beside(manifest.model, folder)
    return ExportResult(folder, manifest.step, len(entries), size, chosen, copied)


def _config_dtype(config: dict[str, Any]) -> str:
    found = config.get("dtype") or config.get("torch_dtype") or "float32"
    return str(found).removeprefix("torch.")


def _out_folder(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    held = [p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin")]
    held += [p.name for p in folder.glob("*.index.json")]
    if held:
        raise CheckpointError(
            f"--out {folder} already holds weights ({', '.join(sorted(held)[:3])}): give an "
            "empty or new folder"
        )
    return folder


def _write_weights(
    checkpoint: Path, manifest: Manifest, entries: list[TensorEntry], folder: Path,
    dtype: str,
) -> int:  # fmt: skip
    shards = checkpoint_folder(checkpoint, manifest)
    by_name = {e.name[len(PREFIX) :]: e for e in entries}
    return write_streamed(
        folder / WEIGHTS, [(n, e.shape) for n, e in by_name.items()], dtype,
        lambda name: _assemble(by_name[name], shards),
    )  # fmt: skip


def write_streamed(
    path: Path, tensors: Sequence[tuple[str, tuple[int, ...]]], dtype: str,
    value_of: Callable[[str], torch.Tensor],
) -> int:  # fmt: skip
    """Write a safetensors file of ``tensors`` (names and shapes, in order) in ``dtype``
    (a ``DTYPES`` key), asking ``value_of(name)`` for one tensor at a time: the header
    first (computed from the shapes), then each tensor's bytes. Written to a hidden
    ``.partial`` file, fsynced and renamed; returns the file's size."""
    torch_dtype, code = DTYPES[dtype]
    width = torch.empty((), dtype=torch_dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        size = width * math.prod(shape)
        header[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name, shape in tensors:
            value = value_of(name).to(torch_dtype).contiguous()
            if tuple(value.shape) != tuple(shape):
                raise CheckpointError(f"{name} is {list(value.shape)}, not {list(shape)}")
            f.write(value.view(-1).view(torch.uint8).numpy().data)  # no copy
            del value
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)
    return 8 + len(text) + offset


def checkpoint_folder(checkpoint: Path, manifest: Manifest) -> Path:
    """The ``step-N`` folder of ``manifest`` (``checkpoint`` may be its parent)."""
    named = checkpoint / f"step-{manifest.step:08d}"
    return named if named.is_dir() else checkpoint


def _assemble(entry: TensorEntry, folder: Path) -> torch.Tensor:
    """``entry`` whole, from its shard boxes. Each shard is opened for this tensor only:
    safetensors maps the file, and a mapping kept open would keep every page read so far
    resident (the whole checkpoint by the end)."""
    out: torch.Tensor | None = None
    for rank, box in entry.shards:
        with safe_open(str(folder / shard_name(rank)), framework="pt") as handle:
            part = handle.get_tensor(entry.name)
        if out is None:
            out = torch.empty(entry.shape, dtype=part.dtype)
        out[tuple(slice(lo, hi) for lo, hi in box)] = part
        del part
    assert out is not None, f"{entry.name} has no shards"
    return out


def _copy_beside(source: str, folder: Path) -> tuple[str, ...]:
    """The tokenizer and generation files of an ``hf:DIR`` source, if it is still there."""
    directory = Path(source[3:]) if source.startswith("hf:") else None
    if directory is None or not directory.is_dir():
        return ()
    copied = []
    for name in _BESIDE:
        if (directory / name).is_file() and not (folder / name).exists():
            shutil.copyfile(directory / name, folder / name)
            copied.append(name)
    return tuple(copied)
