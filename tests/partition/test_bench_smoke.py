import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data" / "pardnn"


@pytest.mark.skipif(
    not (DATA / "toy_inception_65_103.json").exists(),
    reason=f"shared ParDNN graphs not found at {DATA}",
)
def test_benchmark_quick_runs_and_reproduces_published_makespans() -> None:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "partition.py"),
        "--quick",
        "--graphs",
        "toy_inception_65_103",
        "--sizes",
        "1000",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["reproduced"] == "4/4"  # authors' and RR makespans, K = 2 and 4
    assert "ours/rr" in summary["geomean_makespan"]
    assert summary["geomean_makespan"]["ours/rr"] < 1.0


def test_caps_benchmark_prints_capped_next_to_uncapped() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "partition_caps.py"), "--sizes", "2000"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(summary["capped_over_uncapped"]) == {"trn-wide_11L", "trn-narrow_24L"}
    assert all(summary["caps_met"].values())
    assert all(r < 1.05 for r in summary["capped_over_uncapped"].values())


def test_speed_benchmark_compares_kernels_with_python() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "partition_speed.py"), "--sizes", "800"]
    done = subprocess.run(
        [*cmd, "--repeats", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])["graphs"]["layered_800"]
    assert "python" in row and row["python"]["partition"] > 0
    assert row.get("same_placement", True)  # absent without numba: one mode only
