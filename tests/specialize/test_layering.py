"""Layering (DESIGN.md, "Architecture"): specialize sits above runtime, so importing any
module of ``hspmd.specialize`` must not import ``hspmd.runtime``. Checked in a fresh
interpreter, where ``sys.modules`` starts empty."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import hspmd.specialize

SCRIPT = """
import importlib, sys
for name in {names!r}:
    importlib.import_module(name)
print(sorted(m for m in sys.modules if m == "hspmd.runtime" or m.startswith("hspmd.runtime.")))
"""


def test_specialize_does_not_import_runtime() -> None:
    names = [
        info.name for info in pkgutil.iter_modules(hspmd.specialize.__path__, "hspmd.specialize.")
    ]
    assert "hspmd.specialize.executable" in names and "hspmd.specialize.cut" in names
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(names=names)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip() == "[]", f"hspmd.specialize imports {out.stdout.strip()}"
