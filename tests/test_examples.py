"""The scripts of examples/ run as a user runs them, and say what they claim."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.multiproc
def test_own_loop_over_build_equals_the_reference() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "own_loop.py")],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[:2] for line in lines[:3]] == [["step", "1"], ["step", "2"], ["step", "3"]]
    assert lines[-1].endswith("equal to the reference"), done.stdout
