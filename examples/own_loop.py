"""Train with your own loop over ``hspmd.build``, then check it against the reference.

    PYTHONPATH=src python examples/own_loop.py          # from a clone (or pip install -e .)

Four local processes (gloo on CPU): pipeline 0 runs the GPT-2 example's layer 0 on a
tensor-parallel pair (ranks 0-1) and layer 1 on rank 2, two micro-batches of one sequence;
pipeline 1 runs both layers on rank 3, one micro-batch of two. Each rank builds its
program and runs the loop below; the launcher joins their parameter slices and compares
loss and weights with the same model trained on one process by plain PyTorch. Exit status
1 if they differ (docs/api.md, "Your own loop").
"""

from __future__ import annotations

import time
from typing import Any

import hspmd
from hspmd.models.examples import gpt2

STRATEGY = "2x1: R0-1:L0 R2:L1; 1x2: R3:L0-1"
OPTIONS: dict[str, Any] = {
    "model_kwargs": {"num_layers": 2, "tie": False},  # two stages: the head is not tied
    "seq_len": 32,
    "steps": 3,
    "lr": 1e-3,
    "data_max_bytes": 1 << 20,
}


def work(world: Any) -> dict[str, Any]:
    """One rank: build its program, train ``steps`` global batches, return its outcome."""
    program = hspmd.build(gpt2, STRATEGY, world=world, **OPTIONS)
    records = []
    for step, batch in enumerate(program.batches(), start=1):  # every rank: the same batch
        began = time.perf_counter()
        program.zero_grad()
        local = program.forward_backward(batch)  # this rank's F and B actions
        program.step()  # gradient sync across the pipelines, then Adam on its slices
        loss = program.loss(local)  # an all-reduce: the global mean token loss
        records.append(program.record(step, loss, began=began))
        if world.rank == 0:
            print(f"step {step}  loss {loss:.6f}", flush=True)
    return program.outcome(records)


def main() -> hspmd.Comparison:
    config = hspmd.train_config(gpt2, STRATEGY, **OPTIONS)
    outcomes = hspmd.launch(work, hspmd.parse_strategy(STRATEGY).num_ranks)
    result = hspmd.assemble(outcomes, config)
    reference = hspmd.fit(gpt2, STRATEGY, reference=True, **OPTIONS)
    report = hspmd.compare(result, reference, config=config)
    print(f"own loop:  {[round(x, 6) for x in result.losses]}")
    print(f"reference: {[round(x, 6) for x in reference.losses]}")
    print(report)
    return report


if __name__ == "__main__":  # the ranks are processes that import this file
    raise SystemExit(0 if main().ok else 1)
