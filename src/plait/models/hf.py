"""Adapters that cut Hugging Face GPT-2 and Llama causal language models into pipeline blocks.

Blocks: an embedding block (token ids [batch, seq] -> hidden [batch, seq, hidden]), one
block per decoder layer (hidden -> hidden), and a head block (final norm and `lm_head`:
hidden -> logits [batch, seq, vocab]). Every boundary carries one tensor. The blocks
reuse the Hugging Face model's own modules (same parameters, same kernels), so
`HFBlocksModel.forward` equals the model's logits and gradients.

What each block rebuilds from the Hugging Face forward, and its limits:

- Positions are `0 .. seq-1` for every sequence: no padding mask, no packed sequences,
  no KV cache (training only).
- The causal mask: with `attn_implementation="sdpa"` (the default) a layer passes no mask
  and SDPA runs with `is_causal=True`, exactly as `create_causal_mask` arranges for an
  unpadded batch; with `"eager"` it passes the same additive mask (0 on and below the
  diagonal, the dtype's minimum above). Other implementations are refused.
- Llama's rotary embedding (Su et al., "RoFormer", 2021) is recomputed inside each layer
  block from its own copy of the model's `LlamaRotaryEmbedding` (a parameter-free buffer),
  rather than sent across every stage boundary as (hidden, cos, sin): it costs one small
  outer product per layer and keeps boundaries to one tensor.
- GPT-2's `Conv1D` layers (weight [in, out]) become `nn.Linear` (weight [out, in], the same
  numbers transposed), and its fused `c_attn` (one [hidden, 3 * hidden] weight producing
  [q | k | v]) becomes `_FusedQKV`: three `nn.Linear` q, k, v whose outputs it
  concatenates. The Hugging Face forward is unchanged: it splits `c_attn`'s output by
  `attn.split_size` and reshapes heads with -1. Why: DTensor's `ColwiseParallel` and
  `RowwiseParallel` shard `nn.Linear` only, and a column shard of the fused weight would
  give one rank the q of some heads with the k of others; q, k and v sharded apart give
  each rank whole heads (Megatron-LM, Shoeybi et al. 2019). The conversion is done in place,
  for every layout (tp=1 too), so a checkpoint's parameter names and values do not depend
  on tp and load under any dp/tp/pp. Its cost: the Hugging Face model passed in is changed
  (convert before building an optimizer over it), and its `save_pretrained` writes
  `attn.c_attn.{q,k,v}.weight` and Linear-shaped weights, which `GPT2LMHeadModel`'s own
  loader does not read back.
- Tied input/output embeddings (GPT-2's default) would make the first and last blocks
  share one weight; a pipeline that puts them on different ranks keeps two copies whose
  gradients nobody sums. Such models are refused unless `allow_tied=True`; the tiny
  configs untie them.

Hugging Face `transformers` is optional (`pip install 'plait[hf]'`); it is imported only
when a function here is called. Tested with transformers 5.23.0, whose decoder layers
take `position_embeddings=(cos, sin)`.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "HFBlocksModel",
    "gpt2_blocks_from_hf",
    "gpt2_blocks_model",
    "llama_blocks_from_hf",
    "llama_blocks_model",
    "tiny_gpt2_config",
    "tiny_llama_config",
]

_SUPPORTED_ATTENTION = ("sdpa", "eager")


def _transformers() -> ModuleType:
    # import_module keeps mypy from type-checking all of transformers (it ships py.typed).
    try:
        return importlib.import_module("transformers")
    except ImportError as err:
        raise ImportError(
            "plait.models.hf needs Hugging Face transformers: pip install 'plait[hf]' "
            "(tested with transformers==5.23.0)"
        ) from err


def _attention(config: Any) -> str:
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    if impl not in _SUPPORTED_ATTENTION:
        raise ValueError(
            f"attn_implementation={impl!r} is not supported by the pipeline block adapters: "
            f"build the model with attn_implementation='sdpa' or 'eager'"
        )
    return str(impl)


def _causal_mask(impl: str, hidden: torch.Tensor) -> torch.Tensor | None:
    """None for SDPA (is_causal); for eager the additive mask [1, 1, seq, seq]."""
    if impl == "sdpa":
        return None
    seq = hidden.shape[1]
    future = torch.ones(seq, seq, dtype=torch.bool, device=hidden.device).triu(1)
    mask = torch.zeros(seq, seq, dtype=hidden.dtype, device=hidden.device)
    return mask.masked_fill(future, torch.finfo(hidden.dtype).min)[None, None]


def _positions(
    hidden: torch.Tensor, positions_of: Callable[[int], torch.Tensor] | None = None
) -> torch.Tensor:
    """[1, seq]: 0..seq-1, or the global positions of a context-parallel shard."""
    if positions_of is not None:
        return positions_of(hidden.shape[1]).to(hidden.device)[None]
    return torch.arange(hidden.shape[1], device=hidden.device)[None]


class HFBlocksModel(nn.Module):
    """A Hugging Face causal LM as blocks: embedding, one per decoder layer, head."""

    def __init__(self, layers: Sequence[nn.Module], config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.config = config

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = ids
        for layer in self.layers:
            x = layer(x)
        return x  # [batch, seq, vocab]

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; `targets` [batch, seq] are the already shifted ids
        (unlike Hugging Face's `labels`, which the model shifts itself)."""
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="mean")

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


