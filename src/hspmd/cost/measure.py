"""Timing of operator families on the machine at hand (torch); units as in hspmd.cost.profile.

Each sample is the median of several timed repetitions after one warm-up;
``profile_machine`` takes them all and fits one line per family (``fit_linear``)::

    family       sample                                   units
    matmul       F.linear fwd, bwd                        2*M*N*K FLOPs, bwd twice
    attention    causal SDPA fwd, bwd                     2*B*H*S*S*D FLOPs, bwd twice
    norm         x * rsqrt(mean(x^2) + eps) * w fwd, bwd  input bytes, bwd twice (x and dy)
    elementwise  silu(a) * b, a + b                       input bytes
    optimizer    torch.optim.Adam step, fp32 params       parameter bytes
    collectives  gloo over nproc local processes, each    bus bytes (profile.bus_bytes)
                 call between bits of compute
    core sharing k processes' MLP fwd+bwd+Adam at once    slowdown against one alone (CPU)

Compute runs with ``threads`` torch threads, the count each local rank gets (``cores //
nproc``, at least 1), so that a rank's compute is what was measured. The matmul family
also times the skinny ``(tokens, hidden) x (hidden, width)`` shapes a transformer layer
runs, and every line is fitted to relative error (``fit_linear(relative=True)``), so small
calls weigh as much as big ones.

Collectives run on ``nproc`` local gloo processes (``hspmd.runtime.launch``); a sample is
the slowest rank's mean time per call over rounds of (a little compute, the call), less
the compute: a collective as a step uses it (``time_collectives``). On a CUDA host they
run with nccl, one GPU per process (refused with fewer GPUs than ``nproc``); ``nproc=1``
measures no collectives (the profile's ``host["collectives"]`` says so).

Sizes (``Sizes``): ``SIZES`` for a CPU host are small (bf16 runs 100x slower than fp32 on
some CPUs); ``CUDA_SIZES`` for a GPU are Llama's: square matmuls of 1024-16384, the skinny
``(tokens, hidden) x (hidden, width)`` projections of Llama-3-8B and -70B (hidden 4096 and
8192, widths up to 28672, tokens 2048-16384, and their TP-8 slices), attention of 32 heads
of 128 over sequences of 1024-16384 (SDPA: flash in bf16), norms and element-wise ops up to
about 1e9 bytes, Adam up to 1e9 parameter bytes. About a minute on one H200 (``quick``: well
under 20 s), assuming its published bf16 rate; the first profile taken there will tell.
"""

from __future__ import annotations

import datetime
import itertools
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hspmd.cost.profile import (
    COLLECTIVE_OPS,
    COMPUTE_OPS,
    LinkFit,
    Profile,
    ProfileError,
    Sample,
    bus_bytes,
    fit_linear,
)
from hspmd.runtime.compat import all_gather_single, reduce_scatter_single
from hspmd.runtime.launch import NodeSpec, launch


def median_seconds(fn: Callable[[], object], reps: int, *, sync: bool = False) -> float:
    """Median wall time of ``fn`` over ``reps`` runs, after one warm-up run.

    ``sync``: wait for the CUDA device after each run (its kernels are asynchronous)."""
    wait = torch.cuda.synchronize if sync else _nothing
    fn()
    wait()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _nothing() -> None:
    return None


# A training step reads each weight once per micro-batch, after other work has evicted it
# from the caches: the matmul samples cycle through operand sets totalling this much (twice
# a large last-level cache), so each call reads cold operands. On this 2-core CPU a small
# layer's matmul runs 1.1-1.6x slower cold than hot.
COLD_BYTES = 64 << 20


