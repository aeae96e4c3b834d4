"""Analytic per-block costs of a mixture-of-experts GPT (`plait.models.MoEGPT`), per rank.

A MoE layer is a GPT layer whose MLP is replaced by a router and `E` expert FFNs, of which
each token visits `k` (Shazeer et al. 2017; Switch, Fedus et al. 2021, k = 1; GShard,
Lepikhin et al. 2020, k = 2), plus optionally a shared FFN every token passes through
(DeepSeekMoE, Dai et al. 2024). Layer i is a MoE layer when (i + 1) % moe_every == 0, dense
(`plait.cost.transformer`) otherwise. FLOPs per micro-batch of T = b·s tokens, a GEMM
counting 2 FLOPs per multiply-add as Narayanan et al. (2021) do:

- attention as in a dense layer: 8·T·h² + 4·T·s·h;
- router: 2·T·h·E (a linear gate without bias);
- experts: 4·h·f per token copy, T·k·ρ copies on a rank, where ρ = min(imbalance, c) with
  `imbalance` the busiest expert's load over the mean (1.0: balanced) and c the capacity
  factor (0: dropless, ρ = imbalance). How this is modelled: the all-to-all makes the
  ranks of an ep group wait for one another, so every rank is charged the busiest
  expert's load for each of its E/ep experts, which receive T·k/E copies each from each of
  the ep ranks on average: T·k·ρ copies per rank, whatever ep. Capacity caps the busiest
  expert at c × the mean; the copies over it are dropped (they cost nothing and the
  residual carries them). With ep < E this is an upper bound (the busiest expert's
  neighbours on its rank are charged its load too);
- shared expert: 4·T·h·f;
- backward: twice the forward, the weight gradients one forward of the weighted GEMMs.

Parameters: attention (4h² + 4h), two layer norms (4h), router (h·E), the E/ep experts
this rank holds ((E/ep)·(2hf + f + h), `expert_params`) and the shared expert (2hf + f + h).

Activations kept for the backward (Korthikanti et al. 2022's accounting, 16-bit): the
attention half of a layer and its norms, s·b·h·(16 + 5·a·s/h) (scaled by width/2); then the
router's input (T·h·width), its fp32 logits and probabilities (8·T·E), and per dispatched
copy its input and output (2·h·width), the expert's GeLU input and output (2·f·width) and
its token index and gate (12 bytes); the shared expert's GeLU input and output (2·T·f·width).
Selective recomputation drops the 5·a·s/h term, full recomputation keeps the layer input.

Expert parallelism (ep > 1): five all-to-alls per micro-batch over the ep group (axis
"ep"): forward, the E per-expert counts (8·E bytes), then dispatch and combine, each of a
T·k·h·width send buffer of which a rank keeps 1/ep; backward, the gradients of dispatch
and combine (`plait.cost.comm.all_to_all_time`: n - 1 messages per rank). The runtime
sends the token copies in the compute dtype (bf16 under a bf16 autocast).

Tensor parallelism (tp > 1, `plait.models.moe.MoEBlock.tp_plan`): attention and the shared
expert are sharded as in a dense layer (their FLOPs and weights / tp, one all-reduce of
T·h each forward and backward); the router runs whole on every tp rank; the experts are
not sharded by tp, the tp ranks split the tokens instead: T·k·ρ/tp expert copies and a
T·k·h·width/tp all-to-all send buffer per rank, and one all-gather of the layer's T·h
output forward (of its input gradients backward) over tp. ep borrows its ranks from
dp × tp, so the ep group may cross tensor-parallel ranks.

Limits: no sequence parallelism for MoE layers; the load is the same on every layer and
micro-batch; routing's sort and scatter count no FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.cluster import Device
from plait.cost.blocks import BlockCost, Layout
from plait.cost.comm import AxisLinks, Collective
from plait.cost.compress import gradient_sync_time
from plait.cost.memory import ModelState, Optimizer, model_state_bytes, optimizer_step_time
from plait.cost.replicas import DataLayout, expert_dp_degree, hybrid_shard, shard_degree
from plait.cost.transformer import TransformerShape, transformer_block_costs

__all__ = [
    "MoEShape",
    "expert_state_bytes",
    "moe_block_costs",
    "moe_optimizer_step_time",
    "stage_sync_time",
    "weight_gather_time",
]


@dataclass(frozen=True, kw_only=True)
class MoEShape:
    """The experts of a MoE-GPT (the layout's `ep` spreads them over ranks)."""

    num_experts: int
    top_k: int = 2
    capacity_factor: float = 1.25  # 0: dropless
    moe_every: int = 2
    shared_expert: bool = False
    imbalance: float = 1.0  # the busiest expert's load over the mean

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "moe_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} exceeds num_experts={self.num_experts}: use top_k <= experts"
            )
        if not self.capacity_factor >= 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be >= 0 (0: dropless)")
        if not self.imbalance >= 1:
            raise ValueError(
                f"imbalance={self.imbalance} must be >= 1: it is the busiest expert's load "
                "over the mean (1.0: perfectly balanced)"
            )

    def check_ep(self, ep: int) -> None:
        """Raise ValueError unless `ep` ranks can hold the same number of experts each."""
        if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
            raise ValueError(f"ep={ep!r} must be an integer >= 1")
        if self.num_experts % ep:
            raise ValueError(
                f"ep={ep} does not divide num_experts={self.num_experts}: each of the ep "
                "ranks holds the same number of experts; choose ep dividing the experts"
            )

    @property
    def load(self) -> float:
        """ρ: token copies per rank over T·k, capped by the capacity factor."""
        if self.capacity_factor > 0:
            return min(self.imbalance, self.capacity_factor)
        return self.imbalance

    def is_moe(self, layer_index: int) -> bool:
        return (layer_index + 1) % self.moe_every == 0


