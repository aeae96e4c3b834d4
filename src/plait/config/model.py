"""The model section: which model and its shape."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from plait.config.fields import check_types, positive
from plait.pretrained import read_pretrained

__all__ = ["MODELS", "MODEL_UNUSED", "ModelConfig", "adopt_pretrained"]

MODELS = {
    "gpt": "plait's reference GPT",
    "resnet18": "ResNet-18 for small images",
    "hf-gpt2": "Hugging Face GPT-2 from a config or --init-from, needs plait[hf]",
    "hf-llama": "Hugging Face Llama from a config or --init-from, needs plait[hf]",
    "moe-gpt": "plait's GPT with mixture-of-experts feed-forward layers",
    "custom": "a model given to plait.train.run (Python only)",
    "MODULE:FACTORY": "your own model: FACTORY(vocab_size=, seq_len=) in MODULE (a module "
    "name or a .py file) returns it; see examples/my_model.py",
}


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The reference GPT's shape; the vocabulary comes from the data."""

    name: str = field(
        default="gpt",
        metadata={
            "help": "model",
            "values": MODELS,
            "flag": "--model",
            "metavar": "NAME|MODULE:FACTORY",
        },
    )
    layers: int = field(default=4, metadata={"help": "transformer layers"})
    hidden: int = field(default=128, metadata={"help": "hidden size"})
    heads: int = field(default=4, metadata={"help": "attention heads"})
    seq_len: int = field(default=64, metadata={"help": "tokens per sample"})
    ffn_hidden: int | None = field(
        default=None, metadata={"help": "MLP width", "default_text": "4 × hidden"}
    )
    dropout: float = field(default=0.0, metadata={"help": "dropout probability"})
    width: int = field(
        default=16, metadata={"help": "resnet18: channels of its first stage (64 in the paper)"}
    )
    experts: int = field(default=4, metadata={"help": "moe-gpt: experts per MoE layer"})
    top_k: int = field(
        default=2, metadata={"help": "moe-gpt: experts per token (1: Switch, 2: GShard)"}
    )
    capacity_factor: float = field(
        default=1.25,
        metadata={
            "help": "moe-gpt: expert capacity = factor · tokens · top_k / experts; 0: dropless"
        },
    )
    moe_every: int = field(
        default=2, metadata={"help": "moe-gpt: every k-th layer is a MoE layer, others dense"}
    )
    shared_expert: bool = field(
        default=False, metadata={"help": "moe-gpt: a dense FFN every token also passes through"}
    )
    aux_loss_coef: float = field(
        default=0.01, metadata={"help": "moe-gpt: weight of the load-balancing loss"}
    )
    z_loss_coef: float = field(
        default=0.001, metadata={"help": "moe-gpt: weight of the router z-loss"}
    )

    def __post_init__(self) -> None:
        check_types(self)
        module, sep, factory = self.name.rpartition(":")
        user = bool(sep and module and factory.isidentifier())  # a MODULE:FACTORY model
        if self.name not in MODELS and not user:
            raise ValueError(
                f"model name={self.name!r} is unknown; choose one of {list(MODELS)[:-1]}, "
                "or give your own as MODULE:FACTORY (e.g. examples/my_model.py:build)"
            )
        positive(self, "layers", "hidden", "heads", "seq_len", "width")
        if self.ffn_hidden is not None and self.ffn_hidden < 1:
            raise ValueError(
                f"ffn_hidden={self.ffn_hidden} must be a positive integer, or unset (4 × hidden)"
            )
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout={self.dropout} must lie in [0, 1) (a probability)")
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden={self.hidden} is not a multiple of heads={self.heads}: change one of them"
            )
        self._check_moe()

    def _check_moe(self) -> None:
        positive(self, "experts", "top_k", "moe_every")
        if self.name == "moe-gpt" and self.top_k > self.experts:
            raise ValueError(
                f"top_k={self.top_k} exceeds experts={self.experts}: use top_k <= experts"
            )
        for name in ("capacity_factor", "aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(f"{name}={value} must be a finite number >= 0")
        if self.name == "moe-gpt" and self.moe_every > self.layers:
            raise ValueError(
                f"moe_every={self.moe_every} with layers={self.layers} leaves no MoE layer: "
                "use moe_every <= layers"
            )

    @property
    def num_blocks(self) -> int:
        """Pipeline blocks: ResNet-18's ten, or embedding, `layers` layers and head."""
        return 10 if self.name == "resnet18" else self.layers + 2

    @property
    def is_language_model(self) -> bool:
        """Trains on token sequences (a user's MODULE:FACTORY model does too)."""
        return self.name not in ("resnet18", "custom")

    @property
    def is_user_model(self) -> bool:
        """A MODULE:FACTORY model from the command line."""
        return ":" in self.name

    @property
    def known_blocks(self) -> bool:
        """Whether `num_blocks` is known before the model is built (not a user's model)."""
        return self.name != "custom" and not self.is_user_model


# the ModelConfig fields each model never reads (a custom model comes built: not checked)
_MOE = ("experts", "top_k", "capacity_factor", "moe_every", "shared_expert", "aux_loss_coef",
        "z_loss_coef")  # fmt: skip
MODEL_UNUSED = {
    "gpt": ("width", *_MOE), "hf-gpt2": ("width", *_MOE), "hf-llama": ("width", *_MOE),
    "resnet18": ("layers", "hidden", "heads", "seq_len", "ffn_hidden", "dropout", *_MOE),
    "moe-gpt": ("width",),
}  # fmt: skip


def adopt_pretrained(model: ModelConfig, path: str) -> ModelConfig:
    """`model` with the family and shape of the Hugging Face folder at `path`: a field set
    to other than its default that differs from the folder's is an error."""
    shape = read_pretrained(path)
    defaults = ModelConfig()
    for name, value in shape.model_fields().items():
        mine = getattr(model, name)
        if mine != value and mine != getattr(defaults, name):
            flag = "--model" if name == "name" else "--" + name.replace("_", "-")
            raise ValueError(
                f"{name}={mine!r} contradicts init_from={path!r}, whose config.json gives "
                f"{value!r}: drop {flag} (the folder decides the model's shape)"
            )
    if model.seq_len > shape.max_positions:
        raise ValueError(
            f"seq_len={model.seq_len} exceeds the {shape.max_positions} positions of "
            f"init_from={path!r}: use seq_len <= {shape.max_positions}"
        )
    return dataclasses.replace(model, **shape.model_fields())
