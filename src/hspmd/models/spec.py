"""What hspmd needs to know of a model, as metadata: the ``ModelSpec`` protocol (no torch).

Planning, annotation and specialization read a model through this protocol only. Two
kinds implement it: the Llama presets (``hspmd.models.config.LlamaConfig``, derived from
the config by formula, so llama-70b needs no graph) and any user ``nn.Module``
(``ModuleModel``, read from the module itself on the meta device by
``hspmd.models.module.load_model``).

A model is a stack of ``num_layers`` blocks between a *pre* part (embedding) and a *post*
part (norm, head, loss). Its forward takes ``(tokens, targets)`` (B, T) int64 and returns
the mean loss. The stream entering each block is ``(B, T, hidden_size)``: pipeline stages
cut there. Every parameter has

- a *layer*: the block whose stage holds it (pre-part parameters go with layer 0, post-part
  ones with the last layer);
- a *kind*: how a stage of TP degree t splits it (Megatron's names)::

      kind        2-D weight (out, in)     1-D (bias, norm)   effect on its op's output
      column      {0:t}                    {0:t}              split on the last dim
      row         {1:t}                    error              partial: all-reduced after
      vocab       {0:t}                    -                  embedding: partial, reduced;
                                                              head: logits split (the loss
                                                              is vocab-parallel)
      replicate   {D:t}                    {D:t}              as its inputs

A *marker* is a reshard point of the model (``hspmd.reshard`` or inserted by hspmd) with
the layer whose stage it is on, the layout it imposes inside the stage (``residual``: the
stream's, duplicate or split on seq under sequence parallelism; ``dup``; a dim split t
ways; or ``heads``: a ``(B, T, heads, head_dim)`` tensor of attention, split on heads t
ways, or TP x CP ways on a context-parallel stage), whether it is in the *post* part
(after the last block: a context-parallel stage gathers the sequence there) and its shape
after (B, T).

>>> spec = MarkerSpec("layers.1.input", layer=1, placement="residual", trailing=(64,))
>>> print(spec)
layers.1.input L1 residual (B,T,64)
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args

from hspmd.errors import HspmdError
from hspmd.models.cost_function import (
    Amount,
    CommItem,
    CostFunction,
    ModelCost,
    PartCost,
    WorkItem,
)

__all__ = [
    "NO_LIMIT",
    "TIED_LAYER",
    "NOT_ARCHITECTURE",
    "Amount",
    "BatchField",
    "CommItem",
    "CostFunction",
    "ModelCost",
    "PartCost",
    "WorkItem",
    "MarkerSpec",
    "ModelSpec",
    "ModelSpecError",
    "ModuleModel",
    "ParamInfo",
    "HEADS",
    "Placement",
    "TPKind",
    "TP_KINDS",
    "kind_by_rules",
    "row_dims",
    "stream_shape",
]

NO_LIMIT = 1 << 30  # max_seq_len of a model that states none
TIED_LAYER = "hspmd_tied_layer"  # fx node meta: a tied weight's node read by the last stage

# Fields of a Hugging Face config that change nothing the model computes: left out of its
# identity (``ModuleModel.config_digest``), so that a copy saved by another version resumes.
NOT_ARCHITECTURE = frozenset({
    "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "id2label",
    "label2id", "problem_type", "bos_token_id", "eos_token_id", "pad_token_id",
    "chunk_size_feed_forward", "is_encoder_decoder", "tokenizer_class",
})  # fmt: skip
TPKind = Literal["column", "row", "vocab", "replicate"]
TP_KINDS: tuple[str, ...] = get_args(TPKind)
Placement = Literal["residual", "dup", "heads", "cp_heads"] | int
HEADS: tuple[str, ...] = ("heads", "cp_heads")
"""Placements of attention-head markers: heads split over TP x CP (``heads``), or over CP
only where TP leaves the attention whole (``cp_heads``: a fused replicate qkv)."""


class ModelSpecError(HspmdError, ValueError):
    """A model that hspmd cannot read or train as written (names the part and the fix)."""


@dataclass(frozen=True, slots=True)
class MarkerSpec:
    """A reshard point: name, the layer of its stage, its layout there, its shape after (B, T),
    and whether it is in the post part (after the last block)."""

    name: str
    layer: int
    placement: Placement
    trailing: tuple[int, ...]
    post: bool = False

    def __str__(self) -> str:
        dims = ",".join(["B", "T", *map(str, self.trailing)])
        return f"{self.name} L{self.layer} {self.placement} ({dims}){' post' if self.post else ''}"


class ModelSpec(Protocol):
    """The model as hspmd sees it (module docstring). ``LlamaConfig`` and ``ModuleModel``;
    hashable (caches key on it)."""

    def __hash__(self) -> int: ...

    @property
    def name(self) -> str: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def config_only(self) -> bool: ...
    @property
    def tie_embeddings(self) -> bool: ...
    @property
    def blocks(self) -> str:
        """The module path of the blocks' ModuleList (a block's parameters are
        ``{blocks}.{i}.*``; recompute and costs find a node's layer by it)."""
        ...

    @property
    def hf_config(self) -> str:
        """A Hugging Face model's config as canonical JSON ("" for other models)."""
        ...

    @property
    def markers_complete(self) -> bool:
        """Whether the markers stand where Megatron's layout puts them and nothing between
        them reshards, so that every reshard site follows from their placements with no
        graph (``hspmd.specialize.sites.marker_sites``; tests check it against deduction)."""
        ...

    @property
    def tied(self) -> tuple[tuple[str, int], ...]:
        """Parameters used on two stages' layers (a head tied to the embedding): each
        name and its second layer; its gradient is summed between the two stages."""
        ...

    def parameter_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Every parameter's global shape, in ``named_parameters()`` order."""
        ...

    def param_kind(self, name: str) -> TPKind:
        """How a stage splits parameter ``name`` under TP."""
        ...

    def param_layer(self, name: str) -> int:
        """The layer whose stage holds parameter ``name``."""
        ...

    def markers(self) -> tuple[MarkerSpec, ...]:
        """Every reshard point, in forward order."""
        ...

    def tp_sizes(self, first_layer: int, last_layer: int) -> dict[str, int]:
        """Named sizes the TP degree of a stage holding those layers must divide."""
        ...

    @property
    def cost(self) -> CostFunction | None:
        """The model's own cost function (``hspmd.models.cost_function``): the Llama's
        formulas, or the figures measured on a captured graph (None until measured:
        ``hspmd.cost.captured.costed``)."""
        ...


