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

# moe-gpt's flags (ModelConfig's fields; `--imbalance` is the cost model's alone): None
# when not given, so that a dense GPT can refuse them by name
_MOE_FLAGS = {
    "experts": "--experts", "top_k": "--top-k", "capacity_factor": "--capacity-factor",
    "moe_every": "--moe-every", "shared_expert": "--shared-expert", "imbalance": "--imbalance",
}  # fmt: skip


def add_expert_arguments(p: argparse.ArgumentParser) -> None:
    """moe-gpt's model flags; their defaults are `plait train`'s (`ModelConfig`)."""
    from plait.config import ModelConfig

    m = ModelConfig()
    a = p.add_argument
    a("--experts", type=int, help=f"moe-gpt: experts per MoE layer ({m.experts})")
    a("--top-k", type=int, dest="top_k", help=f"moe-gpt: experts per token ({m.top_k})")
    a(
        "--capacity-factor",
        type=float,
        dest="capacity_factor",
        help=f"moe-gpt: expert capacity over the mean load; 0: dropless ({m.capacity_factor})",
    )
    a(
        "--moe-every",
        type=int,
        dest="moe_every",
        help=f"moe-gpt: every k-th layer is a MoE layer ({m.moe_every})",
    )
    a(
        "--shared-expert",
        action="store_true",
        default=None,
        dest="shared_expert",
        help="moe-gpt: a dense FFN every token also passes through",
    )
    a("--imbalance", type=float,
      help="moe-gpt: the busiest expert's load over the mean that the cost model assumes "
      "(1.0: balanced routing, the default)")  # fmt: skip


def check_expert_flags(args: argparse.Namespace) -> None:
    """A model without experts refuses the expert flags by name."""
    given = [f for k, f in _MOE_FLAGS.items() if getattr(args, k, None) is not None]
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
    """The model flags `profile`, `plan` and `simulate` share; their defaults are those of
    `plait train` (`ModelConfig`), so every command describes the same default model."""
    from plait.config import ModelConfig

    m = ModelConfig()
    p.add_argument("--model", choices=MODELS, default=m.name, help=f"model family ({m.name})")
    p.add_argument("--layers", type=int, default=m.layers, help=f"layers (default {m.layers})")
    p.add_argument("--hidden", type=int, default=m.hidden, help=f"hidden size ({m.hidden})")
    p.add_argument("--heads", type=int, default=m.heads, help=f"attention heads ({m.heads})")
    p.add_argument(
        "--seq-len", type=int, default=m.seq_len, dest="seq_len", help=f"tokens ({m.seq_len})"
    )
    p.add_argument("--vocab", type=int, default=96, help="vocabulary size (default 96)")
    p.add_argument(
        "--ffn-hidden", type=int, default=0, dest="ffn_hidden", help="MLP width (0: 4 × hidden)"
    )
    p.add_argument(
        "--micro-batch-size", type=int, default=1, dest="micro_batch_size", help="samples each"
    )
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
