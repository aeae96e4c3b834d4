"""The analytic source of block costs: a GPT described by its sizes, never instantiated.

`GPTSpec` names a GPT by its sizes; `block_costs` derives its per-block FLOPs and bytes
from `plait.cost.transformer_block_costs` (Narayanan et al. 2021 for FLOPs; activations
are the tensors the model saves, Korthikanti et al. 2022's count with dropout), so 175B
or 1T-parameter models cost nothing to describe.
`build` instantiates the same model as `plait.models.GPT` when it is small enough to be
measured instead; both sources name their blocks `embedding`, `layer0`, ..., `head`.
`MoESpec` does the same for a mixture-of-experts GPT (`plait.cost.moe_block_costs`), whose
block costs also depend on the expert-parallel degree (the experts a rank holds).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.cluster import dtype_bytes
from plait.cost import BlockCost, Layout, MoEShape, moe_block_costs, transformer_block_costs

__all__ = ["GPTSpec", "MoESpec"]


@dataclass(frozen=True, kw_only=True)
class GPTSpec:
    """A GPT by its sizes (`ffn_hidden` 0 means 4 × hidden) and its dropout probability
    (what it keeps for backward depends on it: masks and, with dropout, attention scores)."""

    num_layers: int
    hidden: int
    num_heads: int
    seq_len: int
    vocab_size: int
    ffn_hidden: int = 0
    dropout: float = 0.0  # plait.models.GPTConfig's default

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "num_heads", "seq_len", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.ffn_hidden < 0:
            raise ValueError(f"ffn_hidden={self.ffn_hidden} must be >= 0 (0: 4 × hidden)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1) (a probability)")
        if self.hidden % self.num_heads:
            raise ValueError(
                f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}: "
                "choose a hidden size that is a multiple of the head count"
            )

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    def block_names(self) -> list[str]:
        return ["embedding", *(f"layer{i}" for i in range(self.num_layers)), "head"]

    def block_costs(
        self,
        *,
        micro_batch_size: int = 1,
        dtype: str = "bf16",
        layout: Layout | None = None,
        device_type: str = "cuda",
    ) -> list[BlockCost]:
        """Per-block costs for one micro-batch on one rank of `layout` (None: one rank
        holds everything), with activations kept as `device_type`'s ("cuda" or "cpu")
        kernels keep them."""
        if layout is not None and layout.ep != 1:
            raise ValueError(
                f"ep={layout.ep} but a GPT has no experts to spread: use --model moe-gpt or ep=1"
            )
        return transformer_block_costs(
            num_layers=self.num_layers,
            hidden=self.hidden,
            num_heads=self.num_heads,
            seq_len=self.seq_len,
            vocab_size=self.vocab_size,
            micro_batch_size=micro_batch_size,
            ffn_hidden=self.ffn_hidden,
            dtype=dtype,
            layout=layout,
            dropout=self.dropout,
            device_type=device_type,
        )

    def num_params(self) -> int:
        """Parameters of the whole model (no tensor parallelism)."""
        return sum(b.num_params for b in self.block_costs(dtype="fp32"))

    def train_bytes(self, dtype: str, micro_batch_size: int) -> float:
        """A rough footprint of measuring it: weights and gradients, Adam-free, plus the
        activations of every block for one micro-batch."""
        blocks = self.block_costs(micro_batch_size=micro_batch_size, dtype=dtype)
        state = 2 * self.num_params() * dtype_bytes(dtype)
        return state + sum(b.saved_bytes for b in blocks)

    def build(self) -> object:
        """The same model as a `plait.models.GPT` (fp32, on the CPU)."""
        from plait.models import GPT, GPTConfig

        return GPT(
            GPTConfig(
                vocab_size=self.vocab_size,
                seq_len=self.seq_len,
                num_layers=self.num_layers,
                hidden=self.hidden,
                num_heads=self.num_heads,
                ffn_hidden=self.ffn_hidden or None,
                dropout=self.dropout,
            )
        )


@dataclass(frozen=True, kw_only=True)
class MoESpec(GPTSpec):
    """A MoE-GPT by its sizes: a `GPTSpec` whose every `moe_every`-th layer has
    `num_experts` expert FFNs, `top_k` per token (`plait.models.MoEConfig`), and the
    routing imbalance the cost model assumes (busiest expert's load over the mean)."""

    num_experts: int = 4
    top_k: int = 2
    capacity_factor: float = 1.25  # 0: dropless
    moe_every: int = 2
    shared_expert: bool = False
    imbalance: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.shape()  # checks the expert fields
        if self.moe_every > self.num_layers:
            raise ValueError(
                f"moe_every={self.moe_every} with num_layers={self.num_layers} leaves no MoE "
                "layer: use moe_every <= layers"
            )

    def shape(self) -> MoEShape:
        return MoEShape(
            num_experts=self.num_experts, top_k=self.top_k, capacity_factor=self.capacity_factor,
            moe_every=self.moe_every, shared_expert=self.shared_expert, imbalance=self.imbalance,
        )  # fmt: skip

    def block_costs(
        self,
        *,
        micro_batch_size: int = 1,
        dtype: str = "bf16",
        layout: Layout | None = None,
        device_type: str = "cuda",
    ) -> list[BlockCost]:
        """Per-block costs for one micro-batch on one rank of `layout`: of its `ep` expert-
        parallel ranks and of its `tp` tensor-parallel ones (experts not sharded by tp: the
        tp ranks split the tokens); no sequence parallelism. The MoE cost model keeps
        Korthikanti et al.'s activation accounting: `dropout` and `device_type` are not
        modelled there."""
        del device_type
        return moe_block_costs(
            num_layers=self.num_layers, hidden=self.hidden, num_heads=self.num_heads,
            seq_len=self.seq_len, vocab_size=self.vocab_size, moe=self.shape(),
            micro_batch_size=micro_batch_size, ffn_hidden=self.ffn_hidden, dtype=dtype,
            layout=layout,
        )  # fmt: skip

    def build(self) -> object:
        """The same model as a `plait.models.MoEGPT` (fp32, on the CPU, no dropout)."""
        from plait.models.moe import MoEConfig, MoEGPT

        return MoEGPT(
            MoEConfig(
                vocab_size=self.vocab_size, seq_len=self.seq_len, num_layers=self.num_layers,
                hidden=self.hidden, num_heads=self.num_heads, ffn_hidden=self.ffn_hidden or None,
                num_experts=self.num_experts, top_k=self.top_k,
                capacity_factor=self.capacity_factor or None, moe_every=self.moe_every,
                shared_expert=self.shared_expert,
            )
        )  # fmt: skip
