"""A mixture-of-experts GPT, written as pipeline blocks that carry the router losses along.

The sparsely-gated mixture of experts (Shazeer et al. 2017, "Outrageously Large Neural
Networks") replaces a transformer layer's feed-forward network by `E` expert FFNs and a
router that sends each token to `k` of them: k=1 is Switch (Fedus et al. 2021, "Switch
Transformers"), k=2 is GShard (Lepikhin et al. 2020). Experts hold a fixed capacity of
tokens; the tokens over it are dropped (their expert output is zero and the residual path
carries them). Two auxiliary losses keep the router healthy: Switch's load-balancing loss
(eq. 4) and ST-MoE's router z-loss (Zoph et al. 2022). A shared expert that every token
passes through is DeepSeekMoE's (Dai et al. 2024).

Pipeline contract: every block after the embedding takes and returns `(hidden, aux)`,
`aux` a 1-element fp32 tensor to which each MoE layer adds its coefficient-weighted aux
and z losses, so that the losses of layers on earlier stages reach the loss on the last
stage, and their gradient flows back across the stage boundaries with the hidden states.
The head returns `(logits, aux)`; `MoEGPT.loss` adds `aux` to the cross-entropy, so
validation losses include it too, and evaluation metrics receive `(logits, aux)`.

The layer is split into `Router`, `MoELayer.dispatch`, `Experts` and `MoELayer.combine`
so that expert parallelism can put an all-to-all between dispatch and the experts, and
between the experts and combine. Under tensor parallelism (`MoEBlock.tp_plan`) the
attention and the dense and shared-expert FFNs are sharded as in Megatron-LM; the experts'
weights are not sharded by tp: instead the tp ranks of a replica split the layer's tokens
among them (`MoELayer.tokens`, `plait.parallel.experts.TokenSplit`): each routes every
token but dispatches only its own slice to the experts. Limits: the experts run one after
another (no grouped GEMM); the expert FFN has no dropout; no sequence parallelism for MoE
layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from plait.keyed import KeyedDropout, assign_keys
from plait.models.gpt import GPT, MLP, Attention, GPTConfig, TokenEmbedding
from plait.models.grouped_ffn import grouped_ffn

__all__ = [
    "Dispatch",
    "Experts",
    "LogitsOnly",
    "MoEBlock",
    "MoEConfig",
    "MoEEmbedding",
    "MoEGPT",
    "MoEHead",
    "MoELayer",
    "Router",
    "Routing",
    "TokenSlice",
]

Carry = tuple[torch.Tensor, torch.Tensor]  # (hidden [batch, seq, hidden], aux [1] fp32)
# (experts, grouped [copies, hidden], counts per global expert) -> outputs [copies, hidden]
ExpertsCall = Callable[["Experts", torch.Tensor, list[int]], torch.Tensor]


class TokenSlice(Protocol):
    """This rank's share of a layer's tokens, when several ranks split them (tensor
    parallelism: `plait.parallel.experts.TokenSplit`). `scatter` takes this rank's rows of
    a tensor every rank holds whole ([tokens, ...]; its backward gathers the rows' gradients
    from all ranks); `gather` puts every rank's rows back together ([tokens, ...] from
    this rank's rows; its backward keeps this rank's rows); `rows` says which rows
    [start, stop) of `num_tokens` are this rank's."""

    def rows(self, num_tokens: int) -> tuple[int, int]: ...

    def scatter(self, x: torch.Tensor) -> torch.Tensor: ...

    def gather(self, x: torch.Tensor, num_tokens: int) -> torch.Tensor: ...


