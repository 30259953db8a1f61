"""benchmarks/models.py --quick: the families run, hspmd's one-rank step computes the same
losses as the module in eager PyTorch, and the HF Llama's cost is the formulas' (matmuls and
causal attention)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("transformers")


def test_quick_run_prints_every_figure_and_equal_losses() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "models.py"), "--quick",
           "--only", "hf-llama", "nanogpt"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    rows = summary["families"]
    assert set(rows) == {"hf-llama", "nanogpt"}
    for row in rows.values():
        assert row["aten_ops"] > 0 and row["capture_s"]["median"] > 0
        assert row["fallbacks"] == [] and row["fallback_bytes"] == 0
        assert row["loss_diff"] < 1e-5 and row["ratio"]["median"] > 0
    (cost,) = summary["cost"]
    assert cost["preset_over_formula"] == {
        "layer_matmul": 1.0,
        "attention": 1.0,
        "head_matmul": 1.0,
    }
    # captured HF attention is SDPA's is_causal (models.hf.training_masks): counted causal
    assert cost["hf_over_formula"] == cost["preset_over_formula"]
