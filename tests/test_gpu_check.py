"""benchmarks/gpu_check.py on CPU (``--cpu-dry-run``): the plumbing of the GPU check, with
PuLP and HiGHS made unimportable (the GPU machine has neither). Three parts run here: (a)
profile, (c) shapes (a training run, ``hspmd simulate`` and the memory model) and (g)
hf_llama (a worker of its own that builds hspmd's program and the eager module side by
side). The others run the trainer as (c) does, or a benchmark's command: each part adds
half a minute to a minute on this 2-core machine, so they are left to a dry run by hand,
``--cpu-dry-run --parts equal,activations,zero3,zero_memory,zero_cpu``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.multiproc


def test_dry_run_profiles_trains_and_predicts_without_pulp(tmp_path: Path) -> None:
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    for name in ("pulp", "highspy"):  # an import of either fails, as where it is absent
        (blocked / f"{name}.py").write_text(f"raise ImportError('{name} is blocked here')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocked), str(ROOT / "src")]))
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(out),
           "--cpu-dry-run", "--parts", "profile,shapes,hf_llama"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    profile, shapes = report["parts"]["profile"], report["parts"]["shapes"]
    assert "error" not in profile and "error" not in shapes, report
    assert profile["collectives"].startswith("not measured") and profile["achieved"]
    assert (out / "profile-bf16.json").is_file() and (out / "cluster-h200.json").is_file()
    assert shapes["measured"]["median_step_s"] > 0 and len(shapes["measured"]["losses"]) == 6
    assert (
        shapes["simulate"]["step_time_s"] > 0 and "profile-bf16.json" in shapes["simulate"]["costs"]
    )
    assert shapes["memory_model"]["peak"] > shapes["memory_model"]["peak_without_overhead"] > 0
    assert "step time: predicted" in done.stdout and "done in" in done.stdout
    _hf_llama(report["parts"])


def _hf_llama(parts: dict[str, Any]) -> None:
    """(g): the captured HF Llama's bf16 step against eager's, on the same weights and batch."""
    hf = parts["hf_llama"]
    assert "error" not in hf and hf["max_loss_rel"] < 2e-2 and hf["ratio"]["median"] > 0, hf
    ours, eager = hf["losses"]["hspmd"], hf["losses"]["eager"]
    assert len(ours) == len(eager) > 1 and ours[0] == pytest.approx(
        eager[0], rel=1e-6
    )  # same weights
    for side in ("hspmd", "eager"):  # both call SDPA
        assert any("scaled_dot_product" in op for op in hf["attention_ops"][side]), hf
