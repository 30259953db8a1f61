"""hspmd's training step against plain PyTorch baselines, side by side in one run.

Same model preset, same global batch and sequence length, same Adam, gloo on local CPU
processes; each side's time is the median step time over the measured steps (the first
step is warm-up), the better of two alternating runs. Pairs:

    one rank          hspmd "1xB: R0:L0-.."          vs  a plain PyTorch loop
    2-rank DP         hspmd "N/2 x1: R0; .. R1"       vs  DistributedDataParallel
                      (and the same with gradient sync after backward: --no-overlap)
    2-rank TP         hspmd "1xB: R0-1:L0-.."        vs  DTensor tensor parallel (blocks)
    4-stage 1F1B      hspmd "4x(B/4): R0 R1 R2 R3"    vs  torch.distributed.pipelining Schedule1F1B

A ratio is hspmd's step time over the baseline's (below 1: hspmd is faster). Rows that
cannot run say why, with no ratio.

    .venv/bin/python benchmarks/training.py            # llama-tiny, about a minute
    .venv/bin/python benchmarks/training.py --big      # llama-small, longer sequences

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

from hspmd.models.llama import Llama, init_weights
from hspmd.runtime.launch import launch
from hspmd.runtime.world import World
from hspmd.train.api import revise, train_config
from hspmd.train.batches import step_batches
from hspmd.train.config import AdamConfig, TrainConfig
from hspmd.train.reference import run_reference
from hspmd.train.trainer import train


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    ours_s: float | None
    baseline: str
    baseline_s: float | None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.ours_s is None or self.baseline_s is None:
            return None
        return self.ours_s / self.baseline_s


def median_after_warmup(seconds: list[float]) -> float:
    return statistics.median(seconds[1:] if len(seconds) > 1 else seconds)


def config_for(base: TrainConfig, strategy: str | None) -> TrainConfig:
    return revise(base, strategy=strategy)


# -- baselines (module-level: workers pickle them by name) ------------------------------------


def _adam(params: Any, config: TrainConfig) -> torch.optim.Adam:
    a = config.adam
    return torch.optim.Adam(params, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps, foreach=False)


def ddp_worker(world: World, config: TrainConfig) -> list[float]:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(init_weights(Llama(config.model_config()), config.seed))
    optimizer = _adam(model.parameters(), config)
    rows = config.batch.global_batch // world.world_size
    mine = slice(world.rank * rows, (world.rank + 1) * rows)
    times = []
    for tokens, targets in step_batches(config):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens[mine], targets[mine])
        loss.backward()  # DDP averages the gradients: equal halves give the global mean
        optimizer.step()
        report = loss.detach() / world.world_size
        dist.all_reduce(report)  # the global loss, as hspmd reports it
        times.append(time.perf_counter() - start)
    return times


def dtensor_tp_worker(world: World, config: TrainConfig) -> list[float]:
    """Megatron-style TP of every block with DTensor (embedding and head replicated)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = world.world_size
    mesh = init_device_mesh("cpu", (tp,))
    model = init_weights(Llama(config.model_config()), config.seed)
    for block in model.layers:
        plan = {name: ColwiseParallel() for name in ("attn.wq", "attn.wk", "attn.wv")}
        plan |= {"mlp.w_gate": ColwiseParallel(), "mlp.w_up": ColwiseParallel()}
        plan |= {"attn.wo": RowwiseParallel(), "mlp.w_down": RowwiseParallel()}
        parallelize_module(block, mesh, plan)  # type: ignore[arg-type]
        block.attn.num_heads //= tp  # local heads: the views see local tensors
        block.attn.num_kv_heads //= tp
    optimizer = _adam(model.parameters(), config)
    times = []
    for tokens, targets in step_batches(config):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens, targets)
        loss.backward()
        optimizer.step()
        report = loss.detach().clone()
        dist.all_reduce(report)
        times.append(time.perf_counter() - start)
    return times


