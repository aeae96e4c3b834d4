"""Analytic per-block costs of a GPT-style transformer: FLOPs, activation bytes, parameters.

FLOPs follow Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC 2021): a layer's forward is 24·b·s·h² + 4·b·s²·h for an
MLP of 4h (8bsh² + 4bshf in general: QKV, projection and the two MLP GEMMs, plus the
QKᵀ and attention-times-V products); the backward costs twice the forward, of which the
weight gradients are one forward of the weighted GEMMs and the input gradients the rest
(the attention products have no weights). The LM head costs 2·b·s·h·V forward.

Activation bytes count the tensors autograd keeps for plait's GPT layer
(`plait.models.gpt.TransformerBlock`), element by element: both layer norms' inputs and
outputs, q, k and v, the attention output (the projection's input), the MLP's up-projection
output (GeLU's input) and GeLU's output: (8 + 2f/h)·s·b·h elements of the activation dtype,
plus the two dropout masks when dropout is on. Attention runs through torch's
`scaled_dot_product_attention`: without dropout a fused kernel (flash or memory-efficient,
on CPU too) keeps no s² scores; with dropout this model materializes them as Korthikanti et
al., "Reducing Activation Recomputation in Large Transformer Models" (2022), do and torch's
math path does: the softmax output, its dropout mask and the dropped scores, a·s²·b each.
Masks are torch's fused-dropout bool masks, one byte per element, on CUDA; on the CPU torch
keeps the scaled noise in the activation dtype instead and runs 16-bit attention with
dropout in fp32 (`device_type="cpu"`). For f = 4h, dropout on and 16-bit activations on
CUDA this is Korthikanti et al.'s s·b·h·(34 + 5·a·s/h) per layer without parallelism;
s·b·h·(10 + 24/t + 5·a·s/(h·t)) with t-way tensor parallelism (norm inputs and outputs and
the masks are replicated, the rest sharded by heads or columns); s·b·h/t·(34 + 5·a·s/h)
with sequence parallelism too. Selective recomputation drops the s² terms; full
recomputation keeps the layer input, s·b·h elements (divided by t with sequence
parallelism). Tensor parallelism follows Shoeybi et al. (Megatron-LM, 2019): two
all-reduces of b·s·h activations per layer forward and two backward, which sequence
parallelism turns into all-gathers and reduce-scatters of the same total cost.

Context parallelism (`plait.cost.context`) splits each sequence over cp ranks: every
per-token quantity above (FLOPs, activations, tensor-parallel collectives) counts the
b·s/cp tokens of a rank, attention's b·s²·h work too (zigzag balances the causal triangle,
so each rank does 1/cp of it), and each layer adds its K/V ring. Without recomputation
plait's ring keeps fp32 copies of q, k, v and of its output (the projection's input is a
further copy in the activation dtype), where SDPA keeps them in the activation dtype and
its output is the projection's input. With dropout the ring materializes no s² scores: it
keeps its attention-dropout mask, one byte per probability of its s/cp queries against
all s keys (a·s/cp·s·b), and recomputes the probabilities in backward.

Limits: layer norms, softmax, dropout and GeLU count no FLOPs (their time is in the
device's efficiency); Korthikanti et al.'s count leaves out the layer norms' mean and rstd
(2·s·b elements per norm, counted here: 4/(34·h) of a layer); CUDA's fused attention with
dropout keeps no s² scores either, so there the model overstates by that term; autocast's
casted weight copies and vocabulary padding are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.cluster import dtype_bytes
from plait.cost.blocks import BlockCost, Layout, Recompute, check_recompute
from plait.cost.comm import Collective
from plait.cost.context import RING_BYTES, RingExchange

__all__ = [
    "TransformerShape",
    "layer_activation_bytes",
    "transformer_block_costs",
]


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """A GPT and how one micro-batch of it is split: over `layout.tp` tensor-parallel ranks,
    with or without sequence parallelism, and its sequences over `layout.cp` context-
    parallel ranks (`layout` None: one rank holds everything)."""

    num_layers: int
    hidden: int
    num_heads: int
    seq_len: int
    vocab_size: int
    micro_batch_size: int = 1
    ffn_hidden: int = 0  # 0: 4 × hidden
    dtype: str = "bf16"
    layout: Layout | None = None
    dropout: float = 0.0  # plait's GPTConfig default
    device_type: str = "cuda"  # "cpu": dropout masks and attention kept as torch's CPU kernels do

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden",
            "num_heads",
            "seq_len",
            "vocab_size",
            "micro_batch_size",
            "tp",
            "cp",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1) (a probability)")
        if self.device_type not in ("cuda", "cpu"):
            raise ValueError(f"device_type={self.device_type!r} must be 'cuda' or 'cpu'")
        if self.ffn_hidden == 0:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        dtype_bytes(self.dtype)
        for name in ("hidden", "num_heads", "ffn_hidden"):
            if getattr(self, name) % self.tp:
                raise ValueError(
                    f"{name}={getattr(self, name)} is not divisible by tp={self.tp}; "
                    f"choose tp dividing it"
                )
        if self.seq_len % (2 * self.cp):
            raise ValueError(
                f"seq_len={self.seq_len} is not divisible by 2·cp = {2 * self.cp}, which "
                "context parallelism's zigzag chunks need; change cp or the sequence length"
            )
        # sequence parallelism splits what a cp rank holds: its s/cp tokens, over tp
        if self.sequence_parallel and self.local_seq % self.tp:
            raise ValueError(
                f"seq_len={self.seq_len} over cp={self.cp} leaves {self.local_seq} tokens per "
                f"rank, not divisible by tp={self.tp}, which sequence parallelism needs; "
                "change tp, cp or the sequence length, or turn sequence_parallel off"
            )

    @property
    def tp(self) -> int:
        return self.layout.tp if self.layout is not None else 1

    @property
    def cp(self) -> int:
        return self.layout.cp if self.layout is not None else 1

    @property
    def sequence_parallel(self) -> bool:
        return self.layout is not None and self.layout.sequence_parallel

    @property
    def local_seq(self) -> int:
        """s/cp: the tokens of each sequence one context-parallel rank holds."""
        return self.seq_len // self.cp

    @property
    def tokens(self) -> int:
        """b·s/cp: tokens of one micro-batch on one context-parallel rank."""
        return self.micro_batch_size * self.local_seq

    @property
    def width(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def mask_bytes(self) -> int:
        """Bytes per dropout-mask element: CUDA's fused dropout keeps a bool mask, the CPU
        path (`torch.nn.functional.dropout` without a fused kernel) the scaled noise in the
        activation dtype; none without dropout."""
        if self.dropout == 0:
            return 0
        return 1 if self.device_type == "cuda" else self.width


def layer_activation_bytes(shape: TransformerShape, recompute: Recompute) -> float:
    """Bytes one transformer layer keeps per micro-batch per tensor-parallel rank: the
    tensors autograd saves in plait's GPT layer (module docstring); Korthikanti et al.
    2022, Table 2, for f = 4h, dropout on, 16-bit activations on CUDA."""
    check_recompute(recompute)
    s, b, h, a, t = shape.local_seq, shape.micro_batch_size, shape.hidden, shape.num_heads, shape.tp
    w, m, sbh = shape.width, shape.mask_bytes, s * b * h
    sp = t if shape.sequence_parallel else 1
    if recompute == "full":
        return w * sbh / sp  # the layer input
    # with dropout the attention core is the materialized (math) one; on the CPU it computes
    # 16-bit inputs in fp32 and keeps fp32 copies of q, k, v and fp32 noise as its mask
    ring = shape.cp > 1 and recompute == "none"  # the fp32 ring keeps q, k, v and its output
    math = shape.dropout > 0 and recompute == "none" and not ring
    core_w = max(w, 4) if ring or (math and shape.device_type == "cpu") else w
    core_m = core_w if shape.device_type == "cpu" else m
    # replicated across tp ranks: both norms' inputs, outputs, means and rstds, two masks
    replicated = sbh * (4 * w + 2 * m) + 4 * s * b * w
    # sharded by heads or columns: q, k, v, the attention output, MLP up output and GeLU's
    sharded = sbh * (3 * core_w + w) + 2 * s * b * shape.ffn_hidden * w
    if ring:  # the ring's output beside the projection's input
        sharded += sbh * RING_BYTES
    scores: float
    if math:  # the softmax output, its dropout mask and the dropped scores
        scores = a * s * s * b * (2 * core_w + core_m)
    else:  # the fused kernel's fp32 log-sum-exp (gone too when the core is recomputed)
        scores = 4 * a * s * b if recompute == "none" else 0.0
        if ring and shape.dropout > 0:  # the ring's bool keep mask: its rows of all s keys
            scores += a * s * shape.seq_len * b
    return replicated / sp + (sharded + scores) / t


def _tp_comm(shape: TransformerShape, count: int) -> tuple[Collective, ...]:
    """`count` all-reduces of b·s·h (or, with sequence parallelism, all-gather and
    reduce-scatter pairs of the same tensors)."""
    if shape.tp == 1:
        return ()
    size = shape.tokens * shape.hidden * shape.width
    if not shape.sequence_parallel:
        return tuple(Collective(kind="all_reduce", num_bytes=size, axis="tp") for _ in range(count))
    pair = (
        Collective(kind="all_gather", num_bytes=size, axis="tp"),
        Collective(kind="reduce_scatter", num_bytes=size, axis="tp"),
    )
    return pair * count


def _layer(shape: TransformerShape, index: int) -> BlockCost:
    b_s, h, f, t = shape.tokens, shape.hidden, shape.ffn_hidden, shape.tp
    weighted = (8 * b_s * h * h + 4 * b_s * h * f) / t
    attention = 4 * b_s * shape.seq_len * h / t  # b_s is b·s/cp: 1/cp of the triangle
    sharded = 4 * h * h + 2 * h * f + 3 * h + f  # QKV, projection, MLP GEMMs and their biases
    replicated = 2 * h + 4 * h  # projection and fc2 biases, two layer norms
    boundary = b_s * h * shape.width / (t if shape.sequence_parallel else 1)
    return BlockCost(
        name=f"layer{index}",
        forward_flops=weighted + attention,
        backward_input_flops=weighted + 2 * attention,
        backward_weight_flops=weighted,
        activation_bytes=boundary,
        saved_bytes=layer_activation_bytes(shape, "none"),
        saved_bytes_selective=layer_activation_bytes(shape, "selective"),
        selective_recompute_flops=attention,
        saved_bytes_recompute=layer_activation_bytes(shape, "full"),
        num_params=sharded // t + replicated,
        forward_comm=_tp_comm(shape, 2),
        backward_comm=_tp_comm(shape, 2),
        ring=_ring(shape, attention),
    )


def _ring(shape: TransformerShape, attention: float) -> RingExchange | None:
    """The layer's K/V ring under cp > 1 (its K or V block: b·s/cp·h/tp fp32 elements)."""
    if shape.cp == 1:
        return None
    block = shape.tokens * shape.hidden / shape.tp * RING_BYTES
    return RingExchange(
        cp=shape.cp, block_bytes=block, forward_flops=attention, backward_flops=2 * attention
    )