def _cycle(calls: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs ``calls`` in turn, one per call."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def measure_matmul(
    sizes: Sequence[int], reps: int, dtype: torch.dtype = torch.float32, *, device: str = "cpu",
    skinny: Sequence[tuple[int, int, int]] | None = None,
) -> list[Sample]:  # fmt: skip
    """F.linear forward (``2*M*N*K`` FLOPs) and backward (twice that) on square sizes
    ``n``, and on skinny ``(4n, n) x (n, n/4)`` and ``(n/2, n) x (n, 3n)`` for the smaller
    half of them (activations times a projection, as a transformer layer runs); or, given
    ``skinny``, on those ``(M, K, N)``: ``(M, K) x (K, N)`` (tokens, hidden, width). Each
    call reads cold operands (``COLD_BYTES``)."""
    out, sync = [], device != "cpu"
    shapes = [(n, n, n) for n in sizes]
    if skinny is None:
        shapes += [(4 * n, n, max(n // 4, 16)) for n in sizes[: len(sizes) // 2 + 1]]
        shapes += [(n // 2, n, 3 * n) for n in sizes[: len(sizes) // 2 + 1]]
    else:
        shapes += list(skinny)
    itemsize = torch.empty((), dtype=dtype).element_size()
    for m, k, n in shapes:
        copies = max(1, min(256, -(-COLD_BYTES // ((m + n) * k * itemsize))))
        pairs = [
            (
                torch.randn(m, k, dtype=dtype, device=device, requires_grad=True),
                torch.randn(n, k, dtype=dtype, device=device, requires_grad=True),
            )
            for _ in range(copies)
        ]
        flops = 2.0 * m * n * k
        forward = _cycle([partial(F.linear, x, w) for x, w in pairs])
        out.append(Sample("matmul", flops, median_seconds(forward, reps, sync=sync)))
        grads = []
        for x, w in pairs:
            y = F.linear(x, w)
            grads.append(
                partial(torch.autograd.grad, y, (x, w), torch.ones_like(y), retain_graph=True)
            )
        backward = _cycle(grads)
        out.append(Sample("matmul", 2 * flops, median_seconds(backward, reps, sync=sync)))
    return out


def measure_attention(
    seq_lens: Sequence[int], reps: int, dtype: torch.dtype = torch.float32, *,
    heads: int = 4, head_dim: int = 64, device: str = "cpu",
) -> list[Sample]:  # fmt: skip
    """Causal ``F.scaled_dot_product_attention`` of one sequence, ``(1, heads, S, head_dim)``:
    forward ``2*B*H*S*S*D`` FLOPs, backward twice that."""
    out, sync = [], device != "cpu"
    for s in seq_lens:
        q, k, v = (
            torch.randn(1, heads, s, head_dim, dtype=dtype, device=device, requires_grad=True)
            for _ in range(3)
        )
        flops = 2.0 * heads * s * s * head_dim
        forward = partial(F.scaled_dot_product_attention, q, k, v, is_causal=True)
        out.append(Sample("attention", flops, median_seconds(forward, reps, sync=sync)))
        y = forward()
        backward = partial(torch.autograd.grad, y, (q, k, v), torch.ones_like(y), retain_graph=True)
        out.append(Sample("attention", 2 * flops, median_seconds(backward, reps, sync=sync)))
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * w`` over the last dim (the Llama norm, unfused)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def measure_norm(
    rows: Sequence[int], reps: int, dtype: torch.dtype = torch.float32, *,
    hidden: int = 1024, device: str = "cpu",
) -> list[Sample]:  # fmt: skip
    """``rms_norm`` of ``(rows, hidden)``: forward per input byte, backward (it reads x and
    the output's gradient) counted as twice the input bytes."""
    out, sync = [], device != "cpu"
    for n in rows:
        x = torch.randn(n, hidden, dtype=dtype, device=device, requires_grad=True)
        w = torch.ones(hidden, dtype=dtype, device=device, requires_grad=True)
        nbytes = float(x.numel() * x.element_size())
        forward = partial(rms_norm, x, w)
        out.append(Sample("norm", nbytes, median_seconds(forward, reps, sync=sync)))
        y = forward()
        backward = partial(torch.autograd.grad, y, (x, w), torch.ones_like(y), retain_graph=True)
        out.append(Sample("norm", 2 * nbytes, median_seconds(backward, reps, sync=sync)))
    return out


def measure_elementwise(
    sizes: Sequence[int], reps: int, dtype: torch.dtype = torch.float32, *, device: str = "cpu"
) -> list[Sample]:
    """silu(a) * b and a + b, per input byte."""
    out, sync = [], device != "cpu"
    for n in sizes:
        a = torch.randn(n, dtype=dtype, device=device)
        b = torch.randn(n, dtype=dtype, device=device)
        nbytes = 2.0 * n * a.element_size()
        silu_mul = partial(_silu_mul, a, b)
        out.append(Sample("elementwise", nbytes, median_seconds(silu_mul, reps, sync=sync)))
        add = partial(torch.add, a, b)
        out.append(Sample("elementwise", nbytes, median_seconds(add, reps, sync=sync)))
    return out


def _silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b


def measure_optimizer(sizes: Sequence[int], reps: int, *, device: str = "cpu") -> list[Sample]:
    """One ``torch.optim.Adam`` step over four fp32 parameters of ``n / 4`` elements each
    (gradients set), per parameter byte."""
    out = []
    for n in sizes:
        params = [torch.zeros(n // 4, device=device, requires_grad=True) for _ in range(4)]
        for p in params:
            p.grad = torch.randn_like(p)
        adam = torch.optim.Adam(params, lr=1e-4)
        nbytes = float(4 * (n // 4) * 4)
        seconds = median_seconds(adam.step, reps, sync=device != "cpu")
        out.append(Sample("optimizer", nbytes, seconds))
    return out


def _collective(
    op: str, nbytes: int, world: Any, members: Sequence[int], group: Any
) -> Callable[[], object]:
    """One call of ``op`` on ``nbytes`` (of the full tensor) over the ranks ``members``,
    fp32 (``group``: their process group, None for the whole world); other ranks do
    nothing."""
    if world.rank not in members:
        return _nothing
    n, index = len(members), list(members).index(world.rank)
    numel = max(n, nbytes // 4 // n * n)  # divisible by the group size
    full = torch.ones(numel, device=world.device)
    part = torch.ones(numel // n, device=world.device)
    if op == "all-reduce":
        return partial(dist.all_reduce, full, group=group)
    if op == "all-gather":
        return partial(all_gather_single, full, part, group=group)
    if op == "reduce-scatter":
        return partial(reduce_scatter_single, part, full, group=group)
    if op == "all-to-all":
        return partial(dist.all_to_all_single, torch.empty_like(full), full, group=group)
    assert op == "send-recv", op
    pair = index + 1 if index % 2 == 0 else index - 1  # members' pairs (0, 1), (2, 3)...
    if pair >= n:
        return _nothing  # the odd one out of an odd group
    return partial(dist.send if index % 2 == 0 else dist.recv, full, members[pair])


def _gap_work(device: torch.device) -> Callable[[], object]:
    """A little compute (two 128 x 256 x 256 matmuls, about 0.4 ms on one core): what a
    rank does between two TP collectives of a layer, so that each call is timed as used."""
    x, w = torch.randn(128, 256, device=device), torch.randn(256, 256, device=device)

    def gap() -> object:
        return (x @ w) @ w

    return gap


def time_collectives(
    world: Any, ops: Sequence[str], sizes: Sequence[int], reps: int,
    groups: Sequence[Sequence[int]], blocks: int = 1,
) -> list[tuple[str, int, int, float]]:  # fmt: skip
    """On every rank: (op, group size, nbytes, seconds per call) per op, group (its ranks;
    the others wait) and size: the median over ``blocks`` blocks of the slowest rank's mean.

    Each call is timed as a training step uses it, between bits of compute: ``reps``
    rounds of (gap compute, call) back to back, less the gap compute alone. On shared CPU
    cores this costs 2-4x a call timed after a barrier (the peer arrives later, a blocked
    process waits for a core to wake it), and the mean keeps the slow calls a median
    would drop. One block's mean still swings with a few slow wake-ups (the 4-rank
    all-reduce's fixed cost read 5.4-8.0 ms in four profiles a minute apart); the median
    of several blocks does not follow one unlucky block."""
    out = []
    wait = torch.cuda.synchronize if world.device.type == "cuda" else _nothing  # nccl: async
    for members in groups:
        n = len(members)
        group = None if n == world.world_size else dist.new_group(list(members))
        gap = _gap_work(world.device) if world.rank in members else _nothing
        for op in ops:
            for nbytes in sizes:
                call = _collective(op, nbytes, world, members, group)
                call()  # warm-up
                wait()
                start = time.perf_counter()
                for _ in range(reps):
                    gap()
                wait()
                gap_s = (time.perf_counter() - start) / reps
                means = []
                for _ in range(blocks):
                    dist.barrier()  # the rounds start together (the barrier is not timed)
                    wait()
                    start = time.perf_counter()
                    for _ in range(reps):
                        gap()
                        call()
                    wait()
                    per_call = (time.perf_counter() - start) / reps - gap_s
                    seconds = torch.tensor(
                        [max(per_call, 1e-6)], dtype=torch.float64, device=world.device
                    )
                    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
                    means.append(float(seconds))
                out.append((op, n, nbytes, statistics.median(means)))
    return out


def measure_collectives(
    sizes: Sequence[int], reps: int, *, nproc: int, ops: Sequence[str] = COLLECTIVE_OPS,
    groups: Sequence[int] = (), backend: str = "gloo",
) -> dict[int, list[Sample]]:  # fmt: skip
    """Every collective of ``ops`` over ``nproc`` local processes (``backend``: gloo on CPU
    tensors, nccl on one GPU each), and over the first ``n`` of them for each ``n`` of
    ``groups``, per bus byte: samples per group size."""
    if nproc < 2:
        raise ProfileError(f"nproc={nproc}: collectives need at least 2 processes")
    sizes_n = sorted({nproc, *(g for g in groups if 2 <= g < nproc)}, reverse=True)
    rounds = max(2 * reps, 12)  # means over rounds: the slow calls are part of the cost
    blocks = 3 if reps >= 5 else 1  # the full profile: the median of three blocks' means
    groups_n = [tuple(range(n)) for n in sizes_n]
    results = launch(
        time_collectives, nproc, args=(tuple(ops), tuple(sizes), rounds, groups_n, blocks),
        backend=backend,
    )  # fmt: skip
    return _by_group(results[0])


def _by_group(timings: Sequence[tuple[str, int, int, float]]) -> dict[int, list[Sample]]:
    """``time_collectives``'s timings as samples per bus byte, per group size."""
    out: dict[int, list[Sample]] = {}
    for op, n, nbytes, s in timings:
        out.setdefault(n, []).append(Sample(op, bus_bytes(op, nbytes, n), s))
    return out


def node_rings(num_nodes: int, per_node: int) -> tuple[tuple[int, ...], ...]:
    """The groups ``measure_across_nodes`` times: every rank (node-major ranks, so the ring
    leaves each node once per direction) and the first rank of each node (when that is
    another group). Each has one flow leaving a node at a time.

    >>> node_rings(2, 2), node_rings(3, 1)
    (((0, 1, 2, 3), (0, 2)), ((0, 1, 2),))
    """
    every = tuple(range(num_nodes * per_node))
    leaders = every[::per_node]
    return (every, leaders) if leaders != every else (every,)


def measure_across_nodes(
    node: NodeSpec, nproc: int, *, quick: bool, backend: str = "gloo"
) -> dict[int, list[Sample]]:
    """Every collective over rings that cross the nodes (``node_rings``), timed as
    ``measure_collectives`` times them, on this node's ``nproc`` ranks of a launch with one
    launcher per node: samples per group size (every node gets the same ones). A node
    that never joins ends it after 10 minutes (``LaunchError``)."""
    cuda = backend == "nccl"
    sizes = CUDA_SIZES["bf16", quick].collective if cuda else NODE_SIZES[quick]
    rounds, blocks = (6, 1) if quick else (12, 3)
    groups = node_rings(node.num_nodes, nproc)
    results = launch(
        time_collectives, nproc, node=node, backend=backend, timeout_s=600,
        args=(COLLECTIVE_OPS, sizes, rounds, groups, blocks),
    )  # fmt: skip
    return _by_group(results[0])


def link_fits(by_group: dict[int, list[Sample]]) -> dict[str, LinkFit]:
    """Per collective, the line of the largest group's samples, the smaller groups' beside
    it (``LinkFit``)."""
    largest = max(by_group)
    out = {}
    for op in COLLECTIVE_OPS:
        fits = {n: fit_linear(_points(s, op), relative=True) for n, s in by_group.items()}
        out[op] = LinkFit(
            fits[largest], largest, tuple((n, f) for n, f in fits.items() if n != largest)
        )
    return out


# One process of the core-sharing probe: a training step in miniature (an MLP block's
# forward and backward, then Adam over its weights: matmuls, element-wise ops and the
# optimizer's memory traffic, as a rank's step mixes them), looped inside a common window.
_SPIN = """
import sys, time, torch, torch.nn.functional as F
torch.set_num_threads(int(sys.argv[1]))
torch.manual_seed(0)
x = torch.randn(256, 256, requires_grad=True)
ws = [torch.randn(768, 256, requires_grad=True), torch.randn(768, 256, requires_grad=True),
      torch.randn(256, 768, requires_grad=True)]
adam = torch.optim.Adam(ws, lr=1e-6)
def step():
    y = F.linear(F.silu(F.linear(x, ws[0])) * F.linear(x, ws[1]), ws[2])
    (y * y).mean().backward()
    adam.step()
    adam.zero_grad()
for _ in range(3):
    step()
print("ready", flush=True)
for line in sys.stdin:  # one window per line: "begin end"
    begin, end = map(float, line.split())
    time.sleep(max(0.0, begin - time.time()))
    n, start = 0, time.perf_counter()
    while time.time() < end or n == 0:
        step()
        n += 1
    print((time.perf_counter() - start) / n, flush=True)
"""


def _sharing_windows(counts: Sequence[int], *, threads: int, window_s: float) -> list[float]:
    """Seconds per probe step for each ``k`` of ``counts``: the slowest of the first ``k``
    of ``max(counts)`` probe processes looping through one common window (all started,
    torch imported and warmed up before the first window)."""
    args = [sys.executable, "-c", _SPIN, str(threads)]
    procs = [
        subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(max(counts))
    ]
    try:
        if any(_readline(p) != "ready" for p in procs):
            raise ProfileError(f"the core-sharing probe did not start ({sys.executable} -c ...)")
        out = []
        for k in counts:
            begin = time.time() + 0.05
            for p in procs[:k]:  # every process gets the window before any is read
                _tell(p, f"{begin} {begin + window_s}\n")
            out.append(max(float(_readline(p)) for p in procs[:k]))
        return out
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _readline(proc: Any) -> str:
    return str(proc.stdout.readline()).strip()


def _tell(proc: Any, line: str) -> None:
    proc.stdin.write(line)
    proc.stdin.flush()


def measure_core_sharing(
    most: int, *, threads: int = 1, window_s: float = 1.0
) -> tuple[float, ...]:
    """How many times longer a rank's work takes while ``k`` processes of ``threads``
    threads work at once, ``k = 1..most``: a miniature training step (forward, backward
    and Adam of an MLP block) looped by ``k`` processes through one common window of
    ``window_s`` seconds, the slowest process's time per step against one process alone
    (the lower of two tries); never below the factor of ``k - 1``; the first is 1. The
    slowest, not the mean: the scheduler does not share the cores evenly (the slowest of
    4 processes on 2 cores ran 1.1-1.2x the mean), and ranks in lock-step wait for it."""
    counts = [1, 1, *range(2, most + 1)]
    seconds = _sharing_windows(counts, threads=threads, window_s=window_s)
    alone = min(seconds[:2])
    factors = [1.0]
    for k_seconds in seconds[2:]:
        factors.append(max(factors[-1], k_seconds / alone))
    return tuple(factors)


@dataclass(frozen=True, slots=True)
class Sizes:
    """What ``profile_machine`` measures: sizes per family and repetitions per sample."""

    matmul: tuple[int, ...]  # square M = N = K
    attention: tuple[int, ...]  # sequence lengths
    norm: tuple[int, ...]  # rows of ``hidden``
    elementwise: tuple[int, ...]  # elements
    optimizer: tuple[int, ...]  # fp32 parameter elements
    collective: tuple[int, ...]  # bytes of the full tensor
    reps: int
    # skinny matmuls (M, K, N); None: derived from the squares (measure_matmul)
    skinny: tuple[tuple[int, int, int], ...] | None = None
    heads: int = 4  # attention heads of one sequence
    head_dim: int = 64
    hidden: int = 1024  # the norm's width


KiB, MiB = 1 << 10, 1 << 20
# bf16 runs more than 100x slower than fp32 on some CPUs: its compute sizes stay tiny there.
SIZES = {
    ("fp32", False): Sizes((128, 256, 384, 512, 768, 1024, 1536), (128, 256, 512, 768, 1024,
                           1536), (256, 1024, 2048, 4096, 8192), (1 << 16, 1 << 20, 1 << 22,
                           1 << 23, 1 << 24), (1 << 18, 1 << 20, 1 << 22, 1 << 24),
                           (64 * KiB, 256 * KiB, MiB, 4 * MiB, 8 * MiB, 16 * MiB), reps=9),
    ("fp32", True): Sizes((128, 256, 384, 512), (128, 256, 512), (256, 1024, 2048),
                          (1 << 16, 1 << 20, 1 << 22), (1 << 18, 1 << 20, 1 << 22),
                          (64 * KiB, MiB, 4 * MiB), reps=3),
    ("bf16", False): Sizes((32, 64, 96, 128, 192), (32, 64, 128), (16, 64, 128),
                           (1 << 12, 1 << 14, 1 << 16), (1 << 18, 1 << 20, 1 << 22),
                           (64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB), reps=5,
                           heads=2, head_dim=32, hidden=256),
    ("bf16", True): Sizes((32, 64, 96), (32, 64), (16, 64), (1 << 12, 1 << 14),
                          (1 << 18, 1 << 20, 1 << 22), (64 * KiB, MiB, 4 * MiB), reps=3,
                          heads=2, head_dim=32, hidden=256),
}  # fmt: skip

# Llama projections (tokens, hidden, width): Llama-3-70B (hidden 8192: q/o 8192, k/v 1024,
# gate/up 28672, down back; gate/up and down under TP 8: 3584) and Llama-3-8B (hidden 4096:
# q/o 4096, k/v 1024, gate/up 14336, down back), at 2048-16384 tokens.
LLAMA_SKINNY = (
    (4096, 8192, 8192), (4096, 8192, 1024), (4096, 8192, 28672), (4096, 28672, 8192),
    (4096, 8192, 3584), (4096, 3584, 8192), (16384, 8192, 8192), (16384, 8192, 28672),
    (2048, 4096, 4096), (2048, 4096, 1024), (8192, 4096, 14336), (8192, 14336, 4096),
    (16384, 4096, 14336), (2048, 4096, 14336),
)  # fmt: skip
LLAMA_SKINNY_QUICK = ((4096, 8192, 1024), (4096, 8192, 28672), (8192, 14336, 4096))
LLAMA_ATTENTION = {"heads": 32, "head_dim": 128, "hidden": 8192}  # norms of Llama-70B's width
# One GPU (the CUDA device torch picks): Llama's shapes, up to ~1e9 bytes per sample (module
# docstring). fp32 runs without TF32 (torch's default for matmuls) at a tenth of bf16's
# rate: its sizes stop lower.
CUDA_SIZES = {
    ("bf16", False): Sizes((1024, 2048, 4096, 8192, 16384), (1024, 2048, 4096, 8192, 16384),
                           (1024, 4096, 16384, 65536), (1 << 20, 1 << 23, 1 << 26, 1 << 28),
                           (1 << 20, 1 << 23, 1 << 26, 1 << 28),
                           (MiB, 16 * MiB, 64 * MiB, 256 * MiB), reps=10,
                           skinny=LLAMA_SKINNY, **LLAMA_ATTENTION),
    ("bf16", True): Sizes((2048, 8192), (2048, 8192), (4096, 65536), (1 << 22, 1 << 28),
                          (1 << 22, 1 << 26), (MiB, 64 * MiB), reps=5,
                          skinny=LLAMA_SKINNY_QUICK, **LLAMA_ATTENTION),
    ("fp32", False): Sizes((1024, 2048, 4096, 8192), (1024, 2048, 4096, 8192),
                           (1024, 4096, 16384, 32768), (1 << 20, 1 << 23, 1 << 26, 1 << 27),
                           (1 << 20, 1 << 23, 1 << 26, 1 << 28),
                           (MiB, 16 * MiB, 64 * MiB, 256 * MiB), reps=6,
                           skinny=tuple(s for s in LLAMA_SKINNY if s[0] <= 4096),
                           **LLAMA_ATTENTION),
    ("fp32", True): Sizes((2048, 4096), (2048, 4096), (4096, 32768), (1 << 22, 1 << 27),
                          (1 << 22, 1 << 26), (MiB, 64 * MiB), reps=3,
                          skinny=LLAMA_SKINNY_QUICK[:1], **LLAMA_ATTENTION),
}  # fmt: skip
# Across nodes (bytes of the full tensor): a slow emulated link would take minutes over the
# loopback's sizes; a GPU cluster's inter-node links take the loopback sizes of a GPU.
NODE_SIZES = {False: (16 * KiB, 64 * KiB, 256 * KiB, MiB), True: (64 * KiB, MiB)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def profile_machine(
    *, quick: bool, nproc: int = 2, dtype: str = "fp32", threads: int | None = None
) -> Profile:
    """Measure every family on this machine (the CUDA device when there is one) and
    ``nproc`` local gloo processes ("loopback"), and fit each family's line.

    ``threads``: torch threads while timing compute (default: a local rank's, ``cores //
    nproc``, at least 1). On a CPU host also the core sharing of ``nproc`` processes."""
    if dtype not in DTYPES:
        raise ProfileError(f"dtype {dtype!r}: choose {' or '.join(DTYPES)}")
    cpus = os.cpu_count() or 1
    threads = threads or max(1, cpus // max(nproc, 1))
    if threads < 1:
        raise ProfileError(f"threads={threads}: give at least 1")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _profile(quick=quick, nproc=nproc, dtype=dtype, threads=threads)
    finally:
        torch.set_num_threads(before)


def _profile(*, quick: bool, nproc: int, dtype: str, threads: int) -> Profile:
    cuda = torch.cuda.is_available()
    sizes = (CUDA_SIZES if cuda else SIZES)[dtype, quick]
    device = "cuda" if cuda else "cpu"
    backend = "nccl" if cuda else "gloo"
    if cuda and nproc > 1 and torch.cuda.device_count() < nproc:
        raise ProfileError(
            f"--nproc {nproc} on a CUDA host times nccl collectives over {nproc} GPUs, one "
            f"per process, but torch sees {torch.cuda.device_count()}: give --nproc 1 "
            "(compute only, no links) or at most that many"
        )
    samples = _compute_samples(sizes, DTYPES[dtype], device=device)
    by_group = (
        measure_collectives(sizes.collective, sizes.reps, nproc=nproc, groups=(2,), backend=backend)
        if nproc > 1
        else {}
    )
    collectives = [s for group in by_group.values() for s in group]
    sharing = () if cuda else measure_core_sharing(
        max(nproc, 2), threads=threads, window_s=0.6 if quick else 1.5
    )  # fmt: skip
    compute = {op: fit_linear(_points(samples, op), relative=True) for op in COMPUTE_OPS}
    links = {"loopback": link_fits(by_group)} if by_group else {}
    return Profile(
        kind="cuda" if cuda else "cpu",
        device=torch.cuda.get_device_name() if cuda else "cpu",
        dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
        threads=threads,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        host=_host(nproc=nproc, quick=quick, backend=backend, links=bool(by_group)),
        compute=compute,
        links=links,
        samples=(*samples, *collectives),
        core_sharing=sharing,
    )


def _compute_samples(sizes: Sizes, torch_dtype: torch.dtype, *, device: str) -> list[Sample]:
    """Timed runs of each compute op over ``sizes`` (a ``SIZES`` entry)."""
    reps = sizes.reps
    return [
        *measure_matmul(sizes.matmul, reps, torch_dtype, device=device, skinny=sizes.skinny),
        *measure_attention(
            sizes.attention,
            reps,
            torch_dtype,
            device=device,
            heads=sizes.heads,
            head_dim=sizes.head_dim,
        ),  # fmt: skip
        *measure_norm(sizes.norm, reps, torch_dtype, device=device, hidden=sizes.hidden),
        *measure_elementwise(sizes.elementwise, reps, torch_dtype, device=device),
        *measure_optimizer(sizes.optimizer, reps, device=device),
    ]


def _host(*, nproc: int, quick: bool, backend: str, links: bool) -> dict[str, Any]:
    """The machine and the run the profile was measured on."""
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpus": os.cpu_count() or 1,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "nproc": nproc,
        "quick": quick,
        "collectives": (
            f"{backend} over {nproc} local processes"
            if links
            else "not measured (nproc 1): the profile has no links"
        ),
    }


def _points(samples: Sequence[Sample], op: str) -> list[tuple[float, float]]:
    return [(s.units, s.seconds) for s in samples if s.op == op]