def _ffn_params(h: int, f: int) -> int:
    return 2 * h * f + f + h  # two GEMMs and their biases


def _moe_layer(shape: TransformerShape, moe: MoEShape, ep: int, index: int) -> BlockCost:
    t, h, f, s = shape.tokens, shape.hidden, shape.ffn_hidden, shape.seq_len
    width, e, k, tp = shape.width, moe.num_experts, moe.top_k, shape.tp
    copies = t * k * moe.load / tp  # the tp ranks of a replica split its tokens
    shared = 1 if moe.shared_expert else 0
    # attention and the shared expert sharded by tp; the router whole on every tp rank
    weighted = (8 * t * h * h + shared * 4 * t * h * f) / tp + 2 * t * h * e + 4 * h * f * copies
    attention = 4 * t * s * h / tp
    experts = e // ep * _ffn_params(h, f)  # not sharded by tp
    router = width * t * h + 8 * t * e + copies * (2 * h * width + 2 * f * width + 12)
    ffn_bytes = router + shared * 2 * t * f * width / tp
    scale = width / 2
    attn_bytes = scale * t * h * (10 + 6 / tp)  # its share of the 10 + 24/tp
    full = attn_bytes + scale * t * h * 5 * shape.num_heads * s / h / tp + ffn_bytes
    a2a = Collective(kind="all_to_all", num_bytes=copies / moe.load * h * width, axis="ep")
    reduce = Collective(
        kind="all_reduce", num_bytes=t * h * width, axis="tp"
    )  # row-parallel outputs
    # tp: the layer's output all-gathered forward, its input gradients backward
    gather = (Collective(kind="all_gather", num_bytes=t * h * width, axis="tp"),) if tp > 1 else ()
    tp_comm = (reduce,) * ((1 + shared) if tp > 1 else 0) + gather
    comm = ((a2a, a2a) if ep > 1 else ()) + tp_comm
    # the forward first exchanges the per-expert counts (E int64: latency-bound)
    counts = Collective(kind="all_to_all", num_bytes=8 * e, axis="ep")
    return BlockCost(
        name=f"layer{index}",
        forward_flops=weighted + attention,
        backward_input_flops=weighted + 2 * attention,
        backward_weight_flops=weighted,
        activation_bytes=t * h * width,
        saved_bytes=full,
        saved_bytes_selective=attn_bytes + ffn_bytes,
        selective_recompute_flops=attention,
        saved_bytes_recompute=scale * 2 * t * h,
        num_params=(4 * h * h + 3 * h + shared * (2 * h * f + f)) // tp
        + 5 * h
        + h * e
        + experts
        + shared * h,
        expert_params=experts,
        forward_comm=((counts,) if ep > 1 else ()) + comm,
        backward_comm=comm,
    )


def moe_block_costs(
    *,
    num_layers: int,
    hidden: int,
    num_heads: int,
    seq_len: int,
    vocab_size: int,
    moe: MoEShape,
    micro_batch_size: int = 1,
    ffn_hidden: int = 0,
    dtype: str = "bf16",
    layout: Layout | None = None,
) -> list[BlockCost]:
    """The blocks of a MoE-GPT per micro-batch on one rank of `layout` (None: one rank
    holds everything): of an ep group of `layout.ep` ranks and a tensor-parallel group of
    `layout.tp`: `embedding`, `layer0` ... `layer{L-1}` (MoE or dense by `moe.moe_every`),
    `head`. No sequence parallelism (the MoE layers take whole sequences)."""
    ep = layout.ep if layout is not None else 1
    moe.check_ep(ep)
    if layout is not None and layout.sequence_parallel:
        raise ValueError(
            "sequence_parallel for a MoE-GPT, whose MoE layers take whole sequences: "
            "turn sequence parallelism off"
        )
    dense = transformer_block_costs(
        num_layers=num_layers, hidden=hidden, num_heads=num_heads, seq_len=seq_len,
        vocab_size=vocab_size, micro_batch_size=micro_batch_size, ffn_hidden=ffn_hidden,
        dtype=dtype, layout=layout,
    )  # fmt: skip
    shape = TransformerShape(
        num_layers=num_layers, hidden=hidden, num_heads=num_heads, seq_len=seq_len,
        vocab_size=vocab_size, micro_batch_size=micro_batch_size, ffn_hidden=ffn_hidden,
        dtype=dtype, layout=layout,
    )  # fmt: skip
    layers = [
        _moe_layer(shape, moe, ep, i) if moe.is_moe(i) else dense[1 + i] for i in range(num_layers)
    ]
    return [dense[0], *layers, dense[-1]]


