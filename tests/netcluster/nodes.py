"""What each emulated node runs in tests/netcluster/test_launch.py.

python -m tests.netcluster.nodes OUT NODE_RANK NUM_NODES STRATEGY   # hspmd's launcher
torchrun ... -m hspmd.runtime tests.netcluster.nodes:torchrun_work OUT STRATEGY
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

from hspmd.runtime.launch import NodeSpec
from hspmd.runtime.world import World
from hspmd.train.api import train_config
from hspmd.train.config import TrainConfig
from hspmd.train.loop import run_rank
from hspmd.train.trainer import train

MASTER = "10.213.0.1"
PORT = 29521


def config_of(strategy: str) -> TrainConfig:
    return train_config(strategy=strategy, global_batch=4, seq_len=32, steps=2)


def torchrun_work(world: World, out: str, strategy: str) -> str:
    outcome = run_rank(world, config_of(strategy))
    (Path(out) / f"rank-{world.rank}.pkl").write_bytes(pickle.dumps(outcome))
    return f"rank {world.rank} of {world.world_size} done"


def main(argv: list[str]) -> int:
    out, node_rank, num_nodes, strategy = argv
    node = NodeSpec(int(node_rank), int(num_nodes), MASTER, PORT)
    result = train(config_of(strategy), node=node, threads=1)
    Path(out).write_bytes(pickle.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
