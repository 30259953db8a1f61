"""Python files a user names on the command line (``--model FILE.py:F``, ``--dataset
FILE.py:F``): imported once per process, and the user's line in a traceback."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType

__all__ = ["import_file", "user_frame"]


def import_file(path: Path, prefix: str) -> ModuleType:
    """The module of the Python file ``path`` (an existing file), imported once per process
    as ``{prefix}{hash of its path}``; its folder goes on ``sys.path`` so that it may import
    the files beside it. An error while importing propagates, and the half-made module is
    forgotten."""
    name = prefix + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def user_frame(error: BaseException) -> str | None:
    """``file:line`` of the innermost frame of ``error``'s traceback outside torch and hspmd."""
    found = None
    for frame in traceback.extract_tb(error.__traceback__):
        name = frame.filename
        if "/torch/" not in name and "/hspmd/" not in name and "<" not in name:
            found = f"{name}:{frame.lineno}"
    return found
