"""Hugging Face model folders in and out of plait: a local folder's weights loaded into the
block adapters of `plait.models.hf`, and a model's weights written as a folder that
`transformers.AutoModelForCausalLM.from_pretrained` loads.

In: `load_pretrained(path)` is `from_pretrained` (fp32, SDPA attention; config.json with
`model.safetensors` or sharded safetensors and their index) followed by the block
adapter, so the weights are in place before the model is cut into stages and any layout
loads them. Tied input and output embeddings (GPT-2's default) are untied: the head gets
its own copy of the embedding, because the pipeline may put the two on different ranks
(`plait.models.hf`); after training they differ, so an export says
`tie_word_embeddings=False`.

Out: `hf_state_dict` renames a block model's state to the names transformers uses: GPT-2's
q, k and v linears fused back into `c_attn` and every `nn.Linear` weight transposed back to
`Conv1D`'s [in, out]; Llama's names only lose the block prefix. plait's own GPT is exactly a
GPT-2 with exact GELU (`activation_function="gelu"`) and untied embeddings, so it exports as
one too (`gpt_as_gpt2_state`). `write_pretrained` loads the renamed state into a freshly built
transformers model (strictly: every name and shape must match) and saves it with
`save_pretrained`, which writes config.json and model.safetensors.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait.models.hf import (
    HFBlocksModel,
    _transformers,
    gpt2_blocks_from_hf,
    llama_blocks_from_hf,
)

__all__ = [
    "blocks_from_hf_model",
    "gpt2_config_for",
    "gpt_as_gpt2_state",
    "hf_state_dict",
    "load_pretrained",
    "write_pretrained",
]


def _quiet(tf: Any) -> None:
    """No progress bars from transformers in the workers' output."""
    tf.utils.logging.disable_progress_bar()


def blocks_from_hf_model(model: Any) -> HFBlocksModel:
    """Blocks of a transformers causal LM of the GPT-2 or Llama family (converted in place)."""
    if model.config.model_type == "gpt2":
        return gpt2_blocks_from_hf(model)
    return llama_blocks_from_hf(model)


def _untie(model: Any) -> None:
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and head.weight is embedding.weight:
        head.weight = nn.Parameter(embedding.weight.detach().clone())
        model.config.tie_word_embeddings = False


def load_pretrained(path: str) -> HFBlocksModel:
    """The model of the Hugging Face folder at `path` as blocks, its weights loaded."""
    tf = _transformers()
    _quiet(tf)
    model, info = tf.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True
    )
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        raise ValueError(
            f"init_from={path!r}: the weights lack {missing[:4]}{'...' if len(missing) > 4 else ''}"
            ": the folder's model.safetensors does not match its config.json"
        )
    _untie(model)
    return blocks_from_hf_model(model)


_GPT2_LINEAR = re.compile(r"\.(attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
_GPT2_QKV = re.compile(r"^(.*\.attn\.c_attn)\.([qkv])\.(weight|bias)$")


def _renamed(name: str, head: int, family: str) -> str:
    """A block model's parameter name as transformers names it."""
    index, _, rest = name.removeprefix("layers.").partition(".")
    i = int(index)
    if family == "gpt2":
        inner, layer, final = "transformer.", "block.", {"norm.": "transformer.ln_f."}
    else:
        inner, layer, final = "model.", "layer.", {"norm.": "model.norm."}
    if i == 0:
        return inner + rest
    if i < head:
        return f"{inner}{'h' if family == 'gpt2' else 'layers'}.{i - 1}.{rest.removeprefix(layer)}"
    for prefix, target in final.items():
        if rest.startswith(prefix):
            return target + rest.removeprefix(prefix)
    return rest  # lm_head.weight


def hf_state_dict(state: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """A block model's state (`layers.3.block.attn.c_attn.q.weight`) under transformers'
    names (`transformer.h.2.attn.c_attn.weight`, fused and transposed for GPT-2)."""
    head = max(int(k.split(".")[1]) for k in state)  # the last block's index
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for name, tensor in state.items():
        target = _renamed(name, head, family)
        qkv = _GPT2_QKV.match(target) if family == "gpt2" else None
        if qkv is not None:
            base, part, kind = qkv.groups()
            fused.setdefault(f"{base}.{kind}", {}).setdefault(kind, {})[part] = tensor
        elif family == "gpt2" and _GPT2_LINEAR.search(target):
            out[target] = tensor.t().contiguous()  # Linear [out, in] -> Conv1D [in, out]
        else:
            out[target] = tensor
    for target, by_kind in fused.items():
        for kind, parts in by_kind.items():
            q, k, v = (parts[p] for p in "qkv")
            # Conv1D's fused weight is [in, 3 * out] = [q | k | v] along its columns
            weight = kind == "weight"
            out[target] = torch.cat([q.t(), k.t(), v.t()], 1) if weight else torch.cat([q, k, v])
    return out


_GPT_NAMES = [
    ("tok.", "wte."), ("pos.", "wpe."), ("ln1.", "block.ln_1."), ("ln2.", "block.ln_2."),
    ("attn.proj.", "block.attn.c_proj."), ("attn.", "block.attn.c_attn."),
    ("mlp.up.", "block.mlp.c_fc."), ("mlp.down.", "block.mlp.c_proj."), ("ln.", "norm."),
    ("out.", "lm_head."),
]  # fmt: skip


def gpt_as_gpt2_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """plait GPT's state under the names of the GPT-2 block model (then `hf_state_dict`)."""
    out = {}
    for name, tensor in state.items():
        index, _, rest = name.removeprefix("layers.").partition(".")
        for mine, theirs in _GPT_NAMES:
            if rest.startswith(mine):
                rest = theirs + rest.removeprefix(mine)
                break
        out[f"layers.{index}.{rest}"] = tensor
    return out


def gpt2_config_for(config: dict[str, Any]) -> Any:
    """The `GPT2Config` that computes what plait's `GPT` of `config` (a GPTConfig as a
    dict) computes."""
    dropout, vocab = config.get("dropout", 0.0), config["vocab_size"]
    return _transformers().GPT2Config(
        vocab_size=vocab, n_positions=config["seq_len"], n_embd=config["hidden"],
        n_layer=config["num_layers"], n_head=config["num_heads"],
        n_inner=config.get("ffn_hidden"), activation_function="gelu",
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, layer_norm_epsilon=1e-5,
        bos_token_id=vocab - 1, eos_token_id=vocab - 1, tie_word_embeddings=False,
    )  # fmt: skip


def write_pretrained(state: dict[str, torch.Tensor], config: Any, out: Path) -> Path:
    """Save `state` (transformers' names) of the model `config` describes as a folder
    `from_pretrained` loads: config.json and model.safetensors."""
    tf = _transformers()
    _quiet(tf)
    config.tie_word_embeddings = False  # plait trained the two apart (module docstring)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("inv_freq")]
    if missing or unexpected:
        raise ValueError(
            f"the checkpoint's weights do not fit a {type(model).__name__}: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}"
        )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    return out
