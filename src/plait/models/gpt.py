"""A GPT-style decoder-only transformer, written as pipeline blocks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from plait.keyed import CpShard, Draw, KeyedDropout, assign_keys, current, keep_mask, mask_like

__all__ = [
    "GPT",
    "MLP",
    "Attention",
    "GPTConfig",
    "Head",
    "TokenEmbedding",
    "TransformerBlock",
    "generate",
]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """The reference GPT's shape. The defaults are `plait train`'s (`plait.config.ModelConfig`:
    4 layers, hidden 128, 4 heads, 64 tokens), with the stdlib corpus's 96 characters."""

    vocab_size: int = 96
    seq_len: int = 64
    num_layers: int = 4
    hidden: int = 128
    num_heads: int = 4
    ffn_hidden: int | None = None  # default 4 × hidden
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_layers", "hidden", "num_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.hidden % self.num_heads:
            raise ValueError(
                f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}: "
                "choose a hidden size that is a multiple of the head count"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden


class TokenEmbedding(nn.Module):
    """Token ids [batch, seq] -> hidden states [batch, seq, hidden] (token + position)."""

    replicated_under_tp = True  # small next to the layers: every tp rank computes it whole

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.drop = KeyedDropout(cfg.dropout)
        # the global positions of a shard of the sequence (context parallelism sets it:
        # local length -> positions); None: the sequence is whole
        self.positions_of: Callable[[int], torch.Tensor] | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.positions_of is None:
            positions = torch.arange(ids.shape[1], device=ids.device)
        else:
            positions = self.positions_of(ids.shape[1]).to(ids.device)
        return self.drop(self.tok(ids) + self.pos(positions))  # [batch, seq, hidden]


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q, k, v projections (so that tensor
    parallelism can shard them column-wise by heads)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.hidden // cfg.num_heads
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        self.k = nn.Linear(cfg.hidden, cfg.hidden)
        self.v = nn.Linear(cfg.hidden, cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.dropout = cfg.dropout
        # keyed attention dropout (plait.keyed): its site, and which of the model's heads
        # this rank's projections compute (tensor parallelism sets the offset)
        self.num_heads, self.head_offset, self.site = cfg.num_heads, 0, 0
        # selective recomputation (Korthikanti et al. 2022): keep q, k, v, recompute the
        # attention core in backward instead of storing its intermediates
        self.recompute_core = False
        # causal attention over a sequence split among ranks (context parallelism sets
        # it: plait.parallel.context.ring_attention on the cp group); None: SDPA
        self.ring: Callable[..., torch.Tensor] | None = None
        # with the ring: a shard's length -> (its queries' global positions, the global
        # length), which key the ring's attention dropout (plait.keyed.CpShard)
        self.cp_shard: CpShard | None = None

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        draw = current()
        keyed = draw is not None and self.training and self.dropout > 0.0
        if self.ring is not None:
            if not keyed:
                return self.ring(q, k, v)
            assert draw is not None and self.cp_shard is not None, "cp wires ring and shard"
            return self.ring(q, k, v, keep=self._ring_keep(q, draw, self.cp_shard),
                             p=self.dropout)  # fmt: skip
        if keyed:
            assert draw is not None
            return self._keyed_core(q, k, v, draw)
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )

    def _keyed_core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, draw: Draw
    ) -> torch.Tensor:
        """Attention with the dropout of its probabilities keyed by global head (SDPA
        draws its mask from the process's generator)."""
        b, _, s, d = q.shape
        scores = (q @ k.transpose(-2, -1)) * d**-0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        keep = mask_like(probs, draw, self.site, self.dropout, offsets=(0, self.head_offset, 0, 0),
                         global_shape=(b, self.num_heads, s, s))  # fmt: skip
        return (probs * keep / (1.0 - self.dropout)) @ v

    def _ring_keep(self, q: torch.Tensor, draw: Draw, shard: CpShard) -> torch.Tensor:
        """The keep mask [b, heads, n, S] of this rank's n queries (at their global
        positions) against every global key: rows of `_keyed_core`'s mask."""
        b, heads, n, _ = q.shape
        rows, seq_len = shard(n)
        return keep_mask(draw, self.site, self.dropout, (b, self.num_heads, seq_len, seq_len),
                         (0, self.head_offset, rows.to(q.device), 0), (b, heads, n, seq_len),
                         q.device)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: the projection's width decides, so a tensor-parallel shard of the
        # projections computes its own heads unchanged.  [b, heads, s, head_dim]
        q, k, v = (
            t.view(b, s, -1, self.head_dim).transpose(1, 2)
            for t in (self.q(x), self.k(x), self.v(x))
        )
        if self.recompute_core and torch.is_grad_enabled():
            y = checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            y = self._core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))  # [b, s, hidden]


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden, cfg.ffn)
        self.down = nn.Linear(cfg.ffn, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class TransformerBlock(nn.Module):
    """Pre-norm transformer layer: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)
        self.drop = KeyedDropout(cfg.dropout)
        self.drop_mlp = KeyedDropout(cfg.dropout)  # its own site: another mask than attn's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop_mlp(self.mlp(self.ln2(x)))

    @staticmethod
    def tp_plan(sequence_parallel: bool) -> dict[str, Any]:
        """Megatron's sharding: q, k, v and mlp.up by columns (heads), proj and mlp.down by
        rows. With sequence parallelism the layer norms work on sequence shards inside the
        block; the block still takes and returns the whole sequence."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            PrepareModuleInputOutput,
            RowwiseParallel,
            SequenceParallel,
        )

        col = {n: ColwiseParallel() for n in ("attn.q", "attn.k", "attn.v", "mlp.up")}
        if not sequence_parallel:
            return {**col, "attn.proj": RowwiseParallel(), "mlp.down": RowwiseParallel()}
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        return {
            # enter as the whole sequence, work on shards, leave as the whole sequence
            "": PrepareModuleInputOutput(
                input_layouts=(Replicate(),),
                desired_input_layouts=(Shard(1),),
                use_local_input=True,
                output_layouts=(Shard(1),),
                desired_output_layouts=(Replicate(),),
            ),
            "ln1": SequenceParallel(),
            "attn": gather,
            **col,
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "ln2": SequenceParallel(),
            "mlp": gather,
            "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        }


class Head(nn.Module):
    """Final layer norm and the language-model head: [b, s, hidden] -> logits [b, s, vocab]."""

    replicated_under_tp = True

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class GPT(nn.Module):
    """Embedding, `num_layers` transformer blocks, head: `num_layers + 2` pipeline blocks."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(
            [
                TokenEmbedding(cfg),
                *(TransformerBlock(cfg) for _ in range(cfg.num_layers)),
                Head(cfg),
            ]
        )
        self.apply(self._init)
        assign_keys(self)  # dropout sites by name in the whole model, whatever the layout

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x: torch.Tensor = ids
        for layer in self.layers:
            x = layer(x)
        return x

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; `targets` [batch, seq] are the shifted ids."""
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="mean")

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


