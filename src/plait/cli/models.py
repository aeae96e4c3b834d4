"""The model flags that `profile`, `plan` and `simulate` share (a dense GPT's and
mixture-of-experts ones), their checks, and the model spec they describe."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.profile.analytic import GPTSpec, MoESpec

__all__ = [
    "MODELS",
    "add_expert_arguments",
    "add_model_arguments",
    "check_ep",
    "check_expert_flags",
    "default_dtype",
    "flag_error",
    "model_value",
    "moe_spec_from_args",
    "spec_from_args",
]

MODELS = ("gpt", "moe-gpt")

# the ModelConfig fields a priced model reads (dropout, resnet18's width and the weights of
# the routers' losses change no cost): their flags are generated, as `plait train`'s are
_SHAPE = ("name", "layers", "hidden", "heads", "seq_len", "ffn_hidden")
_EXPERTS = ("experts", "top_k", "capacity_factor", "moe_every", "shared_expert")


def add_expert_arguments(p: argparse.ArgumentParser) -> None:
    """moe-gpt's model flags, generated from `ModelConfig` as `plait train`'s are: None when
    not given (a dense GPT refuses them by name; moe-gpt takes the field's default)."""
    from plait.cli.options import add_config_flags
    from plait.config import ModelConfig

    add_config_flags(p, ModelConfig, only=_EXPERTS)
    # the cost model's assumption about routing, not a setting of a model that trains
    p.add_argument("--imbalance", type=float, metavar="X",
                   help="moe-gpt: the busiest expert's load over the mean that the cost model "
                   "assumes (1.0: balanced routing, the default)")  # fmt: skip


def check_expert_flags(args: argparse.Namespace) -> None:
    """A model without experts refuses the expert flags by name."""
    from plait.cli.options import config_flags
    from plait.config import ModelConfig

    flags = {k: f for k, f in config_flags(ModelConfig).items() if k in _EXPERTS}
    flags["imbalance"] = "--imbalance"
    values = {f: getattr(args, k, None) for k, f in flags.items()}
    # a switch turned off was typed as --no-NAME: name it as typed
    given = [f"--no-{f[2:]}" if v is False else f for f, v in values.items() if v is not None]
    if getattr(args, "model", "gpt") != "moe-gpt" and given:
        raise ValueError(f"{given[0]} applies to --model moe-gpt only: add it, or drop {given[0]}")


def moe_spec_from_args(args: argparse.Namespace) -> MoESpec:
    """The MoE-GPT the model flags describe (flags not given: `plait train`'s defaults)."""
    from plait.config import ModelConfig
    from plait.profile.analytic import MoESpec

    m = ModelConfig()

    def value(name: str, default: object) -> Any:
        given = getattr(args, name, None)
        return default if given is None else given

    return MoESpec(
        num_layers=args.layers, hidden=args.hidden, num_heads=args.heads,
        seq_len=args.seq_len, vocab_size=args.vocab, ffn_hidden=args.ffn_hidden,
        num_experts=value("experts", m.experts), top_k=value("top_k", m.top_k),
        capacity_factor=value("capacity_factor", m.capacity_factor),
        moe_every=value("moe_every", m.moe_every),
        shared_expert=value("shared_expert", m.shared_expert),
        imbalance=value("imbalance", 1.0),
    )  # fmt: skip


def check_ep(args: argparse.Namespace, spec: GPTSpec) -> None:
    """Expert parallelism needs experts, dp × tp ranks to borrow and experts to share out."""
    from plait.profile.analytic import MoESpec

    if not isinstance(spec, MoESpec):
        if args.ep != 1:
            raise ValueError(f"--ep {args.ep} needs a model with experts: add --model moe-gpt")
        return
    if args.sequence_parallel:
        raise ValueError(
            "--sequence-parallel with --model moe-gpt, whose MoE layers take whole "
            "sequences: drop --sequence-parallel"
        )
    if (args.dp * args.tp) % args.ep:
        raise ValueError(
            f"--ep {args.ep} does not divide --dp {args.dp} × --tp {args.tp}: expert "
            "parallelism borrows data- and tensor-parallel ranks; use an ep dividing dp × tp"
        )
    if spec.num_experts % args.ep:
        raise ValueError(
            f"--ep {args.ep} does not divide --experts {spec.num_experts}: every rank of an "
            "ep group holds as many experts; use an ep dividing the experts"
        )


def model_value(key: str, value: Any) -> Any:
    """A plan file's model entry, of the kind its flag takes (a file is no argparse)."""
    if key == "name":
        if value not in MODELS:
            raise ValueError(f"plan file: model.name={value!r} is unknown; use one of {MODELS}")
        return value
    if key == "shared_expert":
        ok = isinstance(value, bool)
    elif key in ("capacity_factor", "imbalance"):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"plan file: model.{key}={value!r} is not a valid {key}")
    return value


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model flags `profile`, `plan` and `simulate` share, generated from `ModelConfig`
    as `plait train`'s are; their defaults are its fields', so every command describes the
    same default model."""
    from plait.cli.options import add_config_flags
    from plait.config import ModelConfig

    m = ModelConfig()
    defaults: dict[str, Any] = {k: getattr(m, k) for k in _SHAPE}
    defaults["ffn_hidden"] = (0, "4 × hidden")  # GPTSpec's way to say what None says
    add_config_flags(p, ModelConfig, only=_SHAPE, defaults=defaults, dests={"name": "model"},
                     choices={"name": MODELS})  # fmt: skip
    # no ModelConfig fields: `plait train` takes the vocabulary from its data and sizes its
    # micro-batches from --batch-size and --microbatches, but a priced model needs both
    p.add_argument("--vocab", type=int, default=96, metavar="N",
                   help="vocabulary size (default: 96)")  # fmt: skip
    p.add_argument("--micro-batch-size", type=int, default=1, metavar="N",
                   help="samples per micro-batch (default: 1)")  # fmt: skip
    add_expert_arguments(p)


def default_dtype() -> str:
    """The training dtype every command assumes unless told: `plait train`'s."""
    from plait.config import ParallelPlan

    return ParallelPlan().dtype


def flag_error(error: ValueError) -> ValueError:
    """A model error with the field names replaced by the flags that set them."""
    text = str(error)
    for field, flag in (
        ("num_layers", "--layers"),
        ("num_heads", "--heads"),
        ("seq_len", "--seq-len"),
        ("vocab_size", "--vocab"),
        ("ffn_hidden", "--ffn-hidden"),
        ("num_experts", "--experts"),
        ("top_k", "--top-k"),
        ("capacity_factor", "--capacity-factor"),
        ("moe_every", "--moe-every"),
        ("imbalance", "--imbalance"),
        ("hidden", "--hidden"),
    ):
        text = text.replace(f"{field}=", f"{flag} ")
    return ValueError(text)


def spec_from_args(args: argparse.Namespace) -> GPTSpec:
    """The GPT (or MoE-GPT) the model flags describe; bad sizes raise ValueError naming
    the flag."""
    from plait.profile.analytic import GPTSpec

    if args.micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size {args.micro_batch_size} must be >= 1")
    model = getattr(args, "model", "gpt")
    check_expert_flags(args)
    if model == "moe-gpt":
        try:
            return moe_spec_from_args(args)
        except ValueError as error:
            raise flag_error(error) from None
    try:
        return GPTSpec(
            num_layers=args.layers,
            hidden=args.hidden,
            num_heads=args.heads,
            seq_len=args.seq_len,
            vocab_size=args.vocab,
            ffn_hidden=args.ffn_hidden,
        )
    except ValueError as error:
        raise flag_error(error) from None
