"""Parts (e), (f) and (h) of the GPU check (benchmarks/gpu_check.py): ZeRO (issue 38).

e. ``zero3``: one rank on the GPU (nccl) trains llama-tiny in fp32 (TF32 off) under ZeRO-3
   (prefetch on and off, with recompute), ZeRO-2, and ZeRO-3 in bf16, in one launch,
   each against the reference on CPU (``hspmd.train.compare``; bf16: losses within 2e-2).
f. ``zero_memory``: ZeRO 0 and 3 on one rank, each in a launch of its own (a launch's
   earlier runs could leave allocations behind): the rank's ``max_memory_allocated``
   against the memory model's peak (``hspmd.planner.memory``, without and with its assumed
   overhead), and the training state's tracked bytes (``hspmd.train.meter``) against the
   model's weights + gradients + masters and Adam: the figures ``benchmarks/zero.py``
   reports on CPU (its ``predicted``).
h. ``zero_cpu``: ``benchmarks/zero.py`` itself on the GPU machine's CPU cores: 4 gloo ranks
   of one torch thread each (``zero.py`` launches them so), CUDA hidden from them
   (``CUDA_VISIBLE_DEVICES=''``; FSDP2 there runs on an explicit CPU mesh); its table and
   JSON line, the cores and the load average before and after.

Why one rank for (e) and (f): ZeRO shards over data-parallel replicas, and one GPU holds
one rank. nccl refuses two ranks on one device (``ncclInvalidUsage``, "Duplicate GPU
detected"), gloo takes CUDA tensors for all-reduce and broadcast only (ZeRO's gathers and
reduces are point-to-point batches), and ``hspmd train`` puts ranks on CUDA only with a GPU
per rank (``--device auto`` falls back to gloo on CPU, ``cuda`` is refused). On one rank
ZeRO-3 runs its whole mechanism on CUDA tensors (parameters stored apart and freed
between uses by ``untyped_storage().resize_``, gathered per layer by resolved plans that
here move nothing, saved-tensor hooks, the sharded Post with its fp32 masters) but no shard
is split: the memory it saves over 4 ranks is (h)'s figure, on CPU.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ZERO_STRATEGY = "2x1: R0:L0-3"  # (e): one pipeline, one rank, 2 micro-batches of 1
# (f): 8 layers of hidden 2048 (0.54 B parameters: 8.7 GB of fp32 state) at 1024 tokens;
# the dry run: gpu_check's toy shapes with 4 layers
MEMORY_GPU = {
    "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_layers": 8,
    "num_heads": 16, "num_kv_heads": 16, "max_seq_len": 1024,
}  # fmt: skip
MEMORY_STEPS = 4
# (h): zero.py's arguments; 2 rounds (ABAB: FSDP2 last, then first) of 6 steps
ZERO_CPU_ARGS = {"gpu": ["--rounds", "2", "--steps", "6"],
                 "dry": ["--tiny", "--rounds", "1", "--steps", "3", "--runs", "ZeRO-3"]}  # fmt: skip


def part_zero3(data: dict[str, Any], _out: Path, *, dry: bool) -> None:
    import torch
    from gpu_check import DATA, _verdict

    from hspmd.train.api import revise, train_config
    from hspmd.train.config import AdamConfig
    from hspmd.train.reference import run_reference
    from hspmd.train.trainer import train_many

    if torch.cuda.is_available():  # the ranks get NVIDIA_TF32_OVERRIDE=0 (parent)
        torch.backends.cuda.matmul.allow_tf32 = False
    base = train_config(
        model="llama-tiny", strategy=ZERO_STRATEGY, global_batch=2, seq_len=64, steps=3,
        seed=0, adam=AdamConfig(lr=1e-3), data=DATA, device="cpu" if dry else "cuda",
    )  # fmt: skip
    reference = run_reference(revise(base, device="cpu"))
    runs = {
        "zero3": revise(base, zero=3),
        "zero3_no_overlap": revise(base, zero=3, zero_overlap=False),
        "zero3_recompute": revise(base, zero=3, recompute=True),
        "zero2": revise(base, zero=2),
        "zero3_bf16": revise(base, zero=3, dtype="bf16"),
    }
    if dry:  # the plumbing: the other runs differ in options only (tests/train/test_zero.py)
        runs = {name: runs[name] for name in ("zero3", "zero3_bf16")}
    data["replicas"] = 1
    on = "CPU (gloo: dry run)" if dry else "the GPU (nccl)"
    results = train_many(list(runs.values()))
    for (name, config), result in zip(runs.items(), results, strict=True):
        if config.options.dtype == "bf16":
            rel = max(abs(a - b) / abs(b)
                      for a, b in zip(result.losses, reference.losses, strict=True))  # fmt: skip
            print(f"{name} on {on}: losses {rel:.1e} from the fp32 reference (bf16: within "
                  "2e-2 passes)", flush=True)  # fmt: skip
            data[name] = {"ok": rel < 2e-2, "max_loss_rel": rel, "losses": list(result.losses)}
            continue
        data[name] = _verdict(f"{name}, 1 rank on {on} vs the reference on CPU", result, reference)
    bad = [k for k, v in data.items() if isinstance(v, dict) and v.get("ok") is False]
    if bad:
        data["error"] = f"checks failed: {', '.join(bad)}"


def part_zero_memory(data: dict[str, Any], _out: Path, *, dry: bool) -> None:
    from gpu_check import DATA, SHAPES_DRY

    from hspmd.train.api import train_config
    from hspmd.train.config import AdamConfig

    shapes = {**SHAPES_DRY, "num_layers": 4} if dry else MEMORY_GPU
    base = train_config(
        model="llama-tiny", model_kwargs=tuple(sorted(shapes.items())), strategy=ZERO_STRATEGY,
        global_batch=2, seq_len=shapes["max_seq_len"], steps=MEMORY_STEPS,
        adam=AdamConfig(lr=1e-4), data=DATA, device="cpu" if dry else "cuda",
        measure_memory=True,
    )  # fmt: skip
    data["model"] = dict(shapes)
    data["run"] = {"strategy": ZERO_STRATEGY, "dtype": "fp32", "steps": MEMORY_STEPS}
    entries = _memory_runs(base, (0, 3), apart=not dry)  # CPU: no allocator to share
    for zero, entry in zip((0, 3), entries, strict=True):
        data[f"zero{zero}"] = entry
        print(
            f"ZeRO-{zero}: state {_mib(entry['state_bytes'])} measured, "
            f"{_mib(entry['predicted_state_bytes'])} predicted "
            f"({entry['state_predicted_over_measured']:.3f}); max_memory_allocated "
            f"{_mib(entry['max_memory_allocated'])}, memory model "
            f"{_mib(entry['model_peak_without_overhead'])} without its overhead"
            + (f" ({entry['model_over_allocated']:.3f})" if "model_over_allocated" in entry else "")
            + f"; median step {entry['median_step_s']:.4f} s",
            flush=True,
        )
    z0, z3 = data["zero0"], data["zero3"]
    data["zero3_over_zero0"] = {"state": z3["state_bytes"] / z0["state_bytes"],
                                "predicted_state": z3["predicted_state_bytes"] / z0["predicted_state_bytes"]}  # fmt: skip
    if z0.get("max_memory_allocated") and z3.get("max_memory_allocated"):
        ratio = z3["max_memory_allocated"] / z0["max_memory_allocated"]
        data["zero3_over_zero0"]["max_memory_allocated"] = ratio
    ratios = ", ".join(f"{k} {v:.3f}" for k, v in data["zero3_over_zero0"].items())
    print(f"ZeRO-3 / ZeRO-0 on one rank: {ratios}", flush=True)


def _memory_runs(base: Any, stages: tuple[int, ...], *, apart: bool) -> list[dict[str, Any]]:
    """``base`` under each ZeRO stage (``apart``: a launch each): measured and predicted
    bytes of rank 0."""
    from zero import predicted

    from hspmd.plan.strategy import StrategyOptions
    from hspmd.planner.memory import OVERHEAD_BYTES, strategy_memory
    from hspmd.train.api import revise
    from hspmd.train.trainer import train, train_many

    configs = [revise(base, zero=zero) for zero in stages]
    results = [train(c) for c in configs] if apart else train_many(configs)
    entries = []
    for config, result in zip(configs, results, strict=True):
        model = strategy_memory(
            config.require_strategy(), config.model_config(), seq_len=config.batch.seq_len,
            options=StrategyOptions(zero=config.zero, dtype=config.options.dtype),
        )[0]  # fmt: skip
        seconds = [r.seconds for r in result.records]
        state, want = result.state_peak[0], predicted(config, 0)
        allocated = result.peak_memory.get(0)
        entry: dict[str, Any] = {
            "state_bytes": state, "predicted_state_bytes": want,
            "state_predicted_over_measured": want / state, "max_memory_allocated": allocated,
            "model_parts": {k: getattr(model, k) for k in
                            ("weights", "gradients", "optimizer", "activations", "logits")},
            "model_peak": model.peak, "model_peak_without_overhead": model.peak - OVERHEAD_BYTES,
            "step_seconds": seconds, "median_step_s": statistics.median(seconds[1:]),
            "losses": list(result.losses),
        }  # fmt: skip
        if allocated:
            entry["model_over_allocated"] = (model.peak - OVERHEAD_BYTES) / allocated
        entries.append(entry)
    return entries


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def part_zero_cpu(data: dict[str, Any], _out: Path, *, dry: bool) -> None:
    from gpu_check import SRC

    args = ZERO_CPU_ARGS["dry" if dry else "gpu"]
    command = [sys.executable, str(BENCH / "zero.py"), *args]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    data["command"] = " ".join(["python", "benchmarks/zero.py", *args])
    data["cpus"], data["load_before"] = os.cpu_count(), os.getloadavg()
    print(f"{data['command']} on {data['cpus']} cores, load {data['load_before']}", flush=True)
    begin = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    data["wall_seconds"] = round(time.perf_counter() - begin, 1)
    data["load_after"] = os.getloadavg()
    lines = done.stdout.rstrip("\n").splitlines()
    for line in lines[:-1]:
        print(line, flush=True)
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"zero.py exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    data["table"] = lines[:-1]
    data["json"] = result = json.loads(lines[-1])
    goal = result.get("goal", {})
    data["summary"] = {k: v for k, v in goal.items() if not isinstance(v, dict)}
    print(f"goals: {json.dumps(data['summary'])}", flush=True)