def _embedding(shape: TransformerShape) -> BlockCost:
    b_s, h, t = shape.tokens, shape.hidden, shape.tp
    sp = t if shape.sequence_parallel else 1
    mask = shape.mask_bytes * b_s * h / sp  # the dropout mask
    return BlockCost(
        name="embedding",
        forward_flops=0.0,
        backward_input_flops=0.0,
        activation_bytes=b_s * h * shape.width / sp,
        saved_bytes=mask + 8 * (b_s + shape.local_seq),  # and the int64 token and position ids
        num_params=shape.vocab_size * h // t + shape.seq_len * h,
        forward_comm=_tp_comm(shape, 1)[-1:],  # all-reduce, or reduce-scatter with SP
        backward_comm=_tp_comm(shape, 1)[:1] if shape.sequence_parallel else (),
    )


def _head(shape: TransformerShape) -> BlockCost:
    b_s, h, v, t = shape.tokens, shape.hidden, shape.vocab_size, shape.tp
    sp = t if shape.sequence_parallel else 1
    logits = 2 * b_s * h * v / t
    # the norm's input, output, mean and rstd, the fp32 log-probabilities, the int64 targets
    saved = shape.width * 2 * b_s * (h + 1) / sp + 4 * b_s * v / t + 8 * b_s
    stats = Collective(kind="all_reduce", num_bytes=3 * 4 * b_s, axis="tp") if t > 1 else None
    gather = _tp_comm(shape, 1)[:1] if shape.sequence_parallel else ()
    return BlockCost(
        name="head",
        forward_flops=logits,
        backward_input_flops=logits,
        backward_weight_flops=logits,
        activation_bytes=4.0,  # the loss
        saved_bytes=saved,
        saved_bytes_recompute=saved,  # the head is not recomputed
        num_params=v * h // t + 2 * h,
        forward_comm=gather + ((stats,) if stats else ()),
        backward_comm=_tp_comm(shape, 1)[-1:],  # input gradients: all-reduce or reduce-scatter
    )


