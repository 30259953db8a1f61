"""Mixed-length data on real processes: four ways to train the same steps, side by side.

llama-small, 4 local gloo processes (one thread each), fp32, the default long-tailed
corpus (the Python standard library's sources split into documents, ``hspmd.data``), the
same tokens per step for every method. Each method is one training run of the same launch
(``train_many``), one after another:

- ``full-window``: Megatron's default: the corpus cut into windows of the context,
  attention across the documents of a window (``hspmd train --seq-len L``, fixed batches of
  ``N / L`` windows), under the best homogeneous strategy for it by the cost model;
- ``varlen``: whole documents packed into rows of at most ``L`` with document-masked
  attention, under one homogeneous strategy: the best by the cost model over every
  TP x CP x PP that fits, with the cost model's dispatch (as ours);
- ``hotspa``: HotSPa-style: one homogeneous strategy per bucket (maximum length L/4, L/2,
  L), each the best for its bucket, chosen per step by the same predicted time plus switch
  as ours (a stronger rule than HotSPa's smallest bucket), switching bf16... here fp32
  weights between them;
- ``ours``: ``plan_strategies`` on the corpus's length histogram (``hspmd plan --data``),
  chosen per step (``hspmd train --plans``), planned on a background worker.

The three packed methods run as length-plans runs (their strategies in a plans file) so
they share the dispatch, the data (``min_documents`` aligns their steps) and the switch
machinery. Time per step includes the switch before it; step 1 (warm-up) is left out.

    .venv/bin/python benchmarks/mixed_length.py --part local [--max-len 4096 --tokens 8192]
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from itertools import islice
from pathlib import Path
from typing import Any

from hspmd.cli.plan_lengths import apply_plans, read_length_plans
from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.data import DEFAULT_MAX_BYTES, document_steps, load_documents, split_documents
from hspmd.models.config import LlamaConfig, get_config
from hspmd.plan.strategy import StrategyOptions
from hspmd.planner.length_candidates import homogeneous_strategies, pick, sampled_seconds
from hspmd.planner.lengths import (
    Histogram,
    LengthStrategy,
    PipeSpec,
    pipe_configs,
    plan_strategies,
    plans_json,
    switch_matrix,
    sync_seconds,
    to_strategy,
)
from hspmd.train.api import train_config
from hspmd.train.config import LengthPlans, TrainConfig

NPROC, MODEL = 4, "llama-small"
OPTIONS = StrategyOptions(dtype="fp32")  # no recompute, no SP: every method the same
# a rank's memory in the planners' cluster file (MB of 10^6 bytes, less 5% headroom, with
# the memory model's assumed 3 GiB overhead): at 4000 one rank holds a row of at most 2048
# tokens of llama-small, so longer documents need CP or TP, as on GPUs whose memory binds
MEMORY_MB = 4000
MIN_DOCS = 1  # documents a step at least: the same steps for every run


def cost_model(directory: Path, profile: str | None, memory_mb: float = MEMORY_MB) -> CostModel:
    """4 local ranks of this machine's profile (measured now unless ``profile`` is given),
    each with ``memory_mb`` of memory (the planners keep under it; the processes do not)."""
    path = Path(profile) if profile else directory / "profile.json"
    if not profile:
        from hspmd.cost.measure import profile_machine

        path.write_text(profile_machine(quick=True, nproc=NPROC, dtype="fp32").to_json())
    kind = {"memory_mb": memory_mb, "bf16_tflops": 1, "profile": str(path),
            "intra_link": {"name": "loopback", "GBps": 1}}  # fmt: skip
    cluster = {"format": "hspmd.cluster/1", "name": "local-4", "gpu_kinds": {"cpu": kind},
               "inter_link": {"name": "loopback", "GBps": 1},
               "nodes": [{"kind": "cpu", "count": 1, "gpus_per_node": NPROC}]}  # fmt: skip
    file = directory / "local.json"
    file.write_text(json.dumps(cluster))
    return CostModel.of(load_cluster(file), dtype="fp32")


def sample_steps(
    tokens: int, max_len: int, count: int, min_docs: int, seed: int = 1
) -> list[list[int]]:
    """The document lengths of ``count`` steps of the corpus (seed 1: the planners'
    samples; seed 0: the runs' steps)."""
    stream = document_steps(tokens, seed, max_len=max_len, min_documents=min_docs)
    return [list(s.lengths) for s in islice(stream, count)]


def varlen_candidates(
    config: LlamaConfig, cost: CostModel, row_len: int, tokens: int
) -> list[LengthStrategy]:
    """Every homogeneous TP x CP x PP of all ranks with rows of ``row_len`` and micro-
    batches (one row each) for twice a step's tokens (the one strategy of a run must take
    every step)."""
    out = []
    for m in pipe_configs(config, cost, options=OPTIONS, max_len=row_len):
        n = NPROC // m.config.gpus
        micro = math.ceil(2 * tokens / (n * row_len))
        if m.fit_len < row_len or NPROC % m.config.gpus:
            continue
        pipes = tuple(PipeSpec(m, row_len, micro) for _ in range(n))
        strategy = to_strategy(pipes, config.num_layers)
        sync = sync_seconds(strategy, config, cost)
        out.append(LengthStrategy(row_len, pipes, ((1, row_len),) * n, 0.0, sync, strategy,
                                  OPTIONS))  # fmt: skip
    return out


def hotspa_candidates(
    config: LlamaConfig, cost: CostModel, row_len: int, tokens: int
) -> list[LengthStrategy]:
    """Every homogeneous strategy for one bucket, as ours gets them."""
    models = pipe_configs(config, cost, options=OPTIONS, max_len=row_len)
    return homogeneous_strategies(models, gpus=NPROC, row_len=row_len, step_tokens=tokens,
                                  config=config, cost=cost, options=OPTIONS)  # fmt: skip


def full_window(config: LlamaConfig, cost: CostModel, max_len: int, tokens: int) -> str:
    """The best homogeneous strategy for ``tokens / max_len`` windows of ``max_len``
    (every window ``L^2`` attention), by the cost model."""
    windows = tokens // max_len
    found = []
    for m in pipe_configs(config, cost, options=OPTIONS, max_len=max_len):
        n = NPROC // m.config.gpus
        if NPROC % m.config.gpus or windows % n or m.fit_len < max_len:
            continue
        rows = [(float(max_len), float(max_len) ** 2)] * (windows // n)
        pipes = tuple(PipeSpec(m, max_len, windows // n) for _ in range(n))
        strategy = to_strategy(pipes, config.num_layers)
        found.append((m.seconds(rows) + sync_seconds(strategy, config, cost), str(strategy)))
    return min(found)[1]


def plans_file(plans: list[LengthStrategy], hist: Histogram, config: LlamaConfig,
               cost: CostModel, tokens: int) -> LengthPlans:  # fmt: skip
    data = plans_json(plans, hist, model=MODEL, cluster="local-4", step_tokens=tokens,
                      switch=switch_matrix(plans, config, cost))  # fmt: skip
    return read_length_plans(json.loads(json.dumps(data)), "plans")  # as the file reads back


def configs(
    max_len: int, tokens: int, steps: int, directory: Path, profile: str | None,
    memory_mb: float = MEMORY_MB,
) -> tuple[dict[str, TrainConfig], dict[str, Any]]:  # fmt: skip
    """The four runs and what was chosen for them (strategies, predicted seconds)."""
    config = get_config(MODEL, max_seq_len=max(max_len, 1024))
    overrides = (("max_seq_len", config.max_seq_len),)
    cost = cost_model(directory, profile, memory_mb)
    docs = [len(d) for d in split_documents(load_documents(None, max_bytes=DEFAULT_MAX_BYTES))]
    hist = Histogram.of(docs, max_len=max_len, smallest=max(1, max_len >> 6))
    t0 = time.perf_counter()
    samples = sample_steps(tokens, max_len, 32, MIN_DOCS)  # seed 1: not the runs' steps
    ours = plan_strategies(config, cost, hist, step_tokens=tokens, options=[OPTIONS],
                           samples=samples)  # fmt: skip
    plan_s = time.perf_counter() - t0
    buckets = [b for b in (max_len // 4, max_len // 2, max_len) if b >= 1]
    hotspa = [  # each bucket's strategy: the best on the steps whose longest is in it
        pick(hotspa_candidates(config, cost, b, tokens), samples, low=low)
        for low, b in zip([0, *buckets], buckets, strict=False)
    ]
    hotspa = [h for h in hotspa if h is not None]
    candidates = varlen_candidates(config, cost, max_len, tokens)
    varlen = [min(candidates, key=lambda p: sampled_seconds(p, samples, strict=True))]
    # a run asks a step for a document per pipeline of its narrowest strategy: the most
    # of those over the runs gives every run the same steps
    min_docs = max(
        MIN_DOCS, *(min(len(p.pipes) for p in plans) for plans in (ours, hotspa, varlen))
    )
    chosen = {"min_documents": min_docs, "plan_s": plan_s}
    base = train_config(model=MODEL, model_kwargs=overrides, seq_len=max_len,
                       step_tokens=tokens, steps=steps, min_documents=min_docs)  # fmt: skip
    runs: dict[str, TrainConfig] = {}
    window = full_window(config, cost, max_len, tokens)
    runs["full-window"] = train_config(
        model=MODEL, model_kwargs=overrides, strategy=window, seq_len=max_len,
        global_batch=tokens // max_len, steps=steps,
    )  # fmt: skip
    chosen["full-window"] = window
    for name, plans in (("varlen", varlen), ("hotspa", hotspa), ("ours", ours)):
        text = plans_file(plans, hist, config, cost, tokens)
        runs[name] = apply_plans(base, text, path=f"{name}.json")
        chosen[name] = [str(p.strategy) for p in plans]
    steps_now = sample_steps(tokens, max_len, steps, min_docs, seed=0)
    chosen["predicted_s"] = {n: statistics.mean(min(sampled_seconds(p, [s]) for p in plans
                                                    if p.max_len >= max(s)) for s in steps_now)
                             for n, plans in (("varlen", varlen), ("hotspa", hotspa),
                                              ("ours", ours))}  # fmt: skip
    return runs, chosen


def step_seconds(result: Any) -> list[float]:
    """Each step's seconds with the switch before it, step 1 (warm-up) left out."""
    return [r.seconds + (r.switch_seconds or 0.0) for r in result.records[1:]]


def local_part(*, max_len: int = 4096, tokens: int = 8192, steps: int = 6, rounds: int = 2,
               profile: str | None = None, memory_mb: float = MEMORY_MB) -> dict[str, Any]:  # fmt: skip
    """The four runs, ``rounds`` launches of them in rotated order (the load of a shared
    machine drifts; each method's figure is the median of its per-launch means)."""
    from hspmd.train.trainer import train_many

    with tempfile.TemporaryDirectory() as tmp:
        runs, chosen = configs(max_len, tokens, steps, Path(tmp), profile, memory_mb)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    names = list(runs)
    per: dict[str, list[Any]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name, result in zip(order, train_many([runs[n] for n in order], timeout_s=3600),
                                strict=True):  # fmt: skip
            per[name].append(result)
    out: dict[str, Any] = {"max_len": max_len, "tokens_per_step": tokens, "steps": steps,
                           "memory_mb": memory_mb,
                           "rounds": rounds, "load_before_after": [load, os.getloadavg()[0]],
                           "wall_s": time.perf_counter() - start, "chosen": chosen,
                           "methods": {n: summary(per[n]) for n in names}}  # fmt: skip
    print_local(out)
    return out


def summary(results: list[Any]) -> dict[str, Any]:
    """A method's launches: median of per-launch ms per 1K tokens (and their range)."""
    ms = []
    for result in results:
        times = step_seconds(result)
        ms.append(1e6 * sum(times) / sum(r.tokens for r in result.records[1:]))
    first = results[0].records[1:]
    return {
        "ms_per_1k_tokens": statistics.median(ms), "range": [min(ms), max(ms)],
        "s_per_step": statistics.median(statistics.mean(step_seconds(r)) for r in results),
        "tokens_per_step": statistics.mean(r.tokens for r in first),
        "switches": sum(r.switch_seconds is not None for r in first),
        "plans": [r.plan for r in results[0].records],
    }  # fmt: skip


def print_local(out: dict[str, Any]) -> None:
    m = out["methods"]
    print(f"\n{MODEL}, {NPROC} local processes, fp32, stdlib corpus, max length "
          f"{out['max_len']}, {out['tokens_per_step']} tokens a step, steps 2-{out['steps']}, "
          f"{out['rounds']} launches "
          f"(load average {out['load_before_after'][0]:.1f} before, "
          f"{out['load_before_after'][1]:.1f} after; {out['wall_s']:.0f} s)")  # fmt: skip
    print(f"{'method':<13}{'s/step':>8}{'tokens':>8}{'ms/1K tok':>11}{'(range)':>15}"
          f"{'switches':>9}{'ours faster':>13}")  # fmt: skip
    for name, r in m.items():
        ratio = r["ms_per_1k_tokens"] / m["ours"]["ms_per_1k_tokens"]
        spread = f"{r['range'][0]:.0f}-{r['range'][1]:.0f}"
        print(f"{name:<13}{r['s_per_step']:8.2f}{r['tokens_per_step']:8.0f}"
              f"{r['ms_per_1k_tokens']:11.1f}{spread:>15}{r['switches']:9d}{ratio:13.3f}")  # fmt: skip
    c = out["chosen"]
    print(f"full-window {c['full-window']}\nvarlen {c['varlen']}\nhotspa {c['hotspa']}\n"
          f"ours {c['ours']} (planned in {c['plan_s']:.2f} s)\nchosen per step: "
          + ", ".join(f"{n} {m[n]['plans']}" for n in ("hotspa", "ours"))
          + f"\npredicted s/step: {c['predicted_s']}")  # fmt: skip
    ratios = {n: round(r["ms_per_1k_tokens"] / m["ours"]["ms_per_1k_tokens"], 4)
              for n, r in m.items() if n != "ours"}  # fmt: skip
    print(json.dumps({"benchmark": "mixed_length", "part": "local", "ours_faster_than": ratios,
                      "load": out["load_before_after"]}))  # fmt: skip
