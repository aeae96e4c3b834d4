"""Hugging Face GPT-2 and Llama, cut into blocks, compute what the original models compute."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from plait.blocks import as_blocks, equal_split, stage_modules  # noqa: E402
from plait.models.hf import (  # noqa: E402
    HFBlocksModel,
    _attention,
    gpt2_blocks_from_hf,
    gpt2_blocks_model,
    llama_blocks_from_hf,
    llama_blocks_model,
    tiny_gpt2_config,
    tiny_llama_config,
)

VOCAB = 128
FAMILIES = {
    "gpt2": (tiny_gpt2_config, "GPT2LMHeadModel", gpt2_blocks_from_hf),
    "llama": (tiny_llama_config, "LlamaForCausalLM", llama_blocks_from_hf),
}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls on a shared 2-core machine: threads only wait
    yield
    torch.set_num_threads(before)


def _pair(family: str, attn: str) -> tuple[nn.Module, HFBlocksModel]:
    """(Hugging Face model, blocks model sharing its modules), random weights, seeded."""
    make_config, cls, from_hf = FAMILIES[family]
    torch.manual_seed(0)
    hf = getattr(transformers, cls)(make_config(vocab_size=VOCAB, attn_implementation=attn))
    adapter: Callable[[nn.Module], HFBlocksModel] = from_hf
    return hf, adapter(hf)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_blocks_compute_the_hf_logits(family: str, attn: str) -> None:
    hf, model = _pair(family, attn)
    hf.eval()
    ids = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(1))
    blocks = as_blocks(model)
    assert len(blocks) == 2 + 2  # embedding, two decoder layers, head
    out: object = ids
    for stage in stage_modules(blocks, equal_split(len(blocks), 3)):
        out = stage(out)
    torch.testing.assert_close(out, hf(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_blocks_are_causal(family: str) -> None:
    _, model = _pair(family, "eager")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % VOCAB  # change only the future
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[:, :8], model(changed)[:, :8])
        assert not torch.allclose(model(ids)[:, 8:], model(changed)[:, 8:])


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_gradients_equal_the_hf_gradients(family: str) -> None:
    hf, model = _pair(family, "sdpa")
    hf.train()  # the tiny configs have no dropout, so training mode is deterministic
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 17), generator=gen)
    inputs, targets = ids[:, :-1], ids[:, 1:]

    hf(inputs, labels=inputs).loss.backward()  # HF shifts `labels` itself
    expected = {name: p.grad.clone() for name, p in hf.named_parameters() if p.grad is not None}
    assert len(expected) == len(list(hf.parameters()))
    hf.zero_grad(set_to_none=True)

    HFBlocksModel.loss(model(inputs)[:, :-1], targets[:, :-1]).backward()
    for name, p in hf.named_parameters():  # the blocks hold the very same parameters
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert {id(p) for p in model.parameters()} == {id(p) for p in hf.parameters()}


@pytest.mark.parametrize(
    ("build", "make_config"),
    [(gpt2_blocks_model, tiny_gpt2_config), (llama_blocks_model, tiny_llama_config)],
)
def test_models_built_from_configs(build: Callable[..., Any], make_config: Any) -> None:
    torch.manual_seed(0)
    model = build(make_config(num_layers=3))
    assert len(model.blocks()) == 5
    logits = model(torch.randint(0, 128, (2, 8)))
    assert logits.shape == (2, 8, 128)


def test_tied_embeddings_are_refused_unless_allowed() -> None:
    config = tiny_gpt2_config()
    config.tie_word_embeddings = True
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        gpt2_blocks_model(config)
    model = gpt2_blocks_model(config, allow_tied=True)
    embedding, head = model.blocks()[0], model.blocks()[-1]
    assert getattr(embedding, "wte").weight is getattr(head, "lm_head").weight  # noqa: B009


def test_unsupported_attention_names_the_fix() -> None:
    with pytest.raises(ValueError, match=r"attn_implementation='flex_attention'.*'sdpa'"):
        _attention(SimpleNamespace(_attn_implementation="flex_attention"))


def _conv1d_layout(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors named as in the converted GPT-2 (q, k, v and nn.Linear, weight [out, in]),
    renamed and reshaped as the original `Conv1D` layers hold them (weight [in, out])."""
    out = {}
    for name, t in grads.items():
        if ".c_attn.q." in name:
            parts = [grads[name.replace(".q.", f".{n}.")] for n in "qkv"]
            joined = torch.cat([p.t() for p in parts], 1) if t.ndim == 2 else torch.cat(parts)
            out[name.replace(".c_attn.q.", ".c_attn.")] = joined
        elif ".c_attn." not in name:
            is_linear = name.endswith(".weight") and (".c_proj." in name or ".c_fc." in name)
            out[name] = t.t() if is_linear else t
    return out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_gpt2_with_linears_computes_what_conv1d_computes(attn: str) -> None:
    """The conversion to q, k, v and nn.Linear changes neither the logits nor the gradients
    of an untouched copy of the same Hugging Face model; it draws no random numbers."""
    torch.manual_seed(0)
    original = transformers.GPT2LMHeadModel(tiny_gpt2_config(vocab_size=VOCAB,
                                                             attn_implementation=attn))  # fmt: skip
    converted = copy.deepcopy(original)
    rng = torch.get_rng_state()
    model = gpt2_blocks_from_hf(converted)
    assert torch.equal(rng, torch.get_rng_state())
    assert {id(p) for p in model.parameters()} == {id(p) for p in converted.parameters()}
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))

    expected = original(ids).logits
    logits = model(ids)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(converted(ids).logits, expected, rtol=1e-5, atol=1e-5)
    weights = _conv1d_layout({n: p.detach() for n, p in converted.named_parameters()})
    assert weights.keys() == dict(original.named_parameters()).keys()
    for name, p in original.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0, msg=name)

    HFBlocksModel.loss(expected[:, :-1], ids[:, 1:]).backward()
    HFBlocksModel.loss(logits[:, :-1], ids[:, 1:]).backward()
    grads = _conv1d_layout({n: p.grad for n, p in converted.named_parameters()})  # type: ignore[misc]
    for name, p in original.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_gpt2_tensor_parallel_refusals_name_the_fix() -> None:
    layer = gpt2_blocks_model(tiny_gpt2_config(num_heads=4)).blocks()[1]
    with pytest.raises(ValueError, match=r"sequence_parallel is not supported.*drop it"):
        layer.tp_plan(True)  # type: ignore[operator]
    with pytest.raises(ValueError, match="tp=3 must divide the GPT-2 layer's 4 heads"):
        layer.tp_prepare(3)  # type: ignore[operator]
    layer.tp_prepare(2)  # type: ignore[operator]
    assert layer.get_submodule("block.attn").split_size == 32 // 2  # q, k, v: hidden/tp each
