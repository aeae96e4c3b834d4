"""The analytic activation model against what autograd really keeps in plait's GPT layer."""

from __future__ import annotations

import pytest
import torch

from plait.cost import TransformerShape, layer_activation_bytes
from plait.models.gpt import GPTConfig, TransformerBlock

# hidden, heads, seq, micro-batch
SHAPES = [(32, 2, 16, 4), (64, 4, 32, 2), (128, 8, 64, 2), (96, 3, 48, 2), (256, 4, 128, 1)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def saved_bytes(block: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves in one forward of `block`, parameters
    excluded (they are model state, not activations)."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(storages.values())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("hidden", "heads", "seq", "batch"), SHAPES)
def test_layer_activation_bytes_match_what_autograd_saves(
    hidden: int, heads: int, seq: int, batch: int, dtype: str, dropout: float
) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(hidden=hidden, num_heads=heads, seq_len=seq, dropout=dropout)
    block = TransformerBlock(cfg).to(DTYPES[dtype]).train()
    x = torch.randn(batch, seq, hidden, dtype=DTYPES[dtype], requires_grad=True)
    measured = saved_bytes(block, x)
    shape = TransformerShape(num_layers=1, hidden=hidden, num_heads=heads, seq_len=seq,
                             vocab_size=8, micro_batch_size=batch, dtype=dtype,
                             dropout=dropout, device_type="cpu")  # fmt: skip
    predicted = layer_activation_bytes(shape, "none")
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)
