import numpy as np
import pytest
import torch

from hspmd.errors import PartitionError
from hspmd.partition.capture import DEVICES, Device, capture_training_step


def _mse(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return ((model(batch[0]) - batch[1]) ** 2).mean()


def _mlp_graph(**kwargs):
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        batch = (torch.randn(5, 8), torch.randn(5, 4))
    return capture_training_step(model, batch, loss_fn=_mse, **kwargs)


def test_leaves_residuals_and_order() -> None:
    graph = _mlp_graph()
    names = graph.names
    params = [i for i, n in enumerate(names) if n.startswith("param:")]
    states = [i for i, n in enumerate(names) if n.startswith("state:")]
    assert len(params) == 4 and len(states) == 12  # Adam: step, exp_avg, exp_avg_sq
    weights = (8 * 16 + 16 + 16 * 4 + 4) * 4
    assert graph.residual_bytes[params].sum() == weights
    assert graph.residual_bytes.sum() == 3 * weights + 4 * 4  # + four scalar steps
    assert (
        graph.residual_bytes[[i for i in range(len(names)) if i not in params + states]] == 0
    ).all()
    assert (graph.src < graph.dst).all()  # recorded in execution order


def test_updates_are_colocated_and_wait_for_readers() -> None:
    graph = _mlp_graph()
    index = graph.index
    weight = index["param:0.weight"]
    updates = np.flatnonzero(graph.colocate == weight)
    assert [graph.names[u].split("#")[0] for u in updates] == ["addcdiv_.default"]
    update = int(updates[0])
    readers = graph.dst[graph.src == weight]
    # every op that reads the weight (its transposes) runs before the update
    ancestors = set(graph.preds[graph.in_ptr[update] : graph.in_ptr[update + 1]].tolist())
    assert set(readers.tolist()) - {update} <= ancestors


def test_roofline_time_of_a_matmul() -> None:
    device = Device("toy", flops_per_s=1e12, bytes_per_s=1e15, launch_us=1.0)
    with torch.device("meta"):
        model = torch.nn.Linear(1024, 1024, bias=False)
        batch = (torch.randn(512, 1024), torch.randn(512, 1024))
    graph = capture_training_step(model, batch, loss_fn=_mse, device=device, optimizer="sgd")
    mms = [i for i, n in enumerate(graph.names) if n.startswith("mm.default")]
    flops = 2 * 512 * 1024 * 1024
    assert graph.time_us[mms[0]] == pytest.approx(1.0 + flops / 1e12 * 1e6, rel=1e-3)
    views = [i for i, n in enumerate(graph.names) if n.startswith("t.default")]
    assert (graph.time_us[views] == 0).all() and (graph.out_bytes[views] == 0).all()
    assert graph.out_bytes[mms[0]] == 512 * 1024 * 4


def test_measure_on_real_tensors() -> None:
    model = torch.nn.Linear(32, 8)
    batch = (torch.randn(16, 32), torch.randn(16, 8))
    graph = capture_training_step(model, batch, loss_fn=_mse, measure=True)
    ops = [i for i, n in enumerate(graph.names) if ":" not in n]
    assert (graph.time_us[ops] > 0).all()
    with torch.device("meta"):
        meta = torch.nn.Linear(2, 2)
    with pytest.raises(PartitionError, match="measure=True"):
        capture_training_step(meta, batch, loss_fn=_mse, measure=True)


def test_errors_and_presets() -> None:
    assert "15.7 TFLOP/s" in str(DEVICES["v100"])
    with pytest.raises(PartitionError, match="optimizer 'lamb'"):
        _mlp_graph(optimizer="lamb")


def test_measured_times_are_medians_of_repeats_and_the_model_is_restored() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    batch = (torch.randn(32, 64), torch.randn(32, 8))
    before = [p.detach().clone() for p in model.parameters()]
    graph = capture_training_step(model, batch, loss_fn=_mse, measure=True, repeats=3)
    assert graph.meta == {"times": "measured", "repeats": 3, "statistic": "median", "on": "cpu"}
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    ops = [i for i, n in enumerate(graph.names) if ":" not in n]
    assert (graph.time_us[ops] > 0).all()
    # sizes are the real outputs': the first matmul's (32, 256) fp32 output
    first = next(i for i in ops if graph.names[i].startswith("addmm"))
    assert graph.out_bytes[first] == 32 * 256 * 4
    # the same structure as the roofline capture of the same model
    with torch.device("meta"):
        meta_model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)
        )
        meta_batch = (torch.randn(32, 64), torch.randn(32, 8))
    roof = capture_training_step(meta_model, meta_batch, loss_fn=_mse)
    assert roof.meta["times"] == "roofline" and "v100" in roof.meta["device"]
    assert roof.names == graph.names and np.array_equal(roof.out_bytes, graph.out_bytes)
    assert np.array_equal(roof.residual_bytes, graph.residual_bytes)
    with pytest.raises(PartitionError, match="repeats=0"):
        capture_training_step(model, batch, loss_fn=_mse, measure=True, repeats=0)


def test_the_graph_file_says_which_times(tmp_path) -> None:
    from hspmd.partition.io import load_graph, save_graph_json

    model = torch.nn.Linear(16, 4)
    batch = (torch.randn(8, 16), torch.randn(8, 4))
    graph = capture_training_step(model, batch, loss_fn=_mse, measure=True, repeats=2)
    save_graph_json(tmp_path / "g.json", graph)
    back = load_graph(tmp_path / "g.json")
    assert back.meta["times"] == "measured" and back.meta["repeats"] == 2
    assert np.array_equal(back.time_us, np.round(graph.time_us, 3))
