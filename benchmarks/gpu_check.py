"""The GPU check: hspmd on one CUDA device, in one run of at most 8 minutes.

    PYTHONPATH=src python3 benchmarks/gpu_check.py --out DIR       # on a machine with a GPU
    .venv/bin/python benchmarks/gpu_check.py --out DIR --cpu-dry-run  # the same, tiny, on CPU

Eight parts, each in its own process with its own time limit, all within ``--budget-s``
(460 s; one that fails or runs out of time is recorded with its error and the last lines
it printed, and the next one runs):

a. ``profile``: ``hspmd profile --dtype bf16 --nproc 1`` on the GPU (Llama-shaped matmuls,
   attention, norms, element-wise ops, Adam; no links: one GPU) -> ``DIR/profile-bf16.json``,
   and per sample the achieved TFLOP/s or GB/s.
b. ``equal``: a 1-rank ``hspmd train`` of llama-tiny in fp32 on the GPU (nccl, world size 1)
   for 3 steps against the reference on CPU: losses and final weights within fp32
   tolerances (``hspmd.train.compare``; TF32 off); the reference on the GPU against the
   one on CPU; then one launch on the GPU of bf16 + ZeRO-1, a switch under the
   mixed-length mode's home layout, and a checkpoint saved and resumed, traced (each
   against the CPU reference).
c. ``shapes``: 2 layers of Llama-2-7B's shapes (hidden 4096, 32 heads, intermediate 11008,
   vocabulary 32000) in bf16 with fp32 masters and Adam, sequence 4096, 4 micro-batches of
   1, on one rank: the median step time of the last steps and the rank's
   ``torch.cuda.max_memory_allocated`` against ``hspmd simulate`` with the profile of (a)
   on a one-H200 cluster file (``DIR/cluster-h200.json``) and the planner's memory model.
d. ``activations``: what one Llama block keeps for its backward on the device (bf16),
   per token, against the memory model's ``LlamaCost.token_bytes``: each tensor autograd saves
   (listed; views of one storage once), and ``torch.cuda.memory_allocated``'s growth over
   a second block chained to the first (the first call also allocates one-time workspace);
   Llama-2-7B's block and Llama-3-70B's (grouped-query attention), 4096 tokens.
e. ``zero3``: ZeRO-3 (prefetch on and off, with recompute), ZeRO-2 and bf16 ZeRO-3 on one
   nccl rank against the CPU reference, fp32, TF32 off (``gpu_check_zero``; it says why one
   rank: one GPU holds one nccl rank).
f. ``zero_memory``: ZeRO 0 and 3 on one rank, 0.54 B parameters in fp32 at 1024 tokens: the
   rank's ``max_memory_allocated`` and its training state's tracked bytes against the memory
   model (the figures ``benchmarks/zero.py`` reports on CPU).
g. ``hf_llama``: transformers' ``LlamaForCausalLM`` from a ``LlamaConfig`` (4 layers of
   hidden 2048, GQA 32/4 heads, vocabulary 32000; bf16, SDPA) captured and trained by hspmd
   on one rank against the same module in plain eager PyTorch (same weights, fp32 masters
   and AdamW, same batch of 4 x 2048 tokens), ABAB rounds: hspmd's step over eager's
   (``gpu_check_hf``).
h. ``zero_cpu``: ``benchmarks/zero.py --rounds 2`` on the machine's CPU cores (4 gloo ranks of
   one torch thread: no oversubscription on 16 cores; CUDA hidden from it): its table and
   JSON line, with the load average around it.

The budget, in seconds (a part's limit; what it is expected to take on one H100 or H200
with 16 cores, estimated, not yet measured for (e)-(h) nor since (a)-(d) last ran)::

    a profile      55   the profile took 11-16 s on an H200, plus imports
    b equal        70   a CPU reference, 2 launches, the GPU reference: ~40
    c shapes       70   0.67 B parameters set up, 6 steps of ~0.14 s, simulate: ~35
    d activations  30   two blocks: ~10
    e zero3        45   a CPU reference, one launch of 5 tiny runs: ~20
    f zero_memory  55   2 launches, 4 steps each of ~0.2 s, 0.54 B parameters each: ~30
    g hf_llama     55   a launch, capture, 44 steps of ~50 ms: ~30
    h zero_cpu     80   2 launches of 4 ranks, 18 metered + 84 timed steps: ~45
                  ---
                  460   the set-up before (a) counts in it; a part that runs out of time
                        takes at most 11 s more to stop (a part after it may get as much
                        less): at most 471 s, under 8 minutes

A part may use what the parts before it left unused, never the limits of the parts after
it (``part_limit``). ``--budget-s`` below 460 cuts the last parts first.

Writes ``DIR/gpu_check.json`` (every part's figures or error, the environment, the wall
time). ``--cpu-dry-run`` runs every part on CPU processes (gloo) at toy sizes: it checks
the plumbing here, not the GPU (tests/test_gpu_check.py runs (a), (c) and (g) so). Needs no
PuLP or HiGHS (nothing here solves an ILP). Parts (e)-(h) have not run on a GPU yet.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
if str(SRC) not in sys.path:  # a checkout without `pip install`: hspmd from src/
    sys.path.insert(0, str(SRC))

PARTS = ("profile", "equal", "shapes", "activations", "zero3", "zero_memory", "hf_llama",
         "zero_cpu")  # fmt: skip


def _docs_text() -> str:
    """The training text: this checkout's docs (``docs/*.md``, about 600 KB), whatever the
    Python, in one file (``docs/`` also holds pictures, which a ``--data`` folder refuses)."""
    path = Path(tempfile.gettempdir()) / f"hspmd-gpu-check-docs-{os.getuid()}.md"
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    if not path.exists() or path.read_text() != text:  # parts run in processes side by side
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(text)
        os.replace(partial, path)
    return str(path)


DATA = _docs_text()
LIMIT_S = {"profile": 55, "equal": 70, "shapes": 70, "activations": 30, "zero3": 45,
           "zero_memory": 55, "hf_llama": 55, "zero_cpu": 80}  # per part (GPU): sum 460  # fmt: skip
BUDGET_S = 460  # the whole check (the module docstring's arithmetic)
NO_TF32 = ("equal", "zero3")  # parts whose processes run fp32 matmuls without TF32
GIB = 2**30

# (c): 2 layers of Llama-2-7B (no grouped-query attention, so SDPA's flash kernel runs)
SHAPES = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_layers": 2,
    "num_heads": 32, "num_kv_heads": 32, "max_seq_len": 4096,
}  # fmt: skip
SHAPES_DRY = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 176, "num_layers": 2,
    "num_heads": 4, "num_kv_heads": 4, "max_seq_len": 64,
}  # fmt: skip
SHAPES_STRATEGY = "4x1: R0:L0-1"  # 4 micro-batches of 1 sequence, one rank, both layers
SHAPES_STEPS = 6  # the step time: median of the steps after the first two


# -- the parent: run each part in a process of its own ----------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the JSON files")
    parser.add_argument("--cpu-dry-run", action="store_true", help="toy sizes on CPU (gloo)")
    parser.add_argument("--parts", default=",".join(PARTS), help="which parts, comma separated")
    parser.add_argument(
        "--budget-s", type=float, default=BUDGET_S, help="seconds for the whole check (GPU)"
    )
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # a child's part
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)  # its JSON
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part is not None:
        return _child(args.part, out, Path(args.result), dry=args.cpu_dry_run)
    begin = time.perf_counter()
    report: dict[str, Any] = {"dry_run": args.cpu_dry_run, "parts": {}}
    report["env"] = _environment()
    print(f"gpu check: {json.dumps(report['env'])}", flush=True)
    if not args.cpu_dry_run and not report["env"].get("cuda"):
        report["error"] = "torch sees no CUDA device: nothing to check (--cpu-dry-run for CPU)"
        print(f"gpu check: {report['error']}", flush=True)
    else:
        scale = 3 if args.cpu_dry_run else 1  # a loaded 2-core machine is slow
        names = [p for p in args.parts.split(",") if p]
        unknown = [n for n in names if n not in LIMIT_S]
        if unknown:
            parser.error(f"--parts: unknown {', '.join(unknown)}; choose among {', '.join(PARTS)}")
        for i, name in enumerate(names):
            left = args.budget_s * scale - (time.perf_counter() - begin)
            limit = part_limit(name, names[i + 1 :], left=left, scale=scale)
            if limit < 10:
                report["parts"][name] = {"error": f"skipped: {left:.0f} s of the budget left"}
                print(f"== part {name}: skipped, the budget is spent", flush=True)
                continue
            report["parts"][name] = _run_part(name, out, dry=args.cpu_dry_run, limit=limit)
            _write(out / "gpu_check.json", report)
    report["total_seconds"] = round(time.perf_counter() - begin, 1)
    _write(out / "gpu_check.json", report)
    failed = [n for n, p in report["parts"].items() if p.get("error")]
    print(
        f"gpu check: done in {report['total_seconds']} s; parts failed: {failed or 'none'}; "
        f"wrote {out / 'gpu_check.json'}",
        flush=True,
    )
    return 1 if failed or "error" in report else 0


def part_limit(name: str, later: list[str], *, left: float, scale: float = 1) -> float:
    """Seconds for part ``name`` with ``left`` of the budget: its own limit plus what the
    parts before it left unused, never the limits of the ``later`` parts (first come,
    first served where the budget is below the limits' sum).

    >>> part_limit("zero3", ["zero_cpu"], left=200), part_limit("zero3", [], left=30)
    (120, 30)
    """
    own = LIMIT_S[name] * scale
    return min(left, max(own, left - sum(LIMIT_S[n] * scale for n in later)))


def _environment() -> dict[str, Any]:
    env: dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.cuda.is_available()
        if env["cuda"]:
            env["gpus"] = torch.cuda.device_count()
            env["device"] = torch.cuda.get_device_name()
            free, total = torch.cuda.mem_get_info()
            env["memory_mib"] = total // 2**20
        env["cpus"] = os.cpu_count()
    except Exception as error:  # noqa: BLE001 - recorded, the parts say more
        env["error"] = f"{type(error).__name__}: {error}"
    return env


def _run_part(name: str, out: Path, *, dry: bool, limit: float) -> dict[str, Any]:
    """Run part ``name`` in a child process (its own session, killed whole after ``limit``
    seconds), echoing its lines; its JSON result, or the error and its last lines."""
    print(f"== part {name} (limit {limit:.0f} s)", flush=True)
    fd, result = tempfile.mkstemp(prefix=f"gpu-check-{name}-", suffix=".json")
    os.close(fd)
    command = [sys.executable, str(Path(__file__).resolve()), "--out", str(out),
               "--part", name, "--result", result, *(["--cpu-dry-run"] if dry else [])]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    if name in NO_TF32:
        env["NVIDIA_TF32_OVERRIDE"] = "0"  # no TF32 in cuBLAS / cuDNN, in every process
    begin = time.perf_counter()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    tail: deque[str] = deque(maxlen=30)
    reader = threading.Thread(target=_echo, args=(proc, name, tail), daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill(proc)
    reader.join(5.0)
    seconds = round(time.perf_counter() - begin, 1)
    data: dict[str, Any] = {}
    try:
        text = Path(result).read_text()
        data = json.loads(text) if text.strip() else {}
    except (OSError, json.JSONDecodeError):
        pass
    finally:
        Path(result).unlink(missing_ok=True)
    data["seconds"] = seconds
    if timed_out:
        data["error"] = f"timed out after {limit:.0f} s (killed); last lines: " + " | ".join(tail)
    elif proc.returncode != 0 and not data.get("error"):
        data["error"] = f"exit code {proc.returncode}; last lines: " + " | ".join(tail)
    print(f"== part {name}: {'FAILED' if data.get('error') else 'ok'} in {seconds} s", flush=True)
    return data


def _echo(proc: subprocess.Popen[str], name: str, tail: deque[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        tail.append(line)
        print(f"[{name}] {line}", flush=True)


def _kill(proc: subprocess.Popen[str]) -> None:
    """The part's whole session: its process, the launcher's forkserver and the ranks."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=3.0)
            return
        except subprocess.TimeoutExpired:
            continue


def _write(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


# -- a child: one part --------------------------------------------------------------------------


def _child(name: str, out: Path, result: Path, *, dry: bool) -> int:
    data: dict[str, Any] = {}
    try:
        _part(name)(data, out, dry=dry)
    except Exception as error:  # noqa: BLE001 - recorded; the parent goes on
        data["error"] = f"{type(error).__name__}: {error}"
        traceback.print_exc()
    result.write_text(json.dumps(data, default=str))
    return 1 if data.get("error") else 0


def _part(name: str) -> Callable[..., None]:
    """The function of part ``name``: (a)-(d) here, (e)-(h) in gpu_check_zero and
    gpu_check_hf beside this file."""
    import gpu_check_hf
    import gpu_check_zero

    here = {"profile": part_profile, "equal": part_equal, "shapes": part_shapes,
            "activations": part_activations}  # fmt: skip
    beside = {"zero3": gpu_check_zero.part_zero3, "zero_memory": gpu_check_zero.part_zero_memory,
              "hf_llama": gpu_check_hf.part_hf_llama, "zero_cpu": gpu_check_zero.part_zero_cpu}  # fmt: skip
    return {**here, **beside}[name]


def _step(data: dict[str, Any], key: str, fn: Callable[[], Any]) -> Any:
    """``data[key] = fn()``, or its error text (printed) if it raises; returns the value."""
    try:
        value = fn()
    except Exception as error:  # noqa: BLE001 - one failed check does not end the part
        data[key] = {"error": f"{type(error).__name__}: {error}"}
        print(f"{key}: FAILED: {type(error).__name__}: {error}", flush=True)
        traceback.print_exc()
        return None
    data[key] = value
    return value


# (a) ---------------------------------------------------------------------------------------------


def part_profile(data: dict[str, Any], out: Path, *, dry: bool) -> None:
    from hspmd.cli import main as hspmd
    from hspmd.cost import measure
    from hspmd.cost.profile import load_profile

    path = out / "profile-bf16.json"
    argv = ["profile", "--dtype", "bf16", "--nproc", "1", "--out", str(path)]
    if dry:  # CPU: the quick sizes, no core-sharing processes, one operand set per matmul
        argv.append("--quick")  # (cold operands cost 256 bf16 forward graphs per shape)
        measure.measure_core_sharing = lambda most, **_: tuple(1.0 for _ in range(most))
        measure.COLD_BYTES = 0
    begin = time.perf_counter()
    status = hspmd(argv)
    data["profile_seconds"] = round(time.perf_counter() - begin, 1)
    if status != 0:
        raise RuntimeError(f"hspmd profile exited with status {status}")
    profile = load_profile(path)
    data["path"] = str(path)
    data["device"], data["dtype"] = profile.device, profile.dtype
    data["collectives"] = profile.host.get("collectives")
    data["fits"] = {op: dataclasses.asdict(f) for op, f in profile.compute.items()}
    cuda = profile.kind == "cuda"
    sizes = (measure.CUDA_SIZES if cuda else measure.SIZES)["bf16", bool(profile.host["quick"])]
    data["achieved"] = achieved = _achieved(profile.samples, sizes)
    for line in achieved:
        print(line["text"], flush=True)


def _achieved(samples: Any, sizes: Any) -> list[dict[str, Any]]:
    """Per sample: its shape (from the sizes' order) and the rate reached."""
    shapes = [(n, n, n) for n in sizes.matmul]
    if sizes.skinny is None:
        half = sizes.matmul[: len(sizes.matmul) // 2 + 1]
        shapes += [(4 * n, n, max(n // 4, 16)) for n in half] + [(n // 2, n, 3 * n) for n in half]
    else:
        shapes += list(sizes.skinny)
    what: dict[str, list[str]] = {
        "matmul": [f"(M,K,N)={s} {d}" for s in shapes for d in ("fwd", "bwd")],
        "attention": [
            f"S={s} {sizes.heads}x{sizes.head_dim} {d}"
            for s in sizes.attention
            for d in ("fwd", "bwd")
        ],  # fmt: skip
        "norm": [f"rows={r} x {sizes.hidden} {d}" for r in sizes.norm for d in ("fwd", "bwd")],
        "elementwise": [f"n={n} {op}" for n in sizes.elementwise for op in ("silu*mul", "add")],
        "optimizer": [f"{n} params" for n in sizes.optimizer],
    }
    out, seen = [], {op: 0 for op in what}
    for s in samples:
        if s.op not in what:
            continue
        label = what[s.op][seen[s.op]] if seen[s.op] < len(what[s.op]) else "?"
        seen[s.op] += 1
        flops = s.op in ("matmul", "attention")
        rate = s.units / s.seconds / (1e12 if flops else 1e9)
        unit = "TFLOP/s" if flops else "GB/s"
        text = f"{s.op:<12} {label:<40} {s.seconds * 1e3:9.3f} ms {rate:10.3f} {unit}"
        out.append({"op": s.op, "what": label, "seconds": s.seconds, "rate": rate,
                    "unit": unit, "text": text})  # fmt: skip
    return out


# (b) ---------------------------------------------------------------------------------------------


def part_equal(data: dict[str, Any], _out: Path, *, dry: bool) -> None:
    import torch

    from hspmd.train.api import revise, train_config
    from hspmd.train.config import AdamConfig
    from hspmd.train.reference import run_reference
    from hspmd.train.trainer import train, train_many

    data["tf32_defaults"] = _tf32(torch)
    if torch.cuda.is_available():  # this process's reference on the GPU; the ranks get
        torch.backends.cuda.matmul.allow_tf32 = False  # NVIDIA_TF32_OVERRIDE=0 (parent)
        torch.backends.cudnn.allow_tf32 = False
    device = "cpu" if dry else "cuda"
    base = train_config(
        model="llama-tiny", strategy="2x1: R0:L0-3", global_batch=2, seq_len=64, steps=3,
        seed=0, adam=AdamConfig(lr=1e-3), data=DATA, device=device,
    )  # fmt: skip
    cpu_ref = run_reference(revise(base, device="cpu"))
    data["cpu_reference_losses"] = list(cpu_ref.losses)

    on = "CPU (gloo: dry run)" if dry else "the GPU (nccl)"

    def gpu_vs_cpu() -> dict[str, Any]:
        result = train(base)
        return _verdict(f"1 rank on {on} vs the reference on CPU", result, cpu_ref)

    def reference_vs_cpu() -> dict[str, Any]:
        result = run_reference(revise(base, device=device))
        return _verdict(f"the reference on {on.split(' (')[0]} vs on CPU", result, cpu_ref)

    _step(data, "train_vs_reference", gpu_vs_cpu)
    _step(data, "reference_device_vs_cpu", reference_vs_cpu)

    def more_paths() -> dict[str, Any]:
        """bf16 + ZeRO-1; a switch under the home layout; a save, then a resume: one launch."""
        save = tempfile.mkdtemp(prefix="gpu-check-ckpt-")
        configs = [
            revise(base, dtype="bf16", zero=1),
            revise(base, switch_mode="weights", switches=((2, "1x2: R0:L0-3"),)),
            revise(base, steps=2, save=save),
            revise(base, resume=save),
        ]
        results = train_many(configs, trace=True)
        bf16, switched, saved, resumed = results
        bf16_rel = max(
            abs(a - b) / abs(b) for a, b in zip(bf16.losses, cpu_ref.losses, strict=True)
        )
        print(f"bf16 + ZeRO-1: losses {list(bf16.losses)}, max relative difference to the "
              f"fp32 reference {bf16_rel:.1e} (bf16: within 2e-2 passes)", flush=True)  # fmt: skip
        checks = {
            "bf16_zero1": {"ok": bf16_rel < 2e-2, "losses": list(bf16.losses),
                           "max_loss_rel": bf16_rel, "peak_memory": dict(bf16.peak_memory)},
            "switch_weights_mode": _verdict("switch under the home layout", switched, cpu_ref),
            "saved": {"ok": _close(saved.losses, cpu_ref.losses[:2]),
                      "losses": list(saved.losses)},
            "resumed": _verdict("saved after step 2, resumed to 3", resumed, cpu_ref, last=True),
            "trace_events": len((bf16.trace or {}).get("traceEvents", [])),
        }  # fmt: skip
        checks["ok"] = all(c["ok"] for c in checks.values() if isinstance(c, dict))
        return checks

    _step(data, "more_paths", more_paths)
    bad = [k for k, v in data.items() if isinstance(v, dict) and (v.get("error") or v.get("ok") is False)]  # fmt: skip
    if bad:
        data["error"] = f"checks failed: {', '.join(bad)}"


def _tf32(torch: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, read in (
        ("cuda.matmul.allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
        ("cudnn.allow_tf32", lambda: torch.backends.cudnn.allow_tf32),
        ("float32_matmul_precision", torch.get_float32_matmul_precision),
    ):
        try:
            out[name] = read()
        except Exception as error:  # noqa: BLE001 - a flag renamed in some version
            out[name] = f"unreadable: {error}"
    return out


def _close(a: Any, b: Any, rtol: float = 1e-5) -> bool:
    return all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b, strict=True))


def _verdict(what: str, result: Any, reference: Any, *, last: bool = False) -> dict[str, Any]:
    """``compare`` of a run with the reference (``last``: the run's records are the last
    steps only, as a resume gives)."""
    from hspmd.train.compare import compare
    from hspmd.train.reference import TrainResult

    if last:
        n = len(result.records)
        reference = TrainResult(records=reference.records[-n:], params=reference.params)
    report = compare(result, reference)
    text = f"{what}: {report}"
    print(text, flush=True)
    return {
        "ok": report.ok, "max_loss_rel": report.max_loss_rel,
        "max_param_rel": report.max_param_rel, "worst_param": report.worst_param,
        "losses": list(result.losses), "reference_losses": list(reference.losses), "text": text,
    }  # fmt: skip


# (c) ---------------------------------------------------------------------------------------------


def part_shapes(data: dict[str, Any], out: Path, *, dry: bool) -> None:
    from hspmd.plan.strategy import StrategyOptions, parse_strategy
    from hspmd.planner.memory import OVERHEAD_BYTES, strategy_memory
    from hspmd.train.api import train_config
    from hspmd.train.trainer import train

    shapes = SHAPES_DRY if dry else SHAPES
    seq_len = shapes["max_seq_len"]
    config = train_config(
        model="llama-tiny", model_kwargs=tuple(sorted(shapes.items())),
        strategy=SHAPES_STRATEGY, global_batch=4, seq_len=seq_len, steps=SHAPES_STEPS,
        dtype="bf16", device="cpu" if dry else "cuda", data=DATA,
    )  # fmt: skip
    model = config.model_config()
    data["model"] = dict(shapes)
    data["parameters"] = sum(_numel(s) for s in model.parameter_shapes().values())
    data["run"] = {"strategy": SHAPES_STRATEGY, "seq_len": seq_len, "dtype": "bf16",
                   "micro_batches": 4, "micro_batch_size": 1, "steps": SHAPES_STEPS}  # fmt: skip
    print(f"model: {shapes}, {data['parameters'] / 1e9:.3f} B parameters", flush=True)
    begin = time.perf_counter()
    result = train(config)
    data["wall_seconds"] = round(time.perf_counter() - begin, 1)
    seconds = [r.seconds for r in result.records]
    measured_step = statistics.median(seconds[2:])
    peak = result.peak_memory.get(0)
    data["measured"] = {"step_seconds": seconds, "median_step_s": measured_step,
                        "losses": list(result.losses), "max_memory_allocated": peak}  # fmt: skip
    print(f"measured: steps {[round(s, 4) for s in seconds]} s, median of steps 3-"
          f"{len(seconds)} {measured_step:.4f} s, max_memory_allocated "
          f"{_gib(peak)}", flush=True)  # fmt: skip
    options = StrategyOptions(dtype="bf16")
    memory = strategy_memory(parse_strategy(SHAPES_STRATEGY), model, seq_len=seq_len, options=options)[0]  # fmt: skip
    parts = {k: getattr(memory, k) for k in ("weights", "gradients", "optimizer", "activations",
                                              "logits", "overhead")}  # fmt: skip
    data["memory_model"] = {**parts, "peak": memory.peak, "peak_without_overhead": memory.peak - OVERHEAD_BYTES}  # fmt: skip
    predicted = _step(data, "simulate", lambda: _simulate(out, config, shapes, seq_len))
    lines = []
    if predicted is not None and "step_time_s" in predicted:
        ratio = predicted["step_time_s"] / measured_step
        lines.append(f"step time: predicted {predicted['step_time_s']:.4f} s (hspmd simulate, "
                     f"{predicted['costs']}), measured {measured_step:.4f} s: "
                     f"predicted/measured {ratio:.3f}")  # fmt: skip
        data["step_time_ratio"] = ratio
    if peak:
        model_peak = memory.peak - OVERHEAD_BYTES
        lines.append(f"peak memory: memory model {_gib(model_peak)} without its "
                     f"{_gib(OVERHEAD_BYTES)} overhead ({_gib(memory.peak)} with it), measured "
                     f"max_memory_allocated {_gib(peak)}: predicted/measured "
                     f"{model_peak / peak:.3f} ({memory.peak / peak:.3f} with the overhead)")  # fmt: skip
        lines.append("memory model parts: " + ", ".join(f"{k} {_gib(v)}" for k, v in parts.items()))
        data["memory_ratio"] = model_peak / peak
    for line in lines:
        print(line, flush=True)
    data["summary"] = lines


def _simulate(out: Path, config: Any, shapes: dict[str, int], seq_len: int) -> dict[str, Any]:
    """``hspmd simulate --json`` of the run on a one-H200 cluster file naming the profile of
    part (a) (assumed figures when it is missing)."""
    profile = out / "profile-bf16.json"
    kind: dict[str, Any] = {
        "memory_mb": round(143771 * 2**20 / 1e6),  # 143771 MiB (nvidia-smi) in MB
        "bf16_tflops": 989, "intra_link": {"name": "nvlink", "GBps": 450},
    }  # fmt: skip
    if profile.is_file():
        kind["profile"] = profile.name  # relative to the cluster file
    else:
        kind["hbm_GBps"] = 4800
    cluster = {
        "format": "hspmd.cluster/1", "name": "h200x1",
        "description": "one H200 (the GPU check's machine)",
        "gpu_kinds": {"H200": kind}, "inter_link": {"name": "ib", "GBps": 50},
        "nodes": [{"kind": "H200", "count": 1, "gpus_per_node": 1}],
        "assumed": {"bf16_tflops": "NVIDIA's dense bf16 peak of an H200 SXM",
                    "intra_link.GBps": "unused: one GPU",
                    "inter_link.GBps": "unused: one node"},
    }  # fmt: skip
    path = out / "cluster-h200.json"
    _write(path, cluster)
    argv = [sys.executable, "-m", "hspmd", "simulate", "--model", "llama-tiny", "--config",
            json.dumps(shapes), "--cluster", str(path), "--seq-len", str(seq_len),
            "--dtype", "bf16", "--strategy", SHAPES_STRATEGY, "--json"]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    if done.returncode not in (0, 1):  # 1: does not fit (still a prediction)
        raise RuntimeError(f"hspmd simulate exited {done.returncode}: {done.stderr.strip()}")
    prediction = json.loads(done.stdout)
    rank = prediction["ranks"]["0"]
    costs = f"profile {profile.name}" if profile.is_file() else "assumed figures: no profile"
    return {"step_time_s": prediction["step_time_s"], "peak_memory": rank["peak_memory"],
            "fits": prediction["fits"], "time_by_category": prediction["time_by_category"],
            "costs": costs}  # fmt: skip


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f} GiB"


# (d): one block of each, bf16, 4096 tokens (toy sizes in the dry run)
BLOCKS = {
    "llama-2-7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_heads": 32,
                   "num_kv_heads": 32},
    "llama-3-70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_heads": 64,
                    "num_kv_heads": 8},
}  # fmt: skip
BLOCKS_DRY = {
    "toy": {"hidden_size": 64, "intermediate_size": 176, "num_heads": 4, "num_kv_heads": 2}
}


def _saved_storages(fn: Callable[[], Any]) -> tuple[Any, dict[int, tuple[int, str]]]:
    """``fn()`` under saved-tensor hooks: its result, and per storage autograd keeps for the
    backward its bytes and the first saved view's shape, dtype and strides (views of one
    storage are counted once, as the allocator counts them)."""
    import torch

    storages: dict[int, tuple[int, str]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in storages:
            shape = "x".join(map(str, t.shape))
            stride = ",".join(map(str, t.stride()))
            storages[s.data_ptr()] = (s.nbytes(), f"{shape} {t.dtype} strides {stride}")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, storages


def part_activations(data: dict[str, Any], out: Path, *, dry: bool) -> None:
    """What one block keeps, measured by the allocator and by autograd's saved tensors,
    against the memory model. The allocator's figure includes the block's output: the next
    block's norm keeps it, as this block's norm keeps its input (allocated before)."""
    import torch

    from hspmd.models.config import get_config
    from hspmd.models.llama import Block, rope_tables
    from hspmd.models.llama_cost import LlamaCost

    device = torch.device("cpu" if dry else "cuda")
    tokens = 64 if dry else 4096
    for name, fields in (BLOCKS_DRY if dry else BLOCKS).items():
        config = get_config("llama-tiny", max_seq_len=tokens, num_layers=1, **fields)
        block = Block(config, 0).to(device=device, dtype=torch.bfloat16)
        cos, sin = (t[:tokens].to(device=device, dtype=torch.bfloat16) for t in rope_tables(config))
        x = torch.randn(1, tokens, config.hidden_size, device=device, dtype=torch.bfloat16,
                        requires_grad=True)  # fmt: skip
        formula = LlamaCost(config).token_bytes(1, elt=2, sequence_parallel=False)
        if not dry:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
        y, storages = _saved_storages(functools.partial(block, x, cos, sin))
        params = {p.untyped_storage().data_ptr() for p in block.parameters()}
        params |= {t.untyped_storage().data_ptr() for t in (cos, sin)}
        saved = {k: v for k, v in storages.items() if k not in params}
        saved_per_token = sum(b for b, _ in saved.values()) / tokens
        for nbytes, what in sorted(saved.values(), reverse=True):
            print(f"  saved: {nbytes / tokens:9.1f} bytes a token  {what}")
        entry = {"formula_bytes_per_token": formula, "saved_bytes_per_token": saved_per_token,
                 "formula_over_saved": formula / saved_per_token}  # fmt: skip
        line = (f"{name}: autograd keeps {saved_per_token:.0f} bytes a token (input included), "
                f"memory model {formula:.0f}: model/saved {formula / saved_per_token:.3f}")  # fmt: skip
        if not dry:
            torch.cuda.synchronize()
            first = torch.cuda.memory_allocated()
            z = block(y, cos, sin)  # a second block in a chain: one-time caches counted once
            torch.cuda.synchronize()
            measured = (torch.cuda.memory_allocated() - first) / tokens
            print(
                f"  allocator: first call {(first - before) / tokens:.0f} bytes a token, "
                f"second {measured:.0f}"
            )
            del z
            entry |= {
                "measured_bytes_per_token": measured,
                "formula_over_measured": formula / measured,
            }
            line += (f"; allocator {measured:.0f} (output included, input not): "
                     f"model/measured {formula / measured:.3f}")  # fmt: skip
        data[name] = entry
        print(line, flush=True)
        del y, block, x
        if not dry:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
