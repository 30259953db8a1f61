"""safetensors files read by their headers: what they hold and whether they are whole.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``), then
the data; offsets count from the end of the header. ``read_header`` checks what can be
checked without reading the data: the header parses, every tensor's byte range matches its
shape and dtype, and the file is long enough for all of them (a truncated copy is named,
with its size, before anything loads it). Nothing here reads tensor data.

>>> import struct, tempfile, json
>>> header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
>>> path = tempfile.mktemp(suffix=".safetensors")
>>> _ = open(path, "wb").write(struct.pack("<Q", len(header)) + header + bytes(8))
>>> read_header(path)["w"]
TensorHeader(name='w', dtype='F32', shape=(2,), begin=0, end=8)
>>> _ = open(path, "wb").write(struct.pack("<Q", len(header)) + header + bytes(5))
>>> read_header(path)
Traceback (most recent call last):
...
hspmd.tensorfiles.TensorFileError: ... is truncated: 74 bytes, its header needs 77 (w ends at byte 77): copy it again
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

from hspmd.errors import HspmdError

__all__ = ["DTYPE_BYTES", "TensorFileError", "TensorHeader", "header_bytes", "read_header"]

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}  # fmt: skip
_MAX_HEADER = 100 << 20  # safetensors' own limit


class TensorFileError(HspmdError, ValueError):
    """A safetensors file that is missing, truncated or corrupt (names the file and fix)."""


@dataclass(frozen=True, slots=True)
class TensorHeader:
    """One tensor of a safetensors file: dtype (safetensors' name), shape, byte range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def header_bytes(path: str | Path) -> int:
    """Where the data of ``path`` starts (8 + the header's length)."""
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def read_header(path: str | Path) -> dict[str, TensorHeader]:
    """Every tensor ``path`` holds, checked against its size (module docstring)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            length = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < length <= min(_MAX_HEADER, size - 8):
                raise TensorFileError(
                    f"{path} is not a safetensors file or is truncated ({size} bytes, header "
                    f"length {length}): copy it again"
                )
            data = json.loads(f.read(length))
    except OSError as error:
        raise TensorFileError(f"cannot read {path}: {error.strerror or error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise TensorFileError(f"{path} has a corrupt header ({error}): copy it again") from None
    if not isinstance(data, dict):
        raise TensorFileError(f"{path} has a corrupt header (not a JSON object): copy it again")
    out: dict[str, TensorHeader] = {}
    for name, entry in data.items():
        if name != "__metadata__":
            out[name] = _entry(path, name, entry)
    start = 8 + length
    last = max(out.values(), key=lambda t: t.end, default=None)
    if last is not None and start + last.end > size:
        raise TensorFileError(
            f"{path} is truncated: {size} bytes, its header needs {start + last.end} "
            f"({last.name} ends at byte {start + last.end}): copy it again"
        )
    return out


def _entry(path: str | Path, name: str, entry: object) -> TensorHeader:
    try:
        assert isinstance(entry, dict)
        dtype, shape = str(entry["dtype"]), tuple(int(n) for n in entry["shape"])
        begin, end = (int(n) for n in entry["data_offsets"])
    except (AssertionError, KeyError, TypeError, ValueError):
        raise TensorFileError(
            f"{path}: tensor {name!r} has a corrupt header entry {str(entry)[:80]}: copy it again"
        ) from None
    width = DTYPE_BYTES.get(dtype)
    if width is None or end - begin != prod(shape) * width or begin < 0:
        raise TensorFileError(
            f"{path}: tensor {name!r} ({dtype} {list(shape)}) spans bytes {begin}-{end}, not "
            f"{prod(shape) * (width or 0)} bytes: corrupt header, copy it again"
        )
    return TensorHeader(name, dtype, shape, begin, end)