def expert_state_bytes(
    num_params: float,
    expert_params: float,
    *,
    layout: DataLayout,
    dtype: str = "bf16",
    optimizer: Optimizer = "adam",
) -> ModelState:
    """Model state of a rank of `layout` holding `num_params` parameters of which
    `expert_params` are its experts': ZeRO (`layout.zero`) shards the others over the dp
    ranks, the experts over the ranks holding the same experts (`expert_dp_degree`;
    `model_state_bytes` for each part)."""
    rest = model_state_bytes(
        num_params - expert_params, dtype=dtype, zero_stage=layout.zero,
        dp=shard_degree(layout), optimizer=optimizer,
    )  # fmt: skip
    if not expert_params:
        return rest
    experts = model_state_bytes(
        expert_params, dtype=dtype, zero_stage=layout.zero, dp=expert_dp_degree(layout),
        optimizer=optimizer,
    )  # fmt: skip
    return ModelState(
        rest.params + experts.params, rest.grads + experts.grads, rest.optimizer + experts.optimizer
    )


def stage_sync_time(
    compress: str,
    num_params: float,
    expert_params: float,
    *,
    layout: DataLayout,
    links: AxisLinks,
    device: Device,
    param_bytes: int,
) -> float:
    """Gradient reduction of a stage of `layout` under the runtime's `compress` (the
    plan's codec): the non-expert gradients over axis "dp" with the codec
    (`gradient_sync_time`); the expert gradients over axis "edp" uncompressed, as the
    runtime reduces them, except that ZeRO-2/3 reduce-scatter every gradient in
    fp16/bf16. The collectives each reduction issues follow `layout.zero`
    (`plait.cost.comm.dp_sync_time`)."""
    time = gradient_sync_time(
        compress, num_params - expert_params, zero_stage=layout.zero, links=links,
        device=device, param_bytes=param_bytes,
    )  # fmt: skip
    if expert_params:
        codec = compress if layout.zero >= 2 else "none"
        time += gradient_sync_time(
            codec, expert_params, zero_stage=layout.zero, links=links, axis="edp",
            device=device, param_bytes=param_bytes,
        )  # fmt: skip
    return time


def weight_gather_time(
    num_params: float,
    expert_params: float,
    *,
    layout: DataLayout,
    links: AxisLinks,
    param_bytes: int,
) -> float:
    """ZeRO-3's all-gather of a stage's weights before its forward (and again before its
    backward): the non-expert weights over axis "dp", the experts' over axis "edp".
    Nothing below ZeRO-3 or with one data-parallel rank."""
    if layout.zero < 3 or layout.dp * layout.layout.cp == 1:
        return 0.0
    size = (num_params - expert_params) * param_bytes
    axis = "dp_shard" if hybrid_shard(layout) > 1 else "dp"  # HSDP gathers inside a replica
    time = links.time([Collective(kind="all_gather", num_bytes=size, axis=axis)])
    if expert_params:
        experts = Collective(kind="all_gather", num_bytes=expert_params * param_bytes, axis="edp")
        time += links.time([experts])
    return time


def moe_optimizer_step_time(
    num_params: float,
    expert_params: float,
    device: Device,
    *,
    layout: DataLayout,
    dtype: str = "bf16",
    optimizer: Optimizer = "adam",
) -> float:
    """`optimizer_step_time` of the non-expert shard over the dp ranks plus the expert
    shard over the ranks holding the same experts (`expert_dp_degree`)."""
    rest = optimizer_step_time(
        num_params - expert_params, device, dtype=dtype, zero_stage=layout.zero,
        dp=shard_degree(layout), optimizer=optimizer,
    )  # fmt: skip
    if not expert_params:
        return rest
    return rest + optimizer_step_time(
        expert_params, device, dtype=dtype, zero_stage=layout.zero,
        dp=expert_dp_degree(layout), optimizer=optimizer,
    )  # fmt: skip
