"""Factories whose initialization cannot be replayed from a recording on meta: hspmd builds
them on the CPU instead (tests/models/test_initial.py)."""

import torch
from torch import nn


class ReadsValues(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.Linear(4, 4)
        scale = torch.tensor(2.0).item() if layer.weight.is_meta else 2.0
        self.w = nn.Parameter(layer.weight.detach() * scale)
        if self.w.is_meta:
            float(self.w.detach().sum())  # data-dependent: fails on meta


def reads_values():
    return ReadsValues()


class LeftEmpty(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4))  # never filled: no value to replay
        self.v = nn.Parameter(torch.ones(4))


def left_empty():
    return LeftEmpty()
