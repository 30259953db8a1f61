"""The cost of any model, measured on its graph, against the Llama formulas (issue 12).

The planner costs every model by its own cost function (``ModelSpec.cost``): a Llama
preset by formula (``hspmd.models.llama_cost``), any other model by the figures
``hspmd.cost.captured.model_cost`` measures on its graph on the meta device. Here both paths cost the same Llama shapes (2 layers of each preset, one
micro-batch of 4096 tokens, or the preset's max, bf16, the ``hetu-h800-h20`` cost lines) and
the table prints measured / formula for a middle stage (``mid``), the first (``first``)
and the last (``last``): forward and backward seconds, TP communication seconds, kept
activation bytes per layer, and parameters per rank.

    .venv/bin/python benchmarks/model_cost.py        # the table, then one JSON line

Ratios above 1 in seconds come from the measured path charging every op of the eager
graph (RMSNorm as 6 ops, RoPE as 8, where the formulas count one fused call each), which
weighs more at small sizes and high TP. TP communication is 1.000 in every stage: the
formulas count each collective the deduced graph runs. CP stages (``cp`` 2, the figures
deduced as a CP stage: ``hspmd.cost.splits``) move the same bytes, but the runtime's four
all-to-alls per layer and direction each pay a call's latency where the formulas price
one call, and the formulas price the CP all-gathers on ``1/cp`` of the gathered tensor.
"""

from __future__ import annotations

import json
import time
from typing import Any

from hspmd.cost.captured import model_cost
from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.cost.stage import stage_params, stage_work
from hspmd.models.config import LlamaConfig, get_config
from hspmd.models.spec import ModelCost
from hspmd.planner.memory import activation_bytes_per_layer


class Measured:
    """A Llama config whose cost function is its measured figures, not its formulas."""

    def __init__(self, config: LlamaConfig) -> None:
        self._config = config
        self.cost: ModelCost = model_cost(config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)

    def __hash__(self) -> int:
        return hash(("measured", self._config))


SHAPES = [(tp, 1, sp) for tp in (1, 2, 8) for sp in (False, True)] + [(1, 2, False), (4, 2, False)]
"""(TP, CP, sequence parallelism) of the stages compared (CP stages take no SP)."""


def ratios(
    cost: CostModel, config: LlamaConfig, measured: Measured, s: int, shape: tuple[int, int, bool]
) -> dict[str, float]:
    """measured / formula of one stage shape: seconds per part, communication, activations
    and parameters."""
    tp, cp, sp = shape
    ranks = tuple(range(tp * cp))
    ratio: dict[str, float] = {}
    for where, first, last in (
        ("mid", False, False),
        ("first", True, False),
        ("last", False, True),
    ):
        kw: dict[str, Any] = dict(micro_batch_size=1, seq_len=s, first=first, last=last,
                                  sequence_parallel=sp, cp=cp)  # fmt: skip
        want = stage_work(cost, config, ranks, 2, **kw)
        got = stage_work(cost, measured, ranks, 2, **kw)  # type: ignore[arg-type]
        ratio[f"forward_{where}"] = got.forward_s / want.forward_s
        ratio[f"backward_{where}"] = got.backward_s / want.backward_s
        if tp * cp > 1:
            ratio[f"comm_{where}"] = got.tp_comm_s / want.tp_comm_s
    act = dict(elt=2, sequence_parallel=sp, recompute=False)
    ratio["activations"] = (
        activation_bytes_per_layer(measured, 1, s // cp, tp, **act)[0]  # type: ignore[arg-type]
        / activation_bytes_per_layer(config, 1, s // cp, tp, **act)[0]
    )
    params = stage_params(measured, 2, tp, first=True, last=True)  # type: ignore[arg-type]
    ratio["params"] = params / stage_params(config, 2, tp, first=True, last=True)
    return ratio


def main() -> None:
    cost = CostModel.of(load_cluster("hetu-h800-h20"), dtype="bf16")
    rows: list[dict[str, Any]] = []
    print(f"{'model':<12}{'tp':>3}{'cp':>3}{'sp':>3}  {'F mid':>6}{'B mid':>6}{'F first':>8}"
          f"{'F last':>7}{'comm mid':>9}{'comm first':>11}{'comm last':>10}{'act':>6}"
          f"{'params':>7}")  # fmt: skip
    for name in ("llama-small", "llama-32b", "llama-70b"):
        config = get_config(name, num_layers=2)
        start = time.perf_counter()
        measured = Measured(config)
        seconds = time.perf_counter() - start
        s = min(4096, config.max_seq_len)
        for shape in SHAPES:
            ratio = ratios(cost, config, measured, s, shape)
            comm = "".join(f"{ratio.get(f'comm_{w}', 0):{n}.3f}"
                           for w, n in (("mid", 9), ("first", 11), ("last", 10)))  # fmt: skip
            tp, cp, sp = shape
            print(
                f"{name:<12}{tp:>3}{cp:>3}{int(sp):>3}  {ratio['forward_mid']:6.3f}"
                f"{ratio['backward_mid']:6.3f}{ratio['forward_first']:8.3f}"
                f"{ratio['forward_last']:7.3f}{comm}{ratio['activations']:6.3f}"
                f"{ratio['params']:7.4f}"
            )  # fmt: skip
            rows.append({"model": name, "tp": tp, "cp": cp, "sp": sp, "seq_len": s,
                         "measure_s": round(seconds, 2),
                         **{k: round(v, 4) for k, v in ratio.items()}})  # fmt: skip
    print(json.dumps({"benchmark": "model_cost", "rows": rows}))


if __name__ == "__main__":
    main()
