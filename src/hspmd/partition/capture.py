"""Capture a whole training step (forward, loss, backward, optimizer) as an :class:`OpGraph`.

Every aten op that runs in the step becomes a node. A ``TorchDispatchMode`` sees each
op with its real arguments, so an edge ``u -> v`` is recorded when ``v`` reads a tensor
that ``u`` made (tracked by tensor identity, and by storage for aliases and in-place
writes), and when ``v`` overwrites a storage that ``u`` read before (write after read:
the optimizer must not update a weight that backward still reads).

Costs:

* ``out_bytes``: bytes of the op's new outputs (views and in-place ops make none);
* ``time_us``: a roofline of a described :class:`Device`,
  ``launch_us + max(flops / flops_per_s, bytes / bytes_per_s)``; FLOPs per op family
  (matmuls, convolutions and attention from ``torch.utils.flop_counter``, one per
  output element for everything else); views cost nothing. With ``measure=True``
  (real tensors only) the op's own wall time instead: after the recorded step, the
  step runs ``repeats`` more times with every op timed (synchronized on CUDA), and
  each op gets the median of its times; the model's parameters are restored after;
* ``residual_bytes``: parameters and optimizer states are residual nodes (one per
  tensor, no time); in-place updates of them are colocated with them.

Sizes are those of the tensors each op produced (numel x element size), so on real
tensors they are measured, on meta tensors exact for the same shapes. ``graph.meta``
(the JSON ``meta``) says which times were used: ``{"times": "measured", "repeats": 5,
"statistic": "median", "on": "cpu"}`` or ``{"times": "roofline", "device": "v100: ..."}``.

On meta tensors nothing is allocated, so graphs of 100K+ ops are cheap to capture.
An update with zero gradients runs first, uncaptured, so that optimizer states exist
(as they do in every step after the first) and are captured as residual leaves.

>>> import torch
>>> with torch.device("meta"):
...     model = torch.nn.Linear(4, 2)
...     batch = (torch.randn(3, 4), torch.randn(3, 2))
>>> graph = capture_training_step(
...     model, batch, loss_fn=lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
>>> int(graph.residual_bytes.sum())  # weight, bias, Adam's exp_avg/exp_avg_sq/step
128
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from hspmd.errors import PartitionError
from hspmd.partition.graph import OpGraph


@dataclass(frozen=True, slots=True)
class Device:
    """A device described by its peak fp32 rate, memory bandwidth and kernel launch cost."""

    name: str
    flops_per_s: float
    bytes_per_s: float
    launch_us: float = 5.0

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.flops_per_s / 1e12:g} TFLOP/s, "
            f"{self.bytes_per_s / 1e9:g} GB/s, {self.launch_us:g} us launch"
        )

    def time_us(self, *, flops: float, num_bytes: float) -> float:
        """Roofline time of one kernel, in microseconds."""
        return self.launch_us + 1e6 * max(flops / self.flops_per_s, num_bytes / self.bytes_per_s)


# Assumed datasheet figures (fp32 without tensor cores, HBM bandwidth), not measured here.
DEVICES: dict[str, Device] = {
    "v100": Device("v100", 15.7e12, 900e9),
    "a100": Device("a100", 19.5e12, 1555e9),
    "h100": Device("h100", 67e12, 3350e9),
}

LossFn = Callable[[torch.nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]


def capture_training_step(
    model: torch.nn.Module,
    batch: Sequence[torch.Tensor],
    *,
    loss_fn: LossFn,
    optimizer: str = "adam",
    device: Device = DEVICES["v100"],
    measure: bool = False,
    repeats: int = 5,
    name: str = "step",
) -> OpGraph:
    """Create the optimizer states, then record one step op by op (see the module docstring)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    _check_capturable(model, params, measure=measure, repeats=repeats)
    opt = _optimizer(optimizer, [p for _, p in params])
    batch = tuple(batch)

    def step() -> None:
        loss_fn(model, batch).backward()
        opt.step()

    for _, p in params:  # an update with zero gradients creates the optimizer states
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    recorder = _Recorder(device=device, measure=measure)
    recorder.sync = measure and any(p.is_cuda for _, p in params)
    _record_leaves(recorder, params, opt, batch)
    saved = [p.detach().clone() for _, p in params] if measure else []
    with recorder:
        step()
    opt.zero_grad(set_to_none=True)
    if not measure:
        return recorder.graph(name, meta={"times": "roofline", "device": str(device)})
    _time_ops(recorder, step, opt, repeats=repeats)
    with torch.no_grad():
        for (_, p), value in zip(params, saved, strict=True):
            p.copy_(value)
    on = "cuda" if recorder.sync else "cpu"
    meta = {"times": "measured", "repeats": repeats, "statistic": "median", "on": on}
    return recorder.graph(name, meta=meta)


