"""Pretrained weights in a Hugging Face directory, read one slice at a time.

``WeightFiles.find(DIR)`` indexes ``model.safetensors``, or the shards a
``model.safetensors.index.json`` names, or every ``*.safetensors`` of the folder, by their
headers alone. ``read(name, region)`` opens the tensor's file with safetensors'
``safe_open`` and reads ``get_slice(name)[a:b, c:d]``: a rank reads the bytes of its own
slice, never the whole tensor, and converts them to fp32::

    >>> import tempfile, torch
    >>> from safetensors.torch import save_file
    >>> folder = Path(tempfile.mkdtemp())
    >>> save_file({"w": torch.arange(12.0).reshape(3, 4)}, folder / "model.safetensors")
    >>> files = WeightFiles.find(folder)
    >>> files.read("w", ((1, 3), (0, 2))).tolist()
    [[4.0, 5.0], [8.0, 9.0]]

Loading unpickles nothing: a folder with only ``pytorch_model.bin`` is refused with the
conversion to run (DESIGN decision 16).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from hspmd.models.spec import ModelSpecError
from hspmd.tensorfiles import TensorFileError, TensorHeader, read_header

__all__ = ["FLOAT_DTYPES", "WeightFiles"]

Region = tuple[tuple[int, int], ...]
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
"""safetensors' names of the dtypes a parameter may be stored in (read as fp32 masters)."""


@dataclass(frozen=True, slots=True)
class WeightFiles:
    """Every tensor of a directory's safetensors files: its header and file."""

    directory: Path
    tensors: Mapping[str, TensorHeader]
    files: Mapping[str, str]  # tensor name -> file name in ``directory``

    @classmethod
    def find(cls, directory: Path) -> WeightFiles | None:
        """The weights of ``directory`` (None: it has none, the model starts from the seed)."""
        names = _file_names(directory)
        if names is None:
            return None
        tensors: dict[str, TensorHeader] = {}
        files: dict[str, str] = {}
        for file in sorted(set(names.values())):
            try:
                header = read_header(directory / file)
            except TensorFileError as error:
                raise ModelSpecError(f"--model hf:{directory}: {error}") from None
            for name, entry in header.items():
                if names.get(name, file) == file:
                    tensors[name], files[name] = entry, file
        missing = sorted(set(names) - set(tensors))
        if missing:
            raise ModelSpecError(
                f"--model hf:{directory}: {INDEX} places {missing[0]} in {names[missing[0]]}, "
                f"which does not hold it ({len(missing)} such tensors): copy the folder again"
            )
        return cls(directory, tensors, files)

    def check(self, shapes: Mapping[str, tuple[int, ...]], aliases: Mapping[str, str]) -> None:
        """Every parameter (or a tied name of it, ``aliases``) is in the files at its shape."""
        missing = [n for n in shapes if self.name_of(n, aliases) is None]
        if missing:
            raise ModelSpecError(
                f"--model hf:{self.directory}: its safetensors files lack {len(missing)} of the "
                f"model's {len(shapes)} parameters ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}): the weights are of another "
                "architecture or config; remove them to start from the seed"
            )
        for name, shape in shapes.items():
            found = self.tensors[self.name_of(name, aliases) or name]
            if found.shape != tuple(shape):
                raise ModelSpecError(
                    f"--model hf:{self.directory}: {self.files[found.name]} holds {found.name} "
                    f"as {list(found.shape)}, the config makes it {list(shape)}: the weights "
                    "and config.json (or --config) disagree"
                )
            if found.dtype not in FLOAT_DTYPES:
                raise ModelSpecError(
                    f"--model hf:{self.directory}: {self.files[found.name]} holds {found.name} "
                    f"as {found.dtype}, not a floating-point dtype: hspmd starts from float "
                    f"weights ({', '.join(FLOAT_DTYPES)}); dequantize the checkpoint first"
                )

    def name_of(self, name: str, aliases: Mapping[str, str]) -> str | None:
        """The name ``name`` is stored under (itself, or a name tied to it)."""
        if name in self.tensors:
            return name
        alias = aliases.get(name)
        return alias if alias in self.tensors else None

    def read(self, name: str, region: Region | None = None) -> torch.Tensor:
        """``name``'s box ``region`` (None: all of it) as a new fp32 tensor."""
        from safetensors import safe_open

        path = self.directory / self.files[name]
        with safe_open(str(path), framework="pt") as handle:
            if region is None:
                part = handle.get_tensor(name)
            else:
                part = handle.get_slice(name)[tuple(slice(lo, hi) for lo, hi in region)]
        return part.to(torch.float32)


def _file_names(directory: Path) -> dict[str, str] | None:
    """Tensor name -> file, from the index; a file's tensors map to it later (``{}``
    entries are filled from the headers)."""
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {str(k): str(v) for k, v in dict(weight_map).items()}
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise ModelSpecError(
                f"--model hf:{directory}: cannot read {index} ({error!r}): copy it again"
            ) from None
    single = directory / SINGLE
    files = [single] if single.is_file() else sorted(directory.glob("*.safetensors"))
    if files:
        try:
            return {name: path.name for path in files for name in read_header(path)}
        except TensorFileError as error:
            raise ModelSpecError(f"--model hf:{directory}: {error}") from None
    if any(directory.glob("pytorch_model*.bin")):
        raise ModelSpecError(
            f"--model hf:{directory}: hspmd reads safetensors only (a .bin file is a pickle): "
            "convert it once, e.g. AutoModelForCausalLM.from_pretrained(DIR)"
            ".save_pretrained(DIR, safe_serialization=True)"
        )
    return None
