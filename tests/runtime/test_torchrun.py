"""The same worker code under torchrun: `torchrun -m hspmd.runtime module:function`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hspmd.comm.simulate import scatter, simulate
from hspmd.runtime import World, run_plan

from .rt_plans import top_plans

ROOT = Path(__file__).resolve().parents[2]


def work(world: World) -> str:
    plan = top_plans(2)["split-reduce-scatter"]
    world.prepare([plan])
    value = np.arange(np.prod(plan.shape), dtype=np.float64).reshape(plan.shape)
    out = run_plan(plan, torch.from_numpy(scatter(plan.src, value)[world.rank]), world)
    assert out is not None
    want = simulate(plan, scatter(plan.src, value))[world.rank]
    return f"{world} equal={np.array_equal(out.numpy(), want)}"


@pytest.mark.multiproc
def test_a_worker_runs_under_torchrun() -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this python")
    command = [torchrun, "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "hspmd.runtime", f"{__name__}:work"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: their own session
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    assert "rank 0/2 on cpu (gloo) equal=True" in stdout
