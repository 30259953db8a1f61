"""The launcher: results by rank, and failures that stop every worker quickly."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from hspmd.runtime import LaunchError, World, launch
from hspmd.runtime.launch import NodeSpec


def scaled_rank(world: World, scale: int) -> tuple[int, int, int]:
    dist.barrier()
    return world.rank * scale, world.world_size, os.getpid()


def fail_on_rank_one(world: World, pid_dir: str) -> None:
    Path(pid_dir, str(world.rank)).write_text(str(os.getpid()))
    dist.barrier()  # every pid is written
    if world.rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # the others block here until the launcher stops them
    time.sleep(60)


def die_on_rank_zero(world: World) -> None:
    if world.rank == 0:
        os._exit(7)
    dist.barrier()


def sleep_forever(world: World) -> None:
    time.sleep(60)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.multiproc
def test_results_come_back_by_rank() -> None:
    results = launch(scaled_rank, 3, args=(10,), timeout_s=60)
    assert [r[:2] for r in results] == [(0, 3), (10, 3), (20, 3)]
    assert not any(_alive(r[2]) for r in results)


@pytest.mark.multiproc
def test_a_raising_worker_stops_the_others(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        launch(fail_on_rank_one, 4, args=(str(tmp_path),), timeout_s=60)
    assert time.monotonic() - start < 15
    error = caught.value
    assert error.rank == 1
    assert "rank 1 raised ValueError: boom on purpose" in str(error)
    assert "fail_on_rank_one" in error.remote_traceback
    pids = [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(pids) == 4 and not any(_alive(p) for p in pids)


@pytest.mark.multiproc
def test_a_dying_worker_is_reported() -> None:
    with pytest.raises(LaunchError, match="rank 0 died with exit code 7"):
        launch(die_on_rank_zero, 2, timeout_s=60)


@pytest.mark.multiproc
def test_a_hung_worker_times_out() -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"timed out: ranks \[0, 1\]"):
        launch(sleep_forever, 2, timeout_s=1.5)
    assert time.monotonic() - start < 10


def test_world_needs_prepared_groups() -> None:
    import datetime

    import torch

    world = World(0, 4, torch.device("cpu"), "gloo", datetime.timedelta(seconds=1))
    assert world.group((0, 1, 2, 3)) is None
    with pytest.raises(Exception, match=r"process group \[0, 2\] was not prepared"):
        world.group((2, 0))


def sum_of_ranks(world: World) -> tuple[int, int]:
    import torch

    value = torch.tensor([world.rank])
    dist.all_reduce(value)
    return world.rank, int(value)


@pytest.mark.multiproc
def test_one_launcher_per_node_on_loopback(tmp_path: Path) -> None:
    # two launchers, node 1's in another process: ranks 0-1 here, 2-3 there, one world
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = (
        "from hspmd.runtime.launch import NodeSpec, launch\n"
        f"from {__name__} import sum_of_ranks\n"
        f"print(launch(sum_of_ranks, 2, node=NodeSpec(1, 2, '127.0.0.1', {port}), threads=1))"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root / 'src'}:{root}"}
    other = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        here = launch(sum_of_ranks, 2, node=NodeSpec(0, 2, "127.0.0.1", port), timeout_s=120)
        out, _ = other.communicate(timeout=120)
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
    assert here == [(0, 6), (1, 6)]
    assert out.strip() == "[(2, 6), (3, 6)]"


def test_node_spec_from_env_and_bad_values() -> None:
    env = {"HSPMD_NNODES": "3", "HSPMD_NODE_RANK": "2", "HSPMD_MASTER_ADDR": "10.213.0.1"}
    assert NodeSpec.from_env(env) == NodeSpec(2, 3, "10.213.0.1", 29500)
    assert NodeSpec.from_env({}) is None
    with pytest.raises(LaunchError, match="HSPMD_NODE_RANK"):
        NodeSpec.from_env({"HSPMD_NNODES": "2", "HSPMD_MASTER_ADDR": "a"})
    with pytest.raises(LaunchError, match="node rank 2 of 2 nodes"):
        NodeSpec(2, 2, "a", 1)