def kind_by_rules(name: str, rules: tuple[tuple[str, str], ...]) -> TPKind:
    """The kind of the first rule whose ``fnmatch`` pattern matches ``name``; else replicate.

    >>> kind_by_rules("blocks.3.attn.q.weight", (("*.attn.q.*", "column"),))
    'column'
    >>> kind_by_rules("ln_f.weight", (("*.attn.q.*", "column"),))
    'replicate'
    """
    for pattern, kind in rules:
        if fnmatch.fnmatchcase(name, pattern):
            return kind  # type: ignore[return-value]  # checked by check_rules
    return "replicate"


@dataclass(frozen=True, slots=True)
class BatchField:
    """One input of a model trained on a user's dataset (``--dataset``): a field of the
    items, its shape in one item (the batch stacks them on dim 0), its dtype, and the
    layer whose stage reads it (0: before the first block; the last layer: after it)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    layer: int = 0


def row_dims(model: Any, batch: int, seq_len: int) -> tuple[int, ...]:
    """The leading dims of every marker's tensor: ``(B, T)`` for a model of tokens,
    ``(B,)`` for one of a dataset's items (its fields have no sequence dim).

    >>> row_dims(object(), 4, 16)
    (4, 16)
    """
    return (batch,) if getattr(model, "batch", ()) else (batch, seq_len)


def stream_shape(model: Any, batch: int, seq_len: int) -> tuple[int, ...]:
    """The shape of the stream a pipeline stage sends: ``(B, T, hidden)``, or ``(B, *S)``
    for a dataset's model whose blocks take ``S`` per item."""
    stream = getattr(model, "stream", ())
    if getattr(model, "batch", ()):
        return (batch, *stream)
    return (batch, seq_len, model.hidden_size)


