"""A captured graph sent to another process (hspmd.graph.portable): the same nodes, meta and
symbolic sizes, and a cache that answers from what a launcher sent instead of capturing."""

from __future__ import annotations

import pickle

import torch
from torch import nn

from hspmd.graph.export import capture_step
from hspmd.graph.portable import captured_cache, pack, receive, sending, unpack


def _step(net: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(net(tokens).flatten(0, 1), targets.flatten())


def _captured() -> torch.fx.GraphModule:
    with torch.device("meta"):
        net = nn.Sequential(nn.Embedding(11, 4), nn.Dropout(0.1), nn.Linear(4, 11))
    return capture_step(net, call=_step)


def _symbols(value: object) -> list[str]:
    """The symbols of a fake tensor's sizes, by dim."""
    assert isinstance(value, torch.Tensor)
    return [str(getattr(getattr(s, "node", None), "expr", s)) for s in value.shape]


def test_a_round_trip_keeps_nodes_meta_and_symbolic_sizes() -> None:
    gm = _captured()
    copy = unpack(pickle.loads(pickle.dumps(pack(gm))))
    assert copy.code == gm.code
    renamed: dict[str, str] = {}  # the copy's ShapeEnv names its symbols anew, one for one
    for old, new in zip(gm.graph.nodes, copy.graph.nodes, strict=True):
        assert (new.op, new.name, new.args.__class__) == (old.op, old.name, old.args.__class__)
        assert new.target is old.target or new.target == old.target  # ATen overloads: the same
        assert new.meta.keys() == old.meta.keys()
        for key in ("nn_module_stack", "stack_trace"):
            assert new.meta.get(key) == old.meta.get(key)
        if isinstance(old.meta.get("val"), torch.Tensor):
            before, after = old.meta["val"], new.meta["val"]
            assert (after.dtype, after.dim()) == (before.dtype, before.dim())
            for a, b in zip(_symbols(before), _symbols(after), strict=True):
                assert renamed.setdefault(a, b) == b, f"{old.name}: {a} became {b}"
    assert len(set(renamed.values())) == len(renamed)  # distinct sizes stay distinct
    tokens = next(n for n in copy.graph.nodes if n.op == "placeholder")
    assert all(s in renamed.values() for s in _symbols(tokens.meta["val"]))  # symbolic
    params = dict(copy.named_parameters())
    assert params.keys() == dict(gm.named_parameters()).keys()
    assert all(isinstance(p, nn.Parameter) and p.is_meta for p in params.values())


_CALLS: list[int] = []


@captured_cache(maxsize=2)
def _capture(width: int) -> tuple[torch.fx.GraphModule, int]:
    _CALLS.append(width)
    return _captured(), width


def test_a_cache_answers_from_what_a_launcher_sent() -> None:
    _capture.cache_clear()  # type: ignore[attr-defined]
    _CALLS.clear()
    with sending() as reading:
        gm, width = _capture(4)
    sent = pickle.loads(pickle.dumps(reading.sent()))
    assert [(name.rsplit(".", 1)[-1], args) for name, args, _ in sent] == [("_capture", (4,))]
    _capture.cache_clear()  # type: ignore[attr-defined]  # as in a fresh worker
    receive(sent)
    received, same = _capture(4)
    assert _CALLS == [4] and same == 4  # not captured again
    assert received is not gm and received.code == gm.code
    assert _capture(4)[0] is received  # cached from then on
    _capture(5)
    assert _CALLS == [4, 5]  # what was not sent is captured
