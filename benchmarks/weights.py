"""Pretrained weights in and out at 1B parameters: peak memory per rank, load and export time.

A Llama of TinyLlama-1.1B's shape (22 layers, hidden 2048, MLP 5632, 32 heads, 4 KV heads,
vocabulary 32000: 1.1B parameters) is written as a Hugging Face folder (config.json and one
bf16 model.safetensors of random values, streamed a tensor at a time), then:

    load       4 rank processes, at once, each build their executable graph under a PP x TP
               strategy from --model hf:DIR: every parameter slice read from the file
               (safetensors get_slice). Per rank: its shard (fp32 bytes of its slices), the
               RSS when the first slice is read (the fixed overhead: Python, torch,
               transformers, the model on meta, its graph, the deduction), the peak RSS
               (ru_maxrss) and (peak - overhead) / shard: the goal is at most 1.3.
    init       the same from a copy of the folder without weights: the model's own
               initialization replayed per slice from the seed.
    export     the ranks' slices saved as a checkpoint (fp32, as training saves masters),
               then hspmd export --format hf in its own process: time and peak RSS, and a
               bit-for-bit comparison of the exported bf16 tensors with the source file.

Only the loading path runs (no training step, no Adam states): 4 processes training a
1B model at once on the CPU would not fit this machine's memory with their optimizer
states, and would measure the optimizer, not the loading.

    .venv/bin/python benchmarks/weights.py                     # ~5 GB of disk, a few minutes
    .venv/bin/python benchmarks/weights.py --layers 2 --hidden 256 --intermediate 512 \\
        --heads 4 --kv-heads 2 --vocab 1024                      # the same at toy size

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

STRATEGY = "1x2: R0-1:L0-10 R2-3:L11-21"


def llama_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16",
        "hidden_size": args.hidden, "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads, "vocab_size": args.vocab, "hidden_act": "silu",
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "initializer_range": 0.02, "attention_bias": False, "mlp_bias": False,
    }  # fmt: skip


def shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The Llama's parameters in transformers' names, as save_pretrained orders them."""
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = h // config["num_attention_heads"] * config["num_key_value_heads"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)), (p + "mlp.down_proj.weight", (h, f)),
            (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
            (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.v_proj.weight", (kv, h)),
        ]  # fmt: skip
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def write_model(folder: Path, config: dict[str, Any]) -> float:
    """config.json and a bf16 model.safetensors of random values, a tensor at a time."""
    from hspmd.checkpoint.export import write_streamed

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    start = time.perf_counter()

    def value(name: str) -> torch.Tensor:
        shape = dict(shapes(config))[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape)
        generator = torch.Generator().manual_seed(len(name) * 7919 + sum(map(ord, name)))
        return torch.randn(shape, generator=generator) * 0.02

    write_streamed(folder / "model.safetensors", shapes(config), "bfloat16", value)
    return time.perf_counter() - start


def rss_mib() -> float:
    """This process's resident memory now (from /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker(args: argparse.Namespace) -> None:
    """One rank: build its executable graph from hf:DIR; print one JSON line."""
    import hspmd.specialize.executable as executable
    from hspmd.models.module import load_model
    from hspmd.plan.strategy import StrategyOptions, parse_strategy

    start = time.perf_counter()
    marks: dict[str, float] = {}
    read = executable.initial_piece

    def timed(*a: Any, **k: Any) -> torch.Tensor:
        if "overhead" not in marks:
            marks["overhead"], marks["first"] = rss_mib(), time.perf_counter()
        out = read(*a, **k)
        marks["slices"] = marks.get("slices", 0.0) + out.numel() * out.element_size()
        return out

    executable.initial_piece = timed  # type: ignore[assignment]
    model = load_model(f"hf:{args.dir}")
    strategy = parse_strategy(args.strategy)
    exe = executable.build_executable(
        model, strategy, StrategyOptions(), args.rank, seq_len=16, seed=0
    )
    end = time.perf_counter()
    shard = sum(p.numel() * p.element_size() for p in exe.params.values())
    if args.save:
        save_shard(args, model, strategy, exe.params)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({
        "rank": args.rank, "shard_mib": shard / 2**20, "overhead_mib": marks["overhead"],
        "peak_mib": peak, "ratio": (peak - marks["overhead"]) / (shard / 2**20),
        "slices_s": end - marks["first"], "total_s": end - start,
    }))  # fmt: skip


def save_shard(args: argparse.Namespace, model: Any, strategy: Any, params: Any) -> None:
    from hspmd.checkpoint.store import staging_dir, write_shard
    from hspmd.plan.params import ParamSpec, parameter_annotations

    specs = {
        f"param/{n}": ParamSpec(f"param/{n}", s.shape, s.annotation)
        for n, s in parameter_annotations(strategy, model).items()
    }
    tensors = {f"param/{n}": p.detach() for n, p in params.items()}
    write_shard(staging_dir(args.save, 0), rank=args.rank, specs=specs, tensors=tensors)


def export_worker(args: argparse.Namespace) -> None:
    from hspmd.checkpoint.export import export_checkpoint

    start = time.perf_counter()
    result = export_checkpoint(args.save, args.out)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"export_s": seconds, "peak_mib": peak, "bytes": result.bytes}))


def _run(*extra: str) -> list[dict[str, Any]]:
    """This file in worker processes (one per ``extra`` group), at once; their JSON lines."""
    procs = [subprocess.Popen([sys.executable, __file__, *e.split("\0")], stdout=subprocess.PIPE,
                              text=True) for e in extra]  # fmt: skip
    outs = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"a worker failed ({proc.returncode}): {out[-2000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def load_all(folder: Path, strategy: str, ranks: int, save: Path | None) -> list[dict[str, Any]]:
    extra = [f"--worker\0--dir\0{folder}\0--strategy\0{strategy}\0--rank\0{r}"
             + (f"\0--save\0{save}" if save else "") for r in range(ranks)]  # fmt: skip
    return _run(*extra)


def commit_checkpoint(folder: Path, save: Path, strategy: str) -> None:
    from hspmd.checkpoint.store import commit
    from hspmd.models.module import load_model
    from hspmd.plan.params import ParamSpec, parameter_annotations
    from hspmd.plan.strategy import parse_strategy

    model = load_model(f"hf:{folder}")
    specs = {
        f"param/{n}": ParamSpec(f"param/{n}", s.shape, s.annotation)
        for n, s in parameter_annotations(parse_strategy(strategy), model).items()
    }
    commit(save, step=0, model=f"hf:{folder}", strategy=strategy, specs=specs,
           model_config=json.loads(model.hf_config))  # fmt: skip


def same_tensors(a: Path, b: Path) -> bool:
    """Every tensor of safetensors file ``a`` is in ``b``, bit for bit (one at a time)."""
    from safetensors import safe_open

    with safe_open(str(a), "pt") as left, safe_open(str(b), "pt") as right:
        names = set(left.keys())
        return names == set(right.keys()) and all(
            torch.equal(left.get_tensor(n).view(torch.int16), right.get_tensor(n).view(torch.int16))
            for n in names
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--strategy", default=None, help=f"default: {STRATEGY} (scaled)")
    parser.add_argument("--keep", default=None, help="write the folders here and keep them")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--export-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.export_worker:
        return export_worker(args)
    half = args.layers // 2
    strategy = args.strategy or f"1x2: R0-1:L0-{half - 1} R2-3:L{half}-{args.layers - 1}"
    root = Path(args.keep or tempfile.mkdtemp(prefix="hspmd-weights-"))
    try:
        run(args, root, strategy)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, root: Path, strategy: str) -> None:
    config = llama_config(args)
    params = sum(torch.Size(s).numel() for _, s in shapes(config))
    folder, bare, save, out = (
        root / "llama",
        root / "llama-config-only",
        root / "ckpt",
        root / "out",
    )
    write_s = write_model(folder, config)
    bare.mkdir(exist_ok=True)
    shutil.copy(folder / "config.json", bare / "config.json")
    ranks = 4
    loaded = load_all(folder, strategy, ranks, save)
    commit_checkpoint(folder, save, strategy)
    init = load_all(bare, strategy, ranks, None)
    (exported,) = _run(f"--export-worker\0--save\0{save}\0--out\0{out}")
    exact = same_tensors(folder / "model.safetensors", out / "model.safetensors")
    size = (folder / "model.safetensors").stat().st_size / 2**30
    table = Table(title=f"Llama {params / 1e9:.2f}B, bf16 file {size:.2f} GiB, 4 ranks: {strategy}")
    for column in ("path", "rank", "shard", "overhead", "peak", "ratio", "seconds"):
        table.add_column(column, justify="right")
    for label, rows in (("hf weights", loaded), ("seed init", init)):
        for row in rows:
            table.add_row(
                label, str(row["rank"]), f"{row['shard_mib']:.0f}", f"{row['overhead_mib']:.0f}",
                f"{row['peak_mib']:.0f}", f"{row['ratio']:.2f}", f"{row['slices_s']:.1f}",
            )  # fmt: skip
    table.add_row(
        "export", "", "", "", f"{exported['peak_mib']:.0f}", "", f"{exported['export_s']:.1f}"
    )
    table.caption = (
        "MiB; shard: the rank's fp32 slices; overhead: RSS at its first slice read; peak: "
        "ru_maxrss; ratio: (peak - overhead) / shard (goal <= 1.3); seconds: reading or "
        "computing the slices (export: the whole export)"
    )
    Console().print(table)
    print(f"write {write_s:.1f} s; export bit-equal to the source: {exact}")
    print(json.dumps({
        "benchmark": "weights", "params": params, "strategy": strategy, "ranks": ranks,
        "write_s": round(write_s, 2), "load": loaded, "init": init, "export": exported,
        "round_trip_exact": exact,
        "max_ratio_load": max(r["ratio"] for r in loaded),
        "max_ratio_init": max(r["ratio"] for r in init),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
