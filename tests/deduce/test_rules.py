"""Deduction rules by family, on tiny modules with hand-written annotations."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hspmd.annotation import parse_annotation as A
from hspmd.deduce import DeductionError, NoRuleError, deduce
from hspmd.markers import reshard

TP2_D = A("[0,1]{D:2}")


def run(module, *, inputs, params, markers=None, shapes, dtypes=None):
    return deduce(
        module,
        input_annotations={k: A(v) for k, v in inputs.items()},
        param_annotations={k: A(v) for k, v in params.items()},
        marker_annotations={k: A(v) for k, v in (markers or {}).items()},
        input_shapes=shapes,
        input_dtypes={k: torch.float32 for k in shapes} if dtypes is None else dtypes,
        strict=True,  # the rules' own refusals (the fallback: test_fallback.py)
    )


def texts(ag, *names, grad=False):
    table = ag.grads if grad else ag.annotations
    return [str(table[n]) for n in names]


class MegatronMLP(nn.Module):
    def __init__(self, hidden: int = 8, ffn: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = reshard(x, "mlp_in")
        y = reshard(self.down(F.silu(self.up(h))), "mlp_out")
        return y.pow(2).mean()


def test_column_and_row_parallel_linear() -> None:
    ag = run(
        MegatronMLP(),
        inputs={"x": "[0,1]{D:2}"},
        params={"up.weight": "[0,1]{0:2}", "down.weight": "[0,1]{1:2}"},
        markers={"mlp_in": "[0,1]{D:2}", "mlp_out": "[0,1]{D:2}"},
        shapes={"x": (2, 4, 8)},
    )
    assert texts(ag, "linear", "silu", "linear_1") == ["[0,1]{2:2}", "[0,1]{2:2}", "[0,1]{P:2}"]
    assert texts(ag, "linear", "linear_1", "reshard", grad=True) == [
        "[0,1]{2:2}",
        "[0,1]{D:2}",
        "[0,1]{P:2}",
    ]
    assert {k: str(v) for k, v in ag.param_grads.items()} == {
        "up.weight": "[0,1]{0:2}",
        "down.weight": "[0,1]{1:2}",
    }
    site_in, site_out = ag.reshards
    assert (str(site_in.grad_out), str(site_in.grad_in)) == ("[0,1]{P:2}", "[0,1]{D:2}")  # f
    assert (str(site_out.src), str(site_out.dst)) == ("[0,1]{P:2}", "[0,1]{D:2}")  # g
    assert ag.alignments == ()
    assert "linear_1 = torch._C._nn.linear [2, 4, 8]:float32  [0,1]{P:2}" in str(ag)


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape[0], x.shape[1]
        q = self.q(x).view(B, T, 4, 2).transpose(1, 2)  # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        return y.transpose(1, 2).reshape(B, T, 8).sum()


def test_views_move_split_to_heads_and_back() -> None:
    ag = run(Heads(), inputs={"x": "[0,1]{D:2}"}, params={"q.weight": "[0,1]{0:2}"},
             shapes={"x": (2, 3, 8)})  # fmt: skip
    assert texts(ag, "linear", "view", "transpose", "scaled_dot_product_attention") == [
        "[0,1]{2:2}",
        "[0,1]{2:2}",
        "[0,1]{1:2}",
        "[0,1]{1:2}",
    ]
    assert texts(ag, "transpose_1", "reshape", "sum_1") == [
        "[0,1]{2:2}",
        "[0,1]{2:2}",
        "[0,1]{P:2}",
    ]


def test_view_split_that_does_not_divide_heads() -> None:
    with pytest.raises(DeductionError, match=r"node view .*splits dim 2 of length 4 8 ways"):
        run(
            Heads(),
            inputs={"x": "[0,1,2,3,4,5,6,7]{D:8}"},
            params={"q.weight": "[0,1,2,3,4,5,6,7]{0:8}"},
            shapes={"x": (2, 3, 8)},
        )


class Flatten(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(0, 1).sum()


def test_view_of_non_leading_split_dim_is_an_error() -> None:
    with pytest.raises(DeductionError, match="not the leading dim of its group"):
        run(Flatten(), inputs={"x": "[0,1]{1:2}"}, params={}, shapes={"x": (2, 4)})


class Lm(nn.Module):
    """embedding -> linear -> flatten -> cross_entropy, the batch cut across pipelines."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = reshard(self.embed(tokens), "embed")
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_two_pipelines_uneven_micro_batches() -> None:
    top = "h0(2,1): [0,1]{D:2} [2]{}"
    ag = run(
        Lm(),
        inputs={"tokens": top, "targets": top},
        params={"embed.weight": "hD: [0,1]{0:2} [2]{}", "head.weight": "hD: [0,1]{D:2} [2]{}"},
        markers={"embed": top},
        shapes={"tokens": (3, 4), "targets": (3, 4)},
        dtypes={},
    )
    assert texts(ag, "embedding", "linear", "flatten") == [
        "h0(2,1): [0,1]{P:2} [2]{}",
        top,
        "h0(8,4): [0,1]{D:2} [2]{}",  # the parts scale with B*T
    ]
    assert texts(ag, "cross_entropy") == ["hP: [0,1]{D:2} [2]{}"]
    assert texts(ag, "cross_entropy", "flatten", grad=True) == [
        "hD: [0,1]{D:2} [2]{}",
        "h0(8,4): [0,1]{D:2} [2]{}",
    ]
    assert {k: str(v) for k, v in ag.param_grads.items()} == {
        "embed.weight": "hP: [0,1]{0:2} [2]{}",
        "head.weight": "hP: [0,1]{D:2} [2]{}",
    }


