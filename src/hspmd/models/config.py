"""The Llama configuration, its presets and parameter shapes: metadata, no torch.

Planning, resolution and specialization read model shapes from here without importing
torch; ``hspmd.models.llama`` builds the module itself.

>>> get_config("llama-tiny", num_layers=2).head_dim
16
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hspmd.errors import HspmdError
from hspmd.models.llama_cost import LlamaCost, llama_cost
from hspmd.models.spec import MarkerSpec, TPKind, kind_by_rules

__all__ = [
    "PRESETS",
    "TP_RULES",
    "LlamaConfig",
    "ModelConfigError",
    "get_config",
    "parameter_shapes",
]


class ModelConfigError(HspmdError, ValueError):
    """A model configuration or preset that cannot be built or used as asked."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaConfig:
    vocab_size: int = 256  # tokens; 256 = raw bytes
    hidden_size: int = 64  # H, width of the residual stream
    intermediate_size: int = 128  # F, SwiGLU hidden width
    num_layers: int = 4  # transformer blocks
    num_heads: int = 4  # query heads; head_dim = H / num_heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention); divides num_heads
    rope_theta: float = 10000.0  # RoPE base
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = False  # head.weight is embed.weight
    max_seq_len: int = 512  # length of the precomputed RoPE tables
    config_only: bool = False  # too big to allocate: metadata and meta-device tracing only

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "max_seq_len")  # fmt: skip
        small = [f"{name}={getattr(self, name)}" for name in sizes if getattr(self, name) < 1]
        if small:
            raise ModelConfigError(f"{', '.join(small)}: every size of the model must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ModelConfigError(
                f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}: grouped-query attention needs whole groups"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    # -- the ModelSpec protocol (hspmd.models.spec) ------------------------------------------

    @property
    def cost(self) -> LlamaCost:
        """The Llama's own cost function, by formula (``hspmd.models.llama_cost``)."""
        return llama_cost(self)

    @property
    def name(self) -> str:
        for name, preset in PRESETS.items():
            if preset == self:
                return name
        return f"llama ({self.num_layers} layers, hidden {self.hidden_size})"

    @property
    def blocks(self) -> str:
        return "layers"

    @property
    def hf_config(self) -> str:
        return ""

    @property
    def markers_complete(self) -> bool:
        return True  # hspmd.models.llama places every marker of Megatron's layout

    @property
    def tied(self) -> tuple[tuple[str, int], ...]:
        return ()  # a tied preset is refused across stages (plan.strategy): never summed

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return parameter_shapes(self)

    def param_kind(self, name: str) -> TPKind:
        return kind_by_rules(name, TP_RULES)

    def param_layer(self, name: str) -> int:
        """Layer ``i`` for ``layers.{i}.*``; embed with layer 0, norm and head with the last."""
        if name.startswith("layers."):
            return int(name.split(".")[1])
        return 0 if name == "embed.weight" else self.num_layers - 1

    def markers(self) -> tuple[MarkerSpec, ...]:
        """The Llama's markers (``hspmd.models.llama``), in forward order."""
        H, last = (self.hidden_size,), self.num_layers - 1
        q, kv = (self.num_heads, self.head_dim), (self.num_kv_heads, self.head_dim)
        specs = [MarkerSpec("embed", 0, "residual", H)]
        for i in range(self.num_layers):
            for part, placement, trailing in (
                ("input", "residual", H), ("attn_in", "dup", H), ("attn.q", "heads", q),
                ("attn.k", "heads", kv), ("attn.v", "heads", kv), ("attn.ctx", 2, q),
                ("attn_out", "residual", H), ("mlp_in", "dup", H), ("mlp_out", "residual", H),
            ):  # fmt: skip
                specs.append(MarkerSpec(f"layers.{i}.{part}", i, placement, trailing))  # type: ignore[arg-type]
        specs.append(MarkerSpec("head_in", last, "dup", H, post=True))
        specs.append(MarkerSpec("logits", last, 2, (self.vocab_size,), post=True))
        return tuple(specs)

    def tp_sizes(self, first_layer: int, last_layer: int) -> dict[str, int]:
        sizes = {
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
        }
        if first_layer == 0 or last_layer == self.num_layers - 1:
            sizes["vocab_size"] = self.vocab_size
        return sizes


TP_RULES: tuple[tuple[str, str], ...] = (
    ("*.attn.wq.weight", "column"), ("*.attn.wk.weight", "column"),
    ("*.attn.wv.weight", "column"), ("*.mlp.w_gate.weight", "column"),
    ("*.mlp.w_up.weight", "column"), ("*.attn.wo.weight", "row"),
    ("*.mlp.w_down.weight", "row"), ("embed.weight", "vocab"), ("head.weight", "vocab"),
)  # fmt: skip
"""How the Llama's parameters split under TP (Megatron's layout); norms replicate."""


PRESETS: dict[str, LlamaConfig] = {
    # Fast on CPU; byte-level vocabulary.
    "llama-tiny": LlamaConfig(),
    # For benchmarks on CPU: still byte-level, about 6.4M parameters.
    "llama-small": LlamaConfig(
        hidden_size=256, intermediate_size=768, num_layers=8, num_heads=8, num_kv_heads=4,
        max_seq_len=1024,
    ),
    # The paper's Table 6 (60 layers, hidden 6656, 64 heads, 64 query groups, FFN 17920,
    # vocab 50304, context 4096). Assumed (not in the paper): rope_theta, norm_eps, untied.
    "llama-32b": LlamaConfig(
        vocab_size=50304, hidden_size=6656, intermediate_size=17920, num_layers=60,
        num_heads=64, num_kv_heads=64, norm_eps=1e-5, max_seq_len=4096, config_only=True,
    ),
    # The standard Llama-2-70B shape; vocab 50304 assumed to match the 32B model, as are
    # rope_theta, norm_eps and untied embeddings.
    "llama-70b": LlamaConfig(
        vocab_size=50304, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, norm_eps=1e-5, max_seq_len=4096, config_only=True,
    ),
}  # fmt: skip


def get_config(name: str, **overrides: object) -> LlamaConfig:
    """A preset by name, with fields overridden: ``get_config("llama-tiny", num_layers=2)``."""
    if name not in PRESETS:
        raise ModelConfigError(f"unknown model {name!r}: choose one of {', '.join(PRESETS)}")
    try:
        return dataclasses.replace(PRESETS[name], **overrides)  # type: ignore[arg-type]
    except TypeError as error:
        raise ModelConfigError(f"bad override for {name}: {error}") from None


def parameter_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's global shape, in ``named_parameters()`` order, allocating nothing.

    >>> shapes = parameter_shapes(LlamaConfig(num_layers=1))
    >>> shapes["layers.0.attn.wk.weight"], len(shapes)
    ((32, 64), 12)
    """
    H, F_, V = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (V, H)}
    for i in range(config.num_layers):
        p = f"layers.{i}"
        shapes |= {
            f"{p}.attn_norm.weight": (H,),
            f"{p}.attn.wq.weight": (q, H),
            f"{p}.attn.wk.weight": (kv, H),
            f"{p}.attn.wv.weight": (kv, H),
            f"{p}.attn.wo.weight": (H, q),
            f"{p}.mlp_norm.weight": (H,),
            f"{p}.mlp.w_gate.weight": (F_, H),
            f"{p}.mlp.w_up.weight": (F_, H),
            f"{p}.mlp.w_down.weight": (H, F_),
        }
    shapes["norm.weight"] = (H,)
    if not config.tie_embeddings:
        shapes["head.weight"] = (V, H)
    return shapes