def _check_capturable(
    model: torch.nn.Module,
    params: list[tuple[str, torch.nn.Parameter]],
    *,
    measure: bool,
    repeats: int,
) -> None:
    if not params:
        raise PartitionError(f"model {type(model).__name__} has no trainable parameters")
    if measure and any(p.is_meta for _, p in params):
        raise PartitionError("measure=True needs real tensors; build the model off the meta device")
    if measure and repeats < 1:
        raise PartitionError(f"{repeats=} must be >= 1 (timed runs of the step)")


def _record_leaves(
    recorder: _Recorder,
    params: list[tuple[str, torch.nn.Parameter]],
    opt: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, ...],
) -> None:
    """The graph's leaves: parameters and optimizer states (residual), then the batch."""
    for pname, p in params:
        recorder.leaf(f"param:{pname}", p, residual=True)
        for key, state in opt.state[p].items():
            if isinstance(state, torch.Tensor):
                recorder.leaf(f"state:{pname}.{key}", state, residual=True)
    for i, tensor in enumerate(batch):
        recorder.leaf(f"input:{i}", tensor, residual=False)


def _time_ops(
    recorder: _Recorder, step: Callable[[], None], opt: torch.optim.Optimizer, *, repeats: int
) -> None:
    """Run ``step`` ``repeats`` more times under the same mode (so that autograd
    dispatches the same ops) and give each recorded op its median time."""
    recorder.samples = []
    for _ in range(repeats):
        recorder.samples.append([])
        with recorder:
            step()
        opt.zero_grad(set_to_none=True)
        recorder.held.clear()
        if len(recorder.samples[-1]) != len(recorder.op_nodes):
            raise PartitionError(
                f"a timed step ran {len(recorder.samples[-1])} ops, the recorded one "
                f"{len(recorder.op_nodes)}: the step is not deterministic; use measure=False"
            )
    median = np.median(np.asarray(recorder.samples), axis=0)
    for node, t in zip(recorder.op_nodes, median.tolist(), strict=True):
        recorder.time_us[node] = t


def _optimizer(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    # foreach=False: one update op per tensor, as a dataflow graph has them
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-3, foreach=False)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=False)
    raise PartitionError(f"optimizer {kind!r} is not known; use 'adam' or 'sgd'")