class TwoConsumers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reshard(self.w(x), "gather")  # column-parallel: gives x a partial gradient
        return y.sum() + (x * 2).sum()  # duplicate: gives x a duplicate gradient


def test_alignment_where_consumers_disagree() -> None:
    ag = run(
        TwoConsumers(),
        inputs={"x": "[0,1]{D:2}"},
        params={"w.weight": "[0,1]{0:2}"},
        markers={"gather": "[0,1]{D:2}"},
        shapes={"x": (3, 4)},
    )
    (site,) = ag.alignments
    assert (site.name, site.source, site.consumers) == ("align", "x", ("linear",))
    assert (str(site.grad_from), str(site.grad_to)) == ("[0,1]{P:2}", "[0,1]{D:2}")
    assert str(ag.grads["x"]) == "[0,1]{D:2}"
    assert str(ag.annotations["align"]) == "[0,1]{D:2}"
    (node,) = (n for n in ag.module.graph.nodes if n.name == "align")
    assert [u.name for u in node.users] == ["linear"] and node.args[1] == "x->linear"


class Binary(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.fn(x, y)


def binary(fn, x: str, y: str, shapes=((2, 4), (2, 4))):
    return run(
        Binary(fn), inputs={"x": x, "y": y}, params={}, shapes=dict(zip("xy", shapes, strict=True))
    )


def test_pointwise_partial_rules() -> None:
    assert str(binary(lambda x, y: (x + y).sum(), "[0,1]{P:2}", "[0,1]{P:2}").annotations["add"])
    assert str(binary(lambda x, y: (x * y).sum(), "[0,1]{P:2}", "[0,1]{D:2}").annotations["mul"])
    with pytest.raises(DeductionError, match=r"node add \(_operator.add\) with inputs x: "):
        binary(lambda x, y: (x + y).sum(), "[0,1]{P:2}", "[0,1]{D:2}")
    with pytest.raises(DeductionError, match="Fix: reshard the partial input"):
        binary(lambda x, y: (F.silu(x) * y).sum(), "[0,1]{P:2}", "[0,1]{D:2}")


def test_broadcast_duplicate_operand_with_split() -> None:
    ag = binary(lambda x, y: (x * y).sum(), "[0,1]{0:2}", "[0,1]{D:2}", shapes=((2, 4), (4,)))
    assert str(ag.annotations["mul"]) == "[0,1]{0:2}"
    assert str(ag.grads["y"]) == "[0,1]{P:2}"  # a broadcast operand's gradient is partial
    with pytest.raises(DeductionError, match="duplicate but spans dim 1"):
        binary(lambda x, y: (x * y).sum(), "[0,1]{1:2}", "[0,1]{D:2}", shapes=((2, 4), (4,)))


def test_mean_over_split_dim_and_sum() -> None:
    with pytest.raises(DeductionError, match="mean over dim 1, which is split"):
        binary(lambda x, y: (x + y).mean(-1).sum(), "[0,1]{1:2}", "[0,1]{1:2}")
    ag = binary(lambda x, y: (x + y).sum(-1, keepdim=True).sum(), "[0,1]{1:2}", "[0,1]{1:2}")
    assert str(ag.annotations["sum_1"]) == "[0,1]{P:2}"


def test_device_group_mismatch_and_axes() -> None:
    with pytest.raises(DeductionError, match="different device groups.*hspmd.reshard"):
        binary(lambda x, y: (x + y).sum(), "[0,1]{D:2}", "[2,3]{D:2}")
    # {D:4} and {0:2,D:2} line up on two axes of degree 2
    ag = binary(lambda x, y: (x * y).sum(), "[0,1,2,3]{0:2,D:2}", "[0,1,2,3]{D:4}",
                shapes=((2, 4), (1, 4)))  # fmt: skip
    assert str(ag.annotations["mul"]) == "[0,1,2,3]{0:2,D:2}"


def test_missing_rule_names_op_and_file() -> None:
    with pytest.raises(NoRuleError, match=r"torch.cumsum.*src/hspmd/deduce/"):
        binary(lambda x, y: torch.cumsum(x + y, 0).sum(), "[0,1]{D:2}", "[0,1]{D:2}")


def test_missing_annotations() -> None:
    with pytest.raises(DeductionError, match="parameter 'down.weight' has no annotation"):
        run(MegatronMLP(), inputs={"x": "[0,1]{D:2}"}, params={"up.weight": "[0,1]{0:2}"},
            markers={"mlp_in": "[0,1]{D:2}", "mlp_out": "[0,1]{D:2}"},
            shapes={"x": (2, 4, 8)})  # fmt: skip
    with pytest.raises(DeductionError, match="marker 'mlp_in'"):
        run(MegatronMLP(), inputs={"x": "[0,1]{D:2}"},
            params={"up.weight": "[0,1]{0:2}", "down.weight": "[0,1]{1:2}"},
            shapes={"x": (2, 4, 8)})  # fmt: skip


def test_contractions_from_einsum() -> None:
    ag = binary(lambda x, y: (x @ y).sum(), "[0,1]{1:2}", "[0,1]{0:2}", shapes=((2, 4), (4, 3)))
    assert str(ag.annotations["matmul"]) == "[0,1]{P:2}"
    ag = binary(lambda x, y: torch.einsum("bij,bjk->bik", x, y).sum(), "[0,1]{0:2}",
                "[0,1]{0:2}", shapes=((2, 3, 4), (2, 4, 5)))  # fmt: skip
    assert str(ag.annotations["einsum"]) == "[0,1]{0:2}"
    with pytest.raises(DeductionError, match="splits letters"):
        binary(lambda x, y: (x @ y).sum(), "[0,1]{0:2}", "[0,1]{1:2}", shapes=((2, 4), (4, 2)))