class _PipeStage(nn.Module):
    """Layers ``first..last`` of the model; the last stage returns logits."""

    def __init__(self, model: Llama, first: int, last: int) -> None:
        super().__init__()
        n = model.config.num_layers
        self.embed = model.embed if first == 0 else None
        self.layers = nn.ModuleList(model.layers[first : last + 1])
        self.norm = model.norm if last == n - 1 else None
        self.head = model.head if last == n - 1 else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x, cos, sin)
        if self.head is not None and self.norm is not None:
            x = self.head(self.norm(x))
        return x


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def pipelining_worker(world: World, config: TrainConfig) -> list[float]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    model = init_weights(Llama(config.model_config()), config.seed)
    n, stages = model.config.num_layers, world.world_size
    bounds = [n * s // stages for s in range(stages + 1)]
    module = _PipeStage(model, bounds[world.rank], bounds[world.rank + 1] - 1)
    stage = PipelineStage(module, world.rank, stages, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=stages, loss_fn=_ce)
    optimizer = _adam(module.parameters(), config)
    times = []
    for tokens, targets in step_batches(config):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if world.rank == 0:
            schedule.step(tokens)
        elif world.rank == stages - 1:
            schedule.step(target=targets, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        report = torch.stack(losses).mean() if losses else torch.zeros(())
        dist.all_reduce(report)
        times.append(time.perf_counter() - start)
    return times


REPEATS = 2


def best_of(ours_fn: Callable[[], float], theirs_fn: Callable[[], float]) -> tuple[float, float]:
    """Alternate the two measurements REPEATS times; keep each side's fastest median (the
    machine is shared: the minimum is the least disturbed run)."""
    mine, theirs = [], []
    for _ in range(REPEATS):
        mine.append(ours_fn())
        theirs.append(theirs_fn())
    return min(mine), min(theirs)


# -- rows -------------------------------------------------------------------------------------


def ours(config: TrainConfig) -> float:
    return median_after_warmup([r.seconds for r in train(config, threads=1).records])


def row_one_rank(base: TrainConfig) -> Row:
    n = base.model_config().num_layers
    config = config_for(base, f"1x{base.batch.global_batch}: R0:L0-{n - 1}")
    mine, plain = best_of(
        lambda: ours(config),
        lambda: median_after_warmup([r.seconds for r in run_reference(base).records]),
    )
    return Row("one rank", mine, "plain PyTorch", plain)


def row_dp(base: TrainConfig) -> list[Row]:
    """Two rows measured in one alternation: overlapped gradient sync (the default) and
    the same strategy with every sync after the last backward (``overlap=False``)."""
    n, half = base.model_config().num_layers, base.batch.global_batch // 2
    config = config_for(base, f"1x{half}: R0:L0-{n - 1}; 1x{half}: R1:L0-{n - 1}")
    plain = revise(config, overlap=False)
    mine, late, theirs = [], [], []
    for _ in range(REPEATS):
        mine.append(ours(config))
        late.append(ours(plain))
        theirs.append(median_after_warmup(launch(ddp_worker, 2, args=(base,), threads=1)[0]))
    ddp = min(theirs)
    return [
        Row("2-rank DP", min(mine), "DistributedDataParallel", ddp),
        Row("2-rank DP, no overlap", min(late), "DistributedDataParallel", ddp, "sync after B"),
    ]


def row_tp(base: TrainConfig) -> Row:
    n = base.model_config().num_layers
    config = config_for(base, f"1x{base.batch.global_batch}: R0-1:L0-{n - 1}")
    mine, theirs = best_of(
        lambda: ours(config),
        lambda: median_after_warmup(launch(dtensor_tp_worker, 2, args=(base,), threads=1)[0]),
    )
    return Row("2-rank TP", mine, "DTensor TP", theirs, "DTensor: blocks only")


def row_pp(base: TrainConfig) -> Row:
    n, mb = base.model_config().num_layers, base.batch.global_batch // 4
    bounds = [n * s // 4 for s in range(5)]
    stages = " ".join(f"R{s}:L{bounds[s]}-{bounds[s + 1] - 1}" for s in range(4))
    config = config_for(base, f"4x{mb}: {stages}")
    mine, theirs = best_of(
        lambda: ours(config),
        lambda: median_after_warmup(launch(pipelining_worker, 4, args=(base,), threads=1)[0]),
    )
    return Row("4-stage 1F1B", mine, "pipelining Schedule1F1B", theirs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big", action="store_true", help="llama-small, seq 256, 8 steps")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--only-dp", action="store_true", help="only the two 2-rank DP rows")
    args = parser.parse_args()
    torch.set_num_threads(1)  # every rank, ours and the baselines', runs one thread
    model, seq, steps = ("llama-small", 256, 8) if args.big else ("llama-tiny", 128, 10)
    base = train_config(
        model=model, global_batch=8, seq_len=seq, steps=args.steps or steps,
        adam=AdamConfig(lr=1e-4), data_max_bytes=1 << 20,
    )  # fmt: skip
    rows: list[Row] = []
    builders: list[Callable[[TrainConfig], Row | list[Row]]] = [
        row_one_rank, row_dp, row_tp, row_pp,
    ]  # fmt: skip
    if args.only_dp:
        builders = [row_dp]
    for build in builders:
        built = build(base)
        rows += built if isinstance(built, list) else [built]
    table = Table(
        title=f"{model}, global batch {base.batch.global_batch} x {seq} tokens, median step"
    )
    for column in ("case", "hspmd ms", "baseline", "baseline ms", "ratio", "note"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            r.name,
            "-" if r.ours_s is None else f"{r.ours_s * 1e3:.1f}",
            r.baseline,
            "-" if r.baseline_s is None else f"{r.baseline_s * 1e3:.1f}",
            "-" if r.ratio is None else f"{r.ratio:.3f}",
            r.note,
        )
    Console().print(table)
    keys = {"one rank": "single", "2-rank DP": "dp2_vs_ddp",
            "2-rank DP, no overlap": "dp2_no_overlap_vs_ddp", "2-rank TP": "tp2_vs_dtensor",
            "4-stage 1F1B": "pp4_vs_pipelining"}  # fmt: skip
    print(json.dumps({"benchmark": "training", "model": model, "seq_len": seq,
                      **{keys[r.name]: r.ratio for r in rows}}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