@dataclass(frozen=True, slots=True)
class ParamInfo:
    """One parameter of a user model: name, global shape, TP kind, layer."""

    name: str
    shape: tuple[int, ...]
    kind: TPKind
    layer: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ModuleModel:
    """A user ``nn.Module``, as metadata read from it (``hspmd.models.module.load_model``).

    ``source`` names the factory (``path/to/file.py:make_model`` or ``package.module:make``)
    and ``kwargs`` its keyword arguments (``--config JSON``): any process can rebuild the
    module from these two. The rest is what the module showed on the meta device. Plain
    data: hashable, picklable, printable.
    """

    source: str
    kwargs: tuple[tuple[str, Any], ...] = ()
    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_seq_len: int
    params: tuple[ParamInfo, ...]
    marker_specs: tuple[MarkerSpec, ...]
    tp_rules: tuple[tuple[str, str], ...] = ()
    tie_embeddings: bool = False
    config_only: bool = False
    user_markers: bool = False  # the module places its own ``layers.{i}.input`` markers
    blocks: str = "layers"  # the path of the blocks' ModuleList
    convention: str = "positional"  # how a step calls it (hspmd.models.calling)
    # a parameter used on two stages' layers (a head tied to the embedding): name, its
    # second layer; it lives on both stages, its gradient summed between them
    tied: tuple[tuple[str, int], ...] = ()
    cost: ModelCost | None = None  # filled by hspmd.cost.captured.costed (the planner's)
    hf_config: str = ""  # a Hugging Face model's config, canonical JSON (identity, export)
    # trained on a user's dataset (``--dataset``): the items' fields in the graph's input
    # order, how the forward takes them ("tuple", "dict", "tensor"), and the shape of the
    # stream entering each block after the batch dim; () and "": tokens and targets
    batch: tuple[BatchField, ...] = ()
    structure: str = ""
    stream: tuple[int, ...] = ()
    packed: bool = False  # its graph takes packed documents' segments (hspmd.models.module)
    ignore_index: int = -100  # the target its loss ignores (padding of packed rows)
    # the compute dtype its graph is captured in ("fp32", "bf16": ``--dtype``): casts the
    # forward derives from a tensor's dtype (``x.to(input_dtype)``) are recorded as they run
    dtype: str = "fp32"
    _by_name: dict[str, ParamInfo] = field(
        default_factory=dict, init=False, compare=False, hash=False, repr=False
    )

    def __post_init__(self) -> None:
        self._by_name.update((p.name, p) for p in self.params)

    @property
    def markers_complete(self) -> bool:
        return False  # what the module runs between its markers is known from its graph only

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {p.name: p.shape for p in self.params}

    def _param(self, name: str) -> ParamInfo:
        found = self._by_name.get(name)
        if found is None:
            raise ModelSpecError(f"model {self.name} has no parameter {name!r}")
        return found

    def param_kind(self, name: str) -> TPKind:
        return self._param(name).kind

    def param_layer(self, name: str) -> int:
        return self._param(name).layer

    def param_layers(self, name: str) -> tuple[int, ...]:
        """Every layer whose stage holds ``name``: its own, and a tied use's."""
        own = self._param(name).layer
        return (own, *(layer for tied, layer in self.tied if tied == name and layer != own))

    def markers(self) -> tuple[MarkerSpec, ...]:
        return self.marker_specs

    def tp_sizes(self, first_layer: int, last_layer: int) -> dict[str, int]:
        """The split dim of every column, row and vocab parameter those layers' stage holds
        (a head tied to the embedding on the last layer's too: ``param_layers``)."""
        return {
            f"{p.name} dim {int(p.kind == 'row')}": p.shape[int(p.kind == "row")]
            for p in self.params
            if p.kind != "replicate"
            and any(first_layer <= layer <= last_layer for layer in self.param_layers(p.name))
        }

    def config_digest(self) -> str:
        """16 hex digits of a Hugging Face model's architecture (its config without the
        fields that change nothing it computes, ``NOT_ARCHITECTURE``); "" for other models.

        >>> ModuleModel(source="m", name="m", num_layers=1, hidden_size=1, vocab_size=1,
        ...             max_seq_len=1, params=(), marker_specs=(),
        ...             hf_config='{"hidden_size": 8, "dtype": "bfloat16"}').config_digest()
        'a010c0bd8122f369'
        """
        if not self.hf_config:
            return ""
        data = {k: v for k, v in json.loads(self.hf_config).items() if k not in NOT_ARCHITECTURE}
        text = json.dumps(data, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __str__(self) -> str:
        return f"{self.name} ({self.source}, {self.num_layers} layers)"