@dataclass(frozen=True, kw_only=True)
class MoEConfig(GPTConfig):
    """The GPT's shape plus the mixture of experts.

    `capacity_factor` None or 0 is dropless (every expert takes all the tokens routed to
    it); otherwise an expert takes `ceil(capacity_factor · tokens · top_k / num_experts)`
    token copies of a micro-batch. Layer `i` (from 0) is a MoE layer when
    `(i + 1) % moe_every == 0` (GShard and Switch: every other layer), dense otherwise.
    """

    num_experts: int = 4
    top_k: int = 2
    capacity_factor: float | None = 1.25
    moe_every: int = 2
    shared_expert: bool = False
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_experts < 1 or self.moe_every < 1:
            raise ValueError(
                f"num_experts={self.num_experts} and moe_every={self.moe_every} must be >= 1"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must lie in [1, num_experts={self.num_experts}]")
        if self.capacity_factor is not None and not self.capacity_factor >= 0:
            raise ValueError(
                f"capacity_factor={self.capacity_factor} must be >= 0 (0 or None: dropless)"
            )
        for name in ("aux_loss_coef", "z_loss_coef"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")

    def is_moe(self, layer_index: int) -> bool:
        return (layer_index + 1) % self.moe_every == 0


@dataclass(frozen=True)
class Routing:
    """Where each token goes: its `top_k` experts (in order of preference), their gate
    weights, which copies fit their expert's capacity, and the router's two losses."""

    expert: torch.Tensor  # [tokens, k] int64
    gate: torch.Tensor  # [tokens, k] fp32
    kept: torch.Tensor  # [tokens, k] bool
    aux_loss: torch.Tensor  # [] fp32, Switch eq. 4
    z_loss: torch.Tensor  # [] fp32, ST-MoE eq. 5


class Router(nn.Module):
    """A linear gate, softmax over experts, top-k; capacity and the auxiliary losses.

    For k > 1 the chosen probabilities are renormalised to sum to 1 (GShard's top-2 gate,
    as in Mixtral); for k = 1 the gate weight is the raw probability (Switch), which keeps
    the router on the path of the task loss. Capacity priority (GShard): every token's
    first choice comes before any second choice, and within a choice earlier token
    positions (flattened batch × seq) come first; copies past capacity are dropped.

    Load balancing (Switch eq. 4): `E · Σ_i f_i · P_i`, `f_i` the fraction of the
    token-to-expert assignments (all k choices, before capacity) that pick expert i, `P_i`
    the mean router probability of expert i; 1 when perfectly balanced. The z-loss
    (ST-MoE eq. 5) is the mean over tokens of `logsumexp(logits)²`. Both are computed in
    fp32 over the tokens of one call (a micro-batch).
    """

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden, cfg.num_experts, bias=False)
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.capacity_factor = cfg.capacity_factor or 0.0

    def capacity(self, num_tokens: int) -> int | None:
        """Token copies one expert takes of `num_tokens` tokens; None: dropless."""
        if not self.capacity_factor:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)

    def forward(self, x: torch.Tensor) -> Routing:
        tokens, e = x.shape[0], self.num_experts  # x: [tokens, hidden]
        # fp32 under a bf16/fp16 autocast too, which would otherwise run the gate in low precision
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.gate.weight.float())  # [tokens, E]
        probs = logits.softmax(dim=-1)
        top_p, expert = probs.topk(self.top_k, dim=-1)  # [tokens, k]
        gate = top_p / top_p.sum(dim=-1, keepdim=True) if self.top_k > 1 else top_p
        one_hot = F.one_hot(expert, e)  # [tokens, k, E]
        kept = torch.ones_like(expert, dtype=torch.bool)
        cap = self.capacity(tokens)
        if cap is not None:
            # choice-major order: all first choices, then all second choices
            order = one_hot.transpose(0, 1).reshape(-1, e)  # [k · tokens, E]
            position = (order.cumsum(dim=0) - 1) * order  # rank in its expert's queue
            position = position.sum(dim=-1).view(self.top_k, tokens).t()  # [tokens, k]
            kept = position < cap
        f = one_hot.sum(dim=(0, 1)).float() / (tokens * self.top_k)  # [E]
        aux = e * (f * probs.mean(dim=0)).sum()
        z = logits.logsumexp(dim=-1).square().mean()
        return Routing(expert, gate, kept, aux, z)


