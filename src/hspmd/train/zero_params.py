"""ZeRO-3's parameters: stored as shards, gathered to the compute annotation around their
uses, freed after (DESIGN 18: an annotation and its resolved reshard, no FSDP code path).

A parameter's stored annotation is its optimizer state's (``hspmd.plan.params``: the
replicas split a dim the stage does not, even or in ``--zero-shares`` proportion); the
gather to the compute annotation is its resolved plan, a split-all-gather between the
replicas (point to point, so uneven parts need no padding). The executable's parameters
keep their objects (the graph, autograd and the gradient hooks see the same tensors); only
their storage comes and goes (``untyped_storage().resize_``). Two ways, by the strategy:

=========  =================================================================================
per layer  the pipelines run in lock step (``hspmd.plan.params.lock_step``): each unit
           (``hspmd.train.zero_units``) is gathered at its ``enter`` in every F, with the
           next one prefetched, and freed at its ``leave``; in B it is gathered again when
           autograd first unpacks a weight it saved (saved-tensor hooks) or when a
           recomputed layer reruns its ``enter``, the one before it prefetched, and each
           parameter is freed as soon as its gradient is accumulated. The forward's last
           unit (the final norm and head) stays gathered for the backward, which starts
           with it (FSDP2 keeps its root so too), unless another F comes first. Peak: the
           shards plus about two units.
per step   the schedules differ (micro-batch counts, stage cuts), so per-layer gathers would
           make pipelines wait on each other's schedule: every parameter of the stage is
           gathered at the first F of the step (one batch) and freed as its gradient is
           final in the step's last B. Saves the gradients' and states' memory, not the
           parameters' peak.
=========  =================================================================================

Every rank of a gather issues the same units in the same order: in F the units in graph
order, in B the units that B needs in reverse order (``Unit.backward``), each reached unit
issuing the ones before it that were skipped, and at the end of each B (an autograd final
callback) the rest, so the replicas' batches always pair up. Gathers travel under their own
p2p tag (``ZERO_GATHER``), apart from the gradient reduces in flight at the same time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hspmd.comm.plan import CommPlan
from hspmd.runtime.batched import ZERO_GATHER, StartedPlans, start_plans
from hspmd.runtime.regather import Regather
from hspmd.runtime.world import World
from hspmd.train.zero_units import Unit, UnitPoint

__all__ = ["ParamStore", "StoreAround"]


@dataclass(eq=False, slots=True)
class _Saved:
    """What autograd keeps for a saved view of a stored parameter: the view (its storage
    comes back when the unit is gathered again) and the unit that gathers it."""

    tensor: torch.Tensor
    unit: int


class ParamStore:
    """This rank's stored parameters (module docstring). ``plans[name]``: the gather from
    the stored annotation to the compute one; ``shard(name)``: this rank's stored piece
    now (the fp32 master, or its compute-dtype copy); ``on_change``: called after each
    gather lands (memory sampling)."""

    def __init__(
        self, params: Mapping[str, torch.Tensor], plans: Mapping[str, CommPlan],
        shard: Callable[[str], torch.Tensor], units: tuple[Unit, ...], world: World, *,
        per_layer: bool, prefetch: bool = True, on_change: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.params, self.plans, self.shard, self.units = params, plans, shard, units
        self.world, self.per_layer, self.prefetch = world, per_layer, prefetch
        self.on_change = on_change or (lambda: None)
        self.bwd_order = [k for k in reversed(range(len(units))) if units[k].backward]
        self.last_use = {n: k for k, u in enumerate(units) for n in u.names}
        with torch.no_grad():
            for p in params.values():  # a storage of its own (a slice may view the init)
                p.data = p.data.detach().clone(memory_format=torch.contiguous_format)
        self.nbytes = {n: p.untyped_storage().nbytes() for n, p in params.items()}
        # unit (-1: all of them) -> its names and their gathers in flight
        self.pending: dict[int, tuple[tuple[str, ...], StartedPlans]] = {}
        self.issued: list[int] = []  # units issued in this F or B, in order
        self.phase, self.current, self.armed, self.gathered = "idle", 0, False, False
        # the unit the forward ends with, kept gathered for the backward that starts with it
        self.last = len(units) - 1 if per_layer and units and units[-1].backward else None
        self.kept: int | None = None
        self.pointers: dict[int, str] = {}  # data_ptr of a gathered parameter -> its name
        for name in params:
            self._free(name)
            params[name].register_post_accumulate_grad_hook(self._grad_hook(name))

    # -- the points, the saved tensors, the gradients --------------------------------------

    def point(self, kind: str, unit: int) -> None:
        """An ``enter`` or ``leave`` of the executable graph (``UnitPoint.hook``)."""
        if kind == "enter" and self.phase == "forward":
            self.current = unit
            self._forward_need(unit)
        elif kind == "enter":  # a recomputed layer, in backward
            self._backward_need(unit)
        elif self.phase == "forward" and self.per_layer:  # leave
            if unit == self.last and torch.is_grad_enabled():  # its backward comes first
                self.kept = unit
                return
            for name in self.units[unit].names:
                if self.last_use[name] == unit:
                    self._free(name)

    def bind(self, gm: torch.nn.Module) -> None:
        """Give every ``UnitPoint`` of ``gm`` this store's ``point``."""
        for module in gm.modules():
            if isinstance(module, UnitPoint):
                module.hook = self.point

    def pack(self, t: torch.Tensor) -> Any:
        """Saved-tensor pack: a view of a gathered parameter is kept with its unit."""
        if self.per_layer and t.numel() and t.untyped_storage().data_ptr() in self.pointers:
            return _Saved(t, self.current)
        return t

    def unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _Saved):
            self._backward_need(saved.unit)
            return saved.tensor
        return saved

    def _grad_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            if self.per_layer:
                self._begin_backward()
                self._free(name)
            elif self.armed:
                self._free(name)

        return hook

    # -- phases ---------------------------------------------------------------------------

    def forward_begins(self) -> None:
        self.phase, self.issued = "forward", []
        if self.kept is not None:  # another F came before the B (GPipe): not kept longer
            self._free_all()
        if not self.per_layer and not self.gathered:  # the step's first F: all, one batch
            self.gather_all()

    def forward_ends(self) -> None:
        if self.per_layer:
            self._drain(range(len(self.units)))
            kept = set(self.units[self.kept].names) if self.kept is not None else set()
            for name in self.params:
                if name not in kept:
                    self._free(name)
        self.phase = "idle"

    def arm(self) -> None:
        """The next B is the step's last (per step: parameters go as their grads are final)."""
        self.armed = True

    def step_ends(self) -> None:
        """After the step's Post: nothing stays gathered."""
        self.armed = self.gathered = False
        self._free_all()

    def _begin_backward(self) -> None:
        if self.phase != "backward":
            self.phase, self.issued = "backward", []
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)

    def _backward_ends(self) -> None:
        self._drain(self.bwd_order)
        self._free_all()
        self.phase = "idle"

    def _free_all(self) -> None:
        self.kept = None
        for name in self.params:
            self._free(name)

    # -- gathering ------------------------------------------------------------------------

    def _forward_need(self, unit: int) -> None:
        self._reach(list(range(len(self.units))), unit)

    def _backward_need(self, unit: int) -> None:
        if not self.per_layer:
            return
        self._begin_backward()
        if unit not in self.bwd_order:
            raise AssertionError(f"unit {unit} {self.units[unit].names} is used in backward")
        self._reach(self.bwd_order, unit)

    def _reach(self, order: list[int], unit: int) -> None:
        """Issue ``order`` up to ``unit`` (and the one after it, prefetched), wait for it."""
        position = order.index(unit)
        upto = min(position + (2 if self.prefetch else 1), len(order))
        for k in order[len(self.issued) : upto]:
            self._issue(k)
        self._wait(unit)

    def _drain(self, order: Any) -> None:
        """Issue what the order has left (so every replica issued the same), wait for all."""
        order = list(order)
        for k in order[len(self.issued) :]:
            self._issue(k)
        for k in list(self.pending):
            self._wait(k)

    def _issue(self, unit: int) -> None:
        self.issued.append(unit)
        if unit == self.kept and self.phase == "backward":  # still gathered from the F
            self.kept = None
            return
        names = self.units[unit].names
        self.pending[unit] = (names, self._start(names))

    def _start(self, names: tuple[str, ...]) -> StartedPlans:
        plans = [self.plans[n] for n in names]
        local = {i: self.shard(n) for i, n in enumerate(names)}
        outs = {}
        with torch.no_grad():
            for i, name in enumerate(names):
                storage = self.params[name].untyped_storage()
                if storage.nbytes() == 0:
                    storage.resize_(self.nbytes[name])
                outs[i] = self.params[name].data
        return start_plans(plans, local, self.world, tag=ZERO_GATHER, outs=outs, kind="zero-gather")

    def _wait(self, unit: int) -> None:
        found = self.pending.pop(unit, None)
        if found is None:
            return
        names, started = found
        outs = started.wait()
        with torch.no_grad():
            for i, name in enumerate(names):
                param = self.params[name].data
                if outs[i].data_ptr() != param.data_ptr():  # a plan that made a new tensor
                    param.copy_(outs[i])
                self.pointers[param.untyped_storage().data_ptr()] = name
        self.on_change()

    def _free(self, name: str) -> None:
        for unit, (names, _) in list(self.pending.items()):
            if name in names:  # its gather writes into the storage: let it land first
                self._wait(unit)
        storage = self.params[name].untyped_storage()
        if storage.nbytes():
            self.pointers.pop(storage.data_ptr(), None)
            storage.resize_(0)

    def gather_all(self) -> None:
        """Every parameter gathered now, in one batch (per step: the step's first F; the
        end of a run, whose pieces are read)."""
        names = tuple(self.params)
        self.pending[-1] = (names, self._start(names))
        self._wait(-1)
        self.gathered = True


class StoreAround:
    """Entered around each forward of a ZeRO-3 executable (``Executable.around``): the
    store's phase and, per layer, the saved-tensor hooks that note saved parameter views,
    composed with the stage's ``Regather`` where it has one (the innermost hooks win, so
    these ask Regather first)."""

    def __init__(self, store: ParamStore, inner: Regather | None = None) -> None:
        self.store, self.inner = store, inner
        self._hooks: Any = None

    def __enter__(self) -> StoreAround:
        self.store.forward_begins()
        if self.inner is not None:
            self.inner.__enter__()
        if self.store.per_layer:
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(*exc)
        if self.inner is not None:
            self.inner.__exit__(*exc)
        self.store.forward_ends()

    def _pack(self, t: torch.Tensor) -> Any:
        if self.inner is not None:
            kept = self.inner._pack(t)
            if kept is not t:
                return kept
        return self.store.pack(t)

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _Saved):
            return self.store.unpack(saved)
        return Regather._unpack(saved)