def transformer_block_costs(
    *,
    num_layers: int,
    hidden: int,
    num_heads: int,
    seq_len: int,
    vocab_size: int,
    micro_batch_size: int = 1,
    ffn_hidden: int = 0,
    dtype: str = "bf16",
    layout: Layout | None = None,
    dropout: float = 0.0,
    device_type: str = "cuda",
) -> list[BlockCost]:
    """The blocks of a GPT, per micro-batch and tensor-parallel rank of `layout` (its `tp`
    and `sequence_parallel`; None: one rank holds everything): `embedding`, `layer0` ...
    `layer{L-1}`, then `head` (final norm, LM head, loss). Each block carries all three
    recomputation variants; the plan picks one. `dropout` is the model's dropout
    probability and `device_type` ("cuda" or "cpu") which kernels keep the activations."""
    shape = TransformerShape(
        num_layers=num_layers,
        hidden=hidden,
        num_heads=num_heads,
        seq_len=seq_len,
        vocab_size=vocab_size,
        micro_batch_size=micro_batch_size,
        ffn_hidden=ffn_hidden,
        dtype=dtype,
        layout=layout,
        dropout=dropout,
        device_type=device_type,
    )
    first = _layer(shape, 0)  # the layers differ only by name
    layers = [first, *(_renamed(first, f"layer{i}") for i in range(1, num_layers))]
    return [_embedding(shape), *layers, _head(shape)]


def _renamed(block: BlockCost, name: str) -> BlockCost:
    """`block` under another name, without pricing and checking it again (a planner builds
    the blocks of a hundred layouts of a 128-layer model)."""
    out = object.__new__(BlockCost)
    out.__dict__.update(block.__dict__)
    out.__dict__["name"] = name
    return out