class Experts(nn.Module):
    """`E` expert FFNs (GELU) with stacked weights: w1 [E, hidden, ffn], b1 [E, ffn],
    w2 [E, ffn, hidden], b2 [E, hidden]. `local_experts` are the global indices of the
    experts this module holds (all of them here; a slice under expert parallelism)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        e, h, f = cfg.num_experts, cfg.hidden, cfg.ffn
        self.local_experts = range(e)
        self.w1 = nn.Parameter(torch.randn(e, h, f) * 0.02)
        self.b1 = nn.Parameter(torch.zeros(e, f))
        self.w2 = nn.Parameter(torch.randn(e, f, h) * 0.02)
        self.b2 = nn.Parameter(torch.zeros(e, h))

    def forward(self, grouped: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
        """The experts on tokens grouped by expert: `grouped` [sum(counts), hidden] holds
        `counts[i]` tokens for local expert i, in order; returns their outputs, same order."""
        counts = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
        if len(counts) != len(self.local_experts):
            raise ValueError(f"{len(counts)} counts for {len(self.local_experts)} local experts")
        # one autograd node for all experts: no per-expert ops, cat or weight-slice stack
        return grouped_ffn(grouped, self.w1, self.b1, self.w2, self.b2, counts)


@dataclass(frozen=True)
class Dispatch:
    """Token copies sorted by expert: `grouped` [copies, hidden], `counts` per expert,
    and for each copy its token (`token` [copies]) and gate weight (`gate` [copies])."""

    grouped: torch.Tensor
    counts: list[int]
    token: torch.Tensor
    gate: torch.Tensor


class MoELayer(nn.Module):
    """Router, experts and an optional shared expert: the feed-forward of a MoE layer.

    `forward(x)` [batch, seq, hidden] returns the output and the layer's weighted loss
    `aux_loss_coef · aux + z_loss_coef · z` ([] fp32)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.shared = MLP(cfg) if cfg.shared_expert else None
        self.aux_loss_coef, self.z_loss_coef = cfg.aux_loss_coef, cfg.z_loss_coef
        # expert parallelism (plait.parallel.experts) puts its all-to-alls here, between
        # dispatch and combine; None runs the local experts on the local tokens
        self.exchange: ExpertsCall | None = None
        # tensor parallelism: the tp ranks dispatch a slice of the tokens each (None: all)
        self.tokens: TokenSlice | None = None

    def dispatch(self, x: torch.Tensor, routing: Routing) -> Dispatch:
        """The kept token copies of `x` [tokens, hidden], stably sorted by expert."""
        tokens, k = routing.expert.shape
        token = torch.arange(tokens, device=x.device).unsqueeze(1).expand(tokens, k)
        keep = routing.kept.flatten()
        expert = routing.expert.flatten()[keep]
        order = torch.argsort(expert, stable=True)
        token = token.flatten()[keep][order]
        counts = torch.bincount(expert, minlength=self.router.num_experts).tolist()
        return Dispatch(x[token], counts, token, routing.gate.flatten()[keep][order])

    def combine(self, out: torch.Tensor, sent: Dispatch, num_tokens: int) -> torch.Tensor:
        """Each token's expert outputs `out` [copies, hidden] summed, gate-weighted."""
        weighted = out * sent.gate.to(out.dtype).unsqueeze(1)
        y = out.new_zeros(num_tokens, out.shape[1])
        return y.index_add(0, sent.token, weighted)  # [tokens, hidden]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(-1, x.shape[-1])  # [tokens, hidden]
        # the router sees the whole micro-batch on every tp rank (its capacity, dropping
        # and losses are the unsplit layer's, and its gradients agree over tp), then each
        # rank dispatches its slice of the tokens
        routing = self.router(flat)
        mine, part = flat, routing
        if self.tokens is not None:  # [tokens/tp, hidden]
            mine = self.tokens.scatter(flat)
            rows = slice(*self.tokens.rows(flat.shape[0]))
            part = replace(routing, expert=routing.expert[rows], kept=routing.kept[rows],
                           gate=self.tokens.scatter(routing.gate))  # fmt: skip
        sent = self.dispatch(mine, part)
        if self.exchange is None:
            out = self.experts(sent.grouped, sent.counts)
        else:
            out = self.exchange(self.experts, sent.grouped, sent.counts)
        y = self.combine(out, sent, mine.shape[0])
        if self.tokens is not None:
            y = self.tokens.gather(y, flat.shape[0])  # [tokens, hidden]
        if self.shared is not None:
            y = y + self.shared(flat)
        loss = self.aux_loss_coef * routing.aux_loss + self.z_loss_coef * routing.z_loss
        return y.view_as(x), loss