class _Recorder(TorchDispatchMode):
    """Records nodes, edges and costs of the ops it sees."""

    def __init__(self, *, device: Device, measure: bool) -> None:
        super().__init__()
        self.device = device
        self.measure = measure
        self.names: list[str] = []
        self.time_us: list[float] = []
        self.out_bytes: list[int] = []
        self.residual: list[int] = []
        self.colocate: list[int] = []
        self.src: list[int] = []
        self.dst: list[int] = []
        self.producer: dict[int, int] = {}  # id(tensor) -> node that made it
        self.writer: dict[int, int] = {}  # storage -> node that last wrote it
        self.readers: dict[int, list[int]] = {}  # storage -> nodes that read it since
        self.owner: dict[int, int] = {}  # storage of a residual tensor -> its node
        self.alive: list[torch.Tensor] = []  # keeps ids and storages unique
        self.op_nodes: list[int] = []  # node of each recorded op, in dispatch order
        self.samples: list[list[float]] | None = None  # set for the timed runs
        self.sync = False  # synchronize CUDA around each timed op
        self.held: list[torch.Tensor] = []  # outputs of the timed run in flight

    def leaf(self, name: str, tensor: torch.Tensor, *, residual: bool) -> None:
        size = _nbytes(tensor)
        node = self._node(name, time_us=0.0, out_bytes=size, residual=size if residual else 0)
        self._made(tensor, node)
        if residual:
            self.owner[_storage(tensor)] = node

    def _node(self, name: str, *, time_us: float, out_bytes: int, residual: int = 0) -> int:
        self.names.append(name)
        self.time_us.append(time_us)
        self.out_bytes.append(out_bytes)
        self.residual.append(residual)
        self.colocate.append(-1)
        return len(self.names) - 1

    def _made(self, tensor: torch.Tensor, node: int) -> None:
        self.alive.append(tensor)
        self.producer[id(tensor)] = node
        key = _storage(tensor)
        self.writer[key] = node
        self.readers[key] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = func(*args, **kwargs)
        if self.sync:
            torch.cuda.synchronize()
        elapsed_us = (time.perf_counter() - start) * 1e6
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs:
            return out  # record_function markers, .item(): nothing flows on
        if self.samples is not None:  # a timed run: the graph is already recorded
            self.samples[-1].append(elapsed_us)
            # hold the outputs as the recording run did: autograd steals a gradient
            # nobody else holds (detach) and copies one that is held, other ops
            self.held.extend(outputs)
            return out
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        schema = func._schema
        written = _written_args(schema, args, kwargs)
        views = any(r.alias_info is not None for r in schema.returns)
        new_bytes = 0 if views else sum(_nbytes(t) for t in outputs)
        if self.measure:
            time_us = elapsed_us
        elif views and not written:
            time_us = 0.0
        else:
            moved = sum(_nbytes(t) for t in inputs) + new_bytes
            flops = _flops(func, args, kwargs, out, outputs)
            time_us = self.device.time_us(flops=flops, num_bytes=moved)
        node = self._node(
            f"{func.__name__}#{len(self.names)}", time_us=time_us, out_bytes=new_bytes
        )
        self.op_nodes.append(node)
        self._connect(node, inputs, written)
        for tensor in outputs:
            if views or written:
                self.alive.append(tensor)
                self.producer[id(tensor)] = node
            else:
                self._made(tensor, node)
        return out

    def _connect(self, node: int, inputs: list[torch.Tensor], written: list[torch.Tensor]) -> None:
        deps: set[int] = set()
        for tensor in inputs:
            key = _storage(tensor)
            made, wrote = self.producer.get(id(tensor)), self.writer.get(key)
            if made is not None:
                deps.add(made)
            if wrote is not None:  # the base of a view, or the last in-place writer
                deps.add(wrote)
            self.readers.setdefault(key, []).append(node)
        for tensor in written:
            key = _storage(tensor)
            deps.update(self.readers.get(key, ()))  # write after read
            self.writer[key] = node
            self.readers[key] = []
            if key in self.owner:
                self.colocate[node] = self.owner[key]
        deps.discard(node)
        for dep in sorted(deps):
            self.src.append(dep)
            self.dst.append(node)

    def graph(self, name: str, *, meta: dict[str, Any]) -> OpGraph:
        edges = np.stack((np.asarray(self.src, np.int64), np.asarray(self.dst, np.int64)), axis=1)
        return OpGraph.build(
            name,
            self.names,
            time_us=np.round(np.asarray(self.time_us), 3),
            out_bytes=self.out_bytes,
            residual_bytes=self.residual,
            edges=edges.reshape(-1, 2),
            colocate=self.colocate,
            meta=meta,
        )


def _written_args(schema: Any, args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Tensor arguments the op writes in place (``add_``, ``out=``, ...)."""
    written: list[torch.Tensor] = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


def _flops(func: Any, args: Any, kwargs: dict[str, Any], out: Any, outputs: list[Any]) -> float:
    """Matmul/conv/attention FLOPs from torch's counter; one per output element otherwise."""
    counter = flop_registry.get(func._overloadpacket)
    if counter is not None:
        return float(counter(*args, **kwargs, out_val=out))
    return float(sum(t.numel() for t in outputs))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata
