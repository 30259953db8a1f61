"""cross_entropy on vocab-split logits: a duplicate loss, a class-split logits gradient."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hspmd.annotation import parse_annotation as A
from hspmd.deduce import DeductionError, deduce
from hspmd.markers import reshard


class Head(nn.Module):
    """A column-parallel head over duplicate hidden states, then the loss."""

    def __init__(self, *, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.head = nn.Linear(8, 16, bias=False)
        self.label_smoothing = label_smoothing

    def forward(self, x, targets):
        logits = reshard(self.head(x), "logits")  # (B, T, V)
        return F.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), label_smoothing=self.label_smoothing
        )


def run(module: nn.Module, targets: str = "[0,1]{D:2}"):
    return deduce(
        module,
        input_annotations={"x": A("[0,1]{D:2}"), "targets": A(targets)},
        param_annotations={"head.weight": A("[0,1]{0:2}")},
        marker_annotations={"logits": A("[0,1]{2:2}")},
        input_shapes={"x": (2, 4, 8), "targets": (2, 4)},
        input_dtypes={"x": torch.float32},
        strict=True,  # the rules' own refusals (the fallback: test_fallback.py)
    )


def test_vocab_split_logits_give_a_duplicate_loss_and_a_split_gradient() -> None:
    ag = run(Head())
    assert str(ag.annotations["flatten"]) == "[0,1]{1:2}"
    assert str(ag.annotations["cross_entropy"]) == "[0,1]{D:2}"
    assert str(ag.grads["flatten"]) == "[0,1]{1:2}"
    site = ag.reshard("logits")  # nothing to move either way
    assert (str(site.src), str(site.dst), str(site.grad_out)) == ("[0,1]{2:2}",) * 3
    assert str(ag.param_grads["head.weight"]) == "[0,1]{0:2}"


def test_split_targets_or_label_smoothing_are_refused() -> None:
    with pytest.raises(DeductionError, match="class dim"):
        run(Head(), targets="[0,1]{0:2}")
    with pytest.raises(DeductionError, match="label_smoothing"):
        run(Head(label_smoothing=0.1))