class MoEEmbedding(TokenEmbedding):
    """Token ids -> (hidden states, aux = [0.] fp32): starts the carried auxiliary loss."""

    def forward(self, ids: torch.Tensor) -> Carry:  # type: ignore[override]
        aux = torch.zeros(1, dtype=torch.float32, device=ids.device)
        return super().forward(ids), aux


class MoEBlock(nn.Module):
    """Pre-norm transformer layer whose feed-forward is a `MoELayer` (or a dense MLP):
    (x, aux) -> (x + attn(ln(x)), then + ffn(ln(x)), aux + the layer's router losses)."""

    def __init__(self, cfg: MoEConfig, *, moe: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.ffn: nn.Module = MoELayer(cfg) if moe else MLP(cfg)
        self.drop = KeyedDropout(cfg.dropout)
        self.drop_mlp = KeyedDropout(cfg.dropout)

    def forward(self, carry: Carry) -> Carry:
        x, aux = carry
        x = x + self.drop(self.attn(self.ln1(x)))
        if isinstance(self.ffn, MoELayer):
            y, loss = self.ffn(self.ln2(x))
            aux = aux + loss.reshape(1)
        else:
            y = self.ffn(self.ln2(x))
        return x + self.drop_mlp(y), aux

    def tp_plan(self, sequence_parallel: bool) -> dict[str, Any]:
        """Megatron's sharding of the attention and of a dense or shared-expert FFN (q, k,
        v and the first linear by columns, the projections back by rows); the router and
        the experts stay whole on every tp rank, which split the tokens instead
        (`MoELayer.tokens`). No sequence parallelism: the MoE layer takes whole sequences."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        if sequence_parallel:
            raise ValueError(
                "sequence_parallel with a mixture-of-experts model: its MoE layers split "
                "whole sequences' tokens over tp themselves; drop sequence_parallel"
            )
        ffn = "ffn.shared" if isinstance(self.ffn, MoELayer) else "ffn"
        plan: dict[str, Any] = {n: ColwiseParallel() for n in ("attn.q", "attn.k", "attn.v")}
        plan["attn.proj"] = RowwiseParallel()
        if not isinstance(self.ffn, MoELayer) or self.ffn.shared is not None:
            plan[f"{ffn}.up"], plan[f"{ffn}.down"] = ColwiseParallel(), RowwiseParallel()
        return plan


class MoEHead(nn.Module):
    """Final layer norm and LM head: (x, aux) -> (logits [b, s, vocab], aux)."""

    replicated_under_tp = True

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, carry: Carry) -> Carry:
        x, aux = carry
        return self.out(self.ln(x)), aux


class MoEGPT(nn.Module):
    """Embedding, `num_layers` layers (every `moe_every`-th a MoE layer), head:
    `num_layers + 2` pipeline blocks, like `GPT`. `forward(ids)` returns (logits, aux)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(
            [
                MoEEmbedding(cfg),
                *(MoEBlock(cfg, moe=cfg.is_moe(i)) for i in range(cfg.num_layers)),
                MoEHead(cfg),
            ]
        )
        self.apply(GPT._init)  # the stacked expert weights keep their own init
        assign_keys(self)

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, ids: torch.Tensor) -> Carry:
        x: object = ids
        for layer in self.layers:
            x = layer(x)
        return x  # type: ignore[return-value]

    @staticmethod
    def loss(out: Carry, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of the logits plus the carried router losses."""
        logits, aux = out
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="mean")
        return ce + aux.sum()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class LogitsOnly(nn.Module):
    """A `MoEGPT` as ids -> logits (for `plait.models.gpt.generate`)."""

    def __init__(self, model: MoEGPT) -> None:
        super().__init__()
        self.model, self.cfg = model, model.cfg

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)[0]