class _GPT2Embedding(nn.Module):
    replicated_under_tp = True  # small next to the layers: every tp rank computes it whole

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop
        # the global positions of a sequence shard (context parallelism sets it)
        self.positions_of: Callable[[int], torch.Tensor] | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.wte(ids)  # [batch, seq, hidden]
        return self.drop(hidden + self.wpe(_positions(hidden, self.positions_of)))


class _FusedQKV(nn.Module):
    """GPT-2's `c_attn` as three linears, q, k and v, each [hidden] -> [hidden] (whole heads,
    so tensor parallelism can shard each by columns), returning [q | k | v] as `Conv1D` did."""

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear) -> None:
        super().__init__()
        self.q, self.k, self.v = q, k, v

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # each [batch, seq, hidden/tp]; the attention splits them apart by `split_size`
        return torch.cat([self.q(hidden), self.k(hidden), self.v(hidden)], dim=-1)


def _linear(conv: Any, first: int, last: int) -> nn.Linear:
    """Output features first..last-1 of a `Conv1D` (weight [in, out]) as an `nn.Linear`."""
    weight, bias = conv.weight, conv.bias  # [in, out], [out]
    # built on the meta device, so converting draws nothing from the random generator
    linear = nn.Linear(weight.shape[0], last - first, device="meta")
    linear.weight = nn.Parameter(
        weight.detach()[:, first:last].t().contiguous(), requires_grad=weight.requires_grad
    )
    linear.bias = nn.Parameter(bias.detach()[first:last].clone(), requires_grad=bias.requires_grad)
    return linear


def _linears_for_conv1d(block: Any) -> None:
    """Replace the `Conv1D` layers of one `GPT2Block` in place (see the module docstring)."""
    attn, mlp = block.attn, block.mlp
    if isinstance(attn.c_attn, _FusedQKV):
        return  # converted already: the same Hugging Face model cut into blocks again
    width = attn.split_size  # hidden
    attn.c_attn = _FusedQKV(*(_linear(attn.c_attn, i * width, (i + 1) * width) for i in range(3)))
    for owner in (attn, mlp):
        owner.c_proj = _linear(owner.c_proj, 0, owner.c_proj.weight.shape[1])
    mlp.c_fc = _linear(mlp.c_fc, 0, mlp.c_fc.weight.shape[1])


class _GPT2Layer(nn.Module):
    def __init__(self, block: nn.Module, attn_implementation: str) -> None:
        super().__init__()
        self.block = block
        self.attn_implementation = attn_implementation

    def tp_prepare(self, tp: int) -> None:
        """Under tensor parallelism each rank's q, k and v are hidden/tp wide: the attention
        splits `c_attn`'s output by that width (heads it reshapes with -1)."""
        attn: Any = self.block.attn  # transformers' GPT2Attention
        if attn.num_heads % tp:
            raise ValueError(
                f"tp={tp} must divide the GPT-2 layer's {attn.num_heads} heads: use a tp "
                "that divides the head count, or tp=1"
            )
        attn.split_size = attn.embed_dim // tp

    @staticmethod
    def tp_plan(sequence_parallel: bool) -> dict[str, Any]:
        """Megatron's sharding of a GPT-2 block: q, k, v and c_fc by columns (whole heads),
        both c_proj by rows (their biases and the layer norms stay whole on every rank). Each
        sub-layer all-reduces once in forward; in backward the MLP once and the attention
        three times, as q, k and v each reduce their input's gradient. Needs `tp_prepare`."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        if sequence_parallel:
            raise ValueError(
                "sequence_parallel is not supported for Hugging Face GPT-2 layers: drop it"
            )
        attn, mlp = "block.attn.", "block.mlp."
        col = [attn + "c_attn." + n for n in ("q", "k", "v")] + [mlp + "c_fc"]
        plan: dict[str, Any] = {n: ColwiseParallel() for n in col}
        return {**plan, attn + "c_proj": RowwiseParallel(), mlp + "c_proj": RowwiseParallel()}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        mask = _causal_mask(self.attn_implementation, hidden)
        return self.block(hidden, None, mask)  # (hidden, past_key_values, attention_mask)


class _Head(nn.Module):
    replicated_under_tp = True

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))  # [batch, seq, vocab]


class _LlamaEmbedding(nn.Module):
    replicated_under_tp = True  # small next to the layers: every tp rank computes it whole

    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)  # [batch, seq, hidden]


class _LlamaLayer(nn.Module):
    def __init__(self, layer: nn.Module, rotary: nn.Module, attn_implementation: str) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary
        self.attn_implementation = attn_implementation
        # the global positions of a sequence shard (context parallelism sets it)
        self.positions_of: Callable[[int], torch.Tensor] | None = None

    @staticmethod
    def tp_plan(sequence_parallel: bool) -> dict[str, Any]:
        """Megatron's sharding of a Llama layer: q, k, v, gate and up by columns (whole
        heads, whole kv-heads: tp must divide both counts), o and down by rows. The layer
        reshapes by `head_dim` with -1 heads, so each shard computes its own heads."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        if sequence_parallel:
            raise ValueError(
                "sequence_parallel is not supported for Hugging Face Llama layers: drop it"
            )
        attn, mlp = "layer.self_attn.", "layer.mlp."
        col = [attn + n for n in ("q_proj", "k_proj", "v_proj")] + [
            mlp + "gate_proj",
            mlp + "up_proj",
        ]
        plan: dict[str, Any] = {n: ColwiseParallel() for n in col}
        return {**plan, attn + "o_proj": RowwiseParallel(), mlp + "down_proj": RowwiseParallel()}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = _positions(hidden, self.positions_of)
        cos, sin = self.rotary(hidden, positions)  # each [1, seq, head_dim]
        return self.layer(
            hidden,
            attention_mask=_causal_mask(self.attn_implementation, hidden),
            position_ids=positions,
            position_embeddings=(cos, sin),
        )