@torch.no_grad()
def generate(
    model: GPT,
    prompt: torch.Tensor,
    num_tokens: int,
    *,
    temperature: float = 0.8,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample `num_tokens` continuations of `prompt` [seq] (ids, on the model's device);
    returns prompt + sample.

    A plait `GPT` keeps each layer's keys and values (a KV cache), so each new token costs
    one position's forward instead of the whole window's. Positions are absolute and end
    at `seq_len`: when the window is full, the context restarts from its newest half
    (computed afresh), rather than sliding by one token, which would recompute the whole
    window per token. Any other model (a MoE-GPT, a Hugging Face block stack) runs its
    whole window per token, sliding."""
    was_training = model.training
    model.eval()
    ids = prompt.clone()
    cached = isinstance(model, GPT)
    cache: _KVCache | None = None
    for _ in range(num_tokens):
        if not cached:
            logits = model(ids[-model.cfg.seq_len :].unsqueeze(0))[0, -1]
        else:
            if cache is None or cache.length >= model.cfg.seq_len:
                context = ids[-max(1, model.cfg.seq_len // 2) :] if cache is not None else ids
                cache = _KVCache(len(model.layers) - 2)
                logits = _cached_forward(model, context[-model.cfg.seq_len :], cache)
            else:
                logits = _cached_forward(model, ids[-1:], cache)
        probs = torch.softmax(logits / max(temperature, 1e-5), dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)])
    model.train(was_training)
    return ids


class _KVCache:
    """Each transformer layer's keys and values [1, heads, positions, head_dim] so far."""

    def __init__(self, layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.length = 0


def _cached_forward(model: GPT, ids: torch.Tensor, cache: _KVCache) -> torch.Tensor:
    """The logits [vocab] after `ids` [new] continue the cached positions (all of them at
    once when the cache is empty); the cache takes the new keys and values."""
    embed, *layers, head = model.layers
    assert isinstance(embed, TokenEmbedding)
    positions = torch.arange(cache.length, cache.length + len(ids), device=ids.device)
    x = embed.tok(ids.unsqueeze(0)) + embed.pos(positions)  # [1, new, hidden]
    for i, block in enumerate(layers):
        assert isinstance(block, TransformerBlock)
        attn = block.attn
        h = block.ln1(x)
        q, k, v = (
            t.view(1, len(ids), -1, attn.head_dim).transpose(1, 2)
            for t in (attn.q(h), attn.k(h), attn.v(h))
        )  # [1, heads, new, head_dim]
        before_k, before_v = cache.keys[i], cache.values[i]
        if before_k is not None and before_v is not None:
            k, v = torch.cat([before_k, k], dim=2), torch.cat([before_v, v], dim=2)
        cache.keys[i], cache.values[i] = k, v
        # a prefill attends causally; one new token attends to every cached position
        y = F.scaled_dot_product_attention(q, k, v, is_causal=before_k is None)
        x = x + attn.proj(y.transpose(1, 2).reshape(1, len(ids), -1))
        x = x + block.mlp(block.ln2(x))
    cache.length += len(ids)
    return head(x)[0, -1]
