"""A stand-in stage program: layers ``first..last`` of the plain model on one rank.

Used where a stage has tensor-parallel degree 1, until specialization's executable graphs
(hspmd.specialize) run every stage. Stage 0 embeds the tokens; the last stage applies the
final norm and head and returns the mean token loss of its micro-batch; others map the
residual stream ``(B, T, H) -> (B, T, H)``.

>>> from hspmd.models.llama import get_config
>>> stage = EagerStage(get_config("llama-tiny", num_layers=2), first=0, last=0, seed=0)
>>> sorted(stage.params)[:2]
['embed.weight', 'layers.0.attn.wk.weight']
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hspmd.models.llama import Llama, LlamaConfig, init_weights, parameter_shapes

__all__ = ["EagerStage", "stage_parameter_names"]


def stage_parameter_names(config: LlamaConfig, first: int, last: int) -> list[str]:
    """Names of the parameters a stage of layers ``first..last`` holds, in model order."""
    model_names = list(parameter_shapes(config))
    keep = [
        n for n in model_names if n.startswith("layers.") and first <= int(n.split(".")[1]) <= last
    ]
    head = ["norm.weight"] + ([] if config.tie_embeddings else ["head.weight"])
    return (
        (["embed.weight"] if first == 0 else [])
        + keep
        + (head if last == config.num_layers - 1 else [])
    )


class EagerStage:
    """Runs part of a ``Llama`` whose weights are the single-device model's."""

    def __init__(self, config: LlamaConfig, *, first: int, last: int, seed: int) -> None:
        model = init_weights(Llama(config), seed)
        self.model, self.first, self.last = model, first, last
        self.is_first, self.is_last = first == 0, last == config.num_layers - 1
        names = set(stage_parameter_names(config, first, last))
        named = dict(model.named_parameters())
        self.params: dict[str, torch.Tensor] = {
            n: named[n] for n in stage_parameter_names(config, first, last)
        }
        for name, param in named.items():
            if name not in names:
                param.requires_grad_(False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Tokens (stage 0) or the residual stream in; loss (last stage) or residual out."""
        m = self.model
        T = x.shape[1]
        cos = torch.narrow(m.rope_cos, 0, 0, T)
        sin = torch.narrow(m.rope_sin, 0, 0, T)
        if self.is_first:
            x = m.embed(x)
        for layer in m.layers[self.first : self.last + 1]:
            x = layer(x, cos, sin)
        if not self.is_last:
            return x
        logits = m.head(m.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