def _check_untied(embedding: nn.Embedding, lm_head: nn.Module, allow_tied: bool) -> None:
    if embedding.weight is getattr(lm_head, "weight", None) and not allow_tied:
        raise ValueError(
            "tie_word_embeddings=True: the embedding and head blocks share one weight, whose "
            "gradients plait's pipeline does not sum across stages; build the config with "
            "tie_word_embeddings=False, or pass allow_tied=True if all blocks stay on one rank"
        )


def gpt2_blocks_from_hf(model: Any, *, allow_tied: bool = False) -> HFBlocksModel:
    """Blocks sharing the modules of a `GPT2LMHeadModel`: wte+wpe, one per `GPT2Block`, head.
    Changes `model` in place: its `Conv1D` layers become `nn.Linear` (module docstring)."""
    config = model.config
    if getattr(config, "add_cross_attention", False):
        raise ValueError("add_cross_attention=True: the GPT-2 blocks are decoder-only")
    gpt = model.transformer
    _check_untied(gpt.wte, model.lm_head, allow_tied)
    impl = _attention(config)
    for block in gpt.h:
        _linears_for_conv1d(block)
    layers: list[nn.Module] = [_GPT2Embedding(gpt.wte, gpt.wpe, gpt.drop)]
    layers += [_GPT2Layer(block, impl) for block in gpt.h]
    layers.append(_Head(gpt.ln_f, model.lm_head))
    return HFBlocksModel(layers, config)


def llama_blocks_from_hf(model: Any, *, allow_tied: bool = False) -> HFBlocksModel:
    """Blocks sharing the modules of a `LlamaForCausalLM`: embed, one per decoder layer, head."""
    config = model.config
    inner = model.model
    _check_untied(inner.embed_tokens, model.lm_head, allow_tied)
    impl = _attention(config)
    layers: list[nn.Module] = [_LlamaEmbedding(inner.embed_tokens)]
    layers += [_LlamaLayer(layer, copy.deepcopy(inner.rotary_emb), impl) for layer in inner.layers]
    layers.append(_Head(inner.norm, model.lm_head))
    return HFBlocksModel(layers, config)


def gpt2_blocks_model(config: Any, *, allow_tied: bool = False) -> HFBlocksModel:
    """A randomly initialised `GPT2LMHeadModel` built from `config` (nothing is downloaded),
    as `num_layers + 2` blocks."""
    return gpt2_blocks_from_hf(_transformers().GPT2LMHeadModel(config), allow_tied=allow_tied)


def llama_blocks_model(config: Any, *, allow_tied: bool = False) -> HFBlocksModel:
    """A randomly initialised `LlamaForCausalLM` built from `config` (nothing is downloaded),
    as `num_layers + 2` blocks."""
    return llama_blocks_from_hf(_transformers().LlamaForCausalLM(config), allow_tied=allow_tied)


def tiny_gpt2_config(
    *,
    vocab_size: int = 128,
    seq_len: int = 32,
    num_layers: int = 2,
    hidden: int = 32,
    num_heads: int = 4,
    attn_implementation: str = "sdpa",
) -> Any:
    """A small `GPT2Config` for tests: untied embeddings, no dropout (so a pipeline run can
    be compared with a single-process one)."""
    return _transformers().GPT2Config(
        vocab_size=vocab_size,
        n_positions=seq_len,
        n_embd=hidden,
        n_layer=num_layers,
        n_head=num_heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1,
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )


def tiny_llama_config(
    *,
    vocab_size: int = 128,
    seq_len: int = 32,
    num_layers: int = 2,
    hidden: int = 32,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    attn_implementation: str = "sdpa",
) -> Any:
    """A small `LlamaConfig` for tests: grouped-query attention, untied embeddings."""
    return _transformers().LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=seq_len,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1,
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )
