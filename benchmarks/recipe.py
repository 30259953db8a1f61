"""What the full training recipe costs, and that it still equals the reference.

For each strategy, one launch of local gloo processes (one thread per rank) trains the
same run twice per round, in rotated order over the rounds: the paper's plain Adam at a
constant learning rate, and the full recipe (AdamW with weight decay 0.1, cosine decay
after warm-up, clipping at global norm 1.0, which every step exceeds: one extra 8-byte
all-reduce over the world, a norm per owned gradient and a scaling of every gradient).
Step 1 is left out; the figure is the median step time of the recipe over that of plain
Adam. The recipe's runs are compared with the single-device reference running torch's
AdamW and ``clip_grad_norm_``: the largest relative difference of the losses, the
gradient norms and the final parameters.

On a loaded machine the step times swing by more than what clipping adds, so beside them
an estimate that load hardly touches: the clipping's local work on the whole model's
gradients (a norm per tensor, the scaling of every tensor: what a rank holding every
parameter does), timed in a loop on one thread, over the plain step time.

    .venv/bin/python benchmarks/recipe.py            # 3 strategies, llama-tiny, 3 rounds
    .venv/bin/python benchmarks/recipe.py --quick    # 1 strategy, 1 round

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from hspmd.train.api import revise, train_config
from hspmd.train.clip import square_sum
from hspmd.train.compare import compare
from hspmd.train.config import AdamConfig, TrainConfig
from hspmd.train.reference import TrainResult, run_reference
from hspmd.train.trainer import train_many

STRATEGIES = {
    "2-rank DP": ("4x1: R0:L0-3; 4x1: R1:L0-3", False),
    "TP2+PP2 | TP1": ("2x2: R0-1:L0-1 R2:L2-3; 2x2: R3:L0-3", False),
    "ZeRO-1, TP2 | PP2": ("2x2: R0-1:L0-3; 2x2: R2:L0-1 R3:L2-3", True),
}
PLAIN = AdamConfig(lr=1e-3)
RECIPE = AdamConfig(lr=1e-3, beta2=0.95, weight_decay=0.1, lr_schedule="cosine",
                    warmup_steps=2, min_lr=1e-4)  # fmt: skip


def _median_step(result: TrainResult) -> float:
    return statistics.median(r.seconds for r in result.records[1:])


def measure(strategy: str, zero1: bool, *, steps: int, rounds: int) -> dict[str, float]:
    base = train_config(strategy=strategy, zero=int(zero1), global_batch=8, seq_len=128,
                       steps=steps, adam=PLAIN, data_max_bytes=1 << 20)  # fmt: skip
    recipe = revise(base, adam=RECIPE, clip_grad_norm=1.0)
    configs = []
    for r in range(rounds):
        configs += [base, recipe] if r % 2 == 0 else [recipe, base]
    results = train_many(configs, threads=1, timeout_s=1800)
    plain_times = [_median_step(res) for c, res in zip(configs, results, strict=True) if c is base]
    recipe_runs = [res for c, res in zip(configs, results, strict=True) if c is recipe]
    reference = run_reference(revise(recipe, strategy=None, zero=0))
    check = compare(recipe_runs[0], reference)
    norms = max(
        abs(a.grad_norm - b.grad_norm) / b.grad_norm
        for a, b in zip(recipe_runs[0].records, reference.records, strict=True)
        if a.grad_norm is not None and b.grad_norm is not None
    )
    return {
        "plain_s": statistics.median(plain_times),
        "recipe_s": statistics.median(_median_step(r) for r in recipe_runs),
        "loss_rel": check.max_loss_rel,
        "param_rel": check.max_param_rel,
        "norm_rel": norms,
        "clipped_steps": sum(1 for r in reference.records if (r.grad_norm or 0) > 1.0),
    }


class _Everything:
    """A Post whose rank holds and owns every gradient of the model."""

    def __init__(self, grads: dict[str, torch.Tensor]) -> None:
        self._grads, self.owned = grads, frozenset(grads)

    def grads(self) -> dict[str, torch.Tensor]:
        return self._grads


def clip_work_s(config: TrainConfig, *, repeats: int = 50) -> float:
    """Seconds of clipping's local work on every gradient of the model, one thread."""
    torch.set_num_threads(1)
    grads = {n: torch.randn(s) for n, s in config.model_config().parameter_shapes().items()}

    post = _Everything(grads)
    begin = time.perf_counter()
    for _ in range(repeats):
        square = square_sum(post, torch.device("cpu"))
        coef = torch.clamp(1.0 / (square.sqrt().float() + 1e-6), max=1.0)
        for grad in grads.values():
            grad.mul_(coef)
    return (time.perf_counter() - begin) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one strategy, one round")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    names = list(STRATEGIES)[:1] if args.quick else list(STRATEGIES)
    rounds = 1 if args.quick else 3
    table = Table("strategy", "plain Adam s/step", "recipe s/step", "recipe / plain",
                  "clip work / plain", "loss rel", "norm rel", "param rel",
                  "clipped steps")  # fmt: skip
    out: dict[str, dict[str, float]] = {}
    for name in names:
        strategy, zero1 = STRATEGIES[name]
        m = out[name] = measure(strategy, zero1, steps=args.steps, rounds=rounds)
        m["clip_work_s"] = clip_work_s(train_config())
        table.add_row(name, f"{m['plain_s']:.4f}", f"{m['recipe_s']:.4f}",
                      f"{m['recipe_s'] / m['plain_s']:.3f}",
                      f"{m['clip_work_s'] / m['plain_s']:.4f}", f"{m['loss_rel']:.1e}",
                      f"{m['norm_rel']:.1e}", f"{m['param_rel']:.1e}",
                      f"{m['clipped_steps']}/{args.steps}")  # fmt: skip
    Console().print(table)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
