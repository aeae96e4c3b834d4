"""Sampling from a GPT with its key/value cache against the whole-window forward."""

from __future__ import annotations

import torch

from plait.models import GPT, GPTConfig
from plait.models.gpt import _cached_forward, _KVCache, generate


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=11, seq_len=8, num_layers=2, hidden=16, num_heads=2)).eval()


def test_cached_logits_equal_the_full_forwards_at_every_position() -> None:
    model, ids = _model(), torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    with torch.no_grad():
        full = model(ids.unsqueeze(0))[0]  # [seq, vocab]
        cache = _KVCache(2)
        first = _cached_forward(model, ids[:3], cache)  # a prefill of three
        torch.testing.assert_close(first, full[2], rtol=1e-5, atol=1e-5)
        for t in range(3, len(ids)):  # then one token at a time
            torch.testing.assert_close(_cached_forward(model, ids[t : t + 1], cache), full[t],
                                       rtol=1e-5, atol=1e-5)  # fmt: skip
    assert cache.length == len(ids)


def _sliding(model: GPT, prompt: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    """The reference: the whole window's forward per token, sliding by one."""
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids[-model.cfg.seq_len :].unsqueeze(0))[0, -1] / 0.8
            ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1, generator=g)])
    return ids


def test_generation_inside_the_window_samples_what_the_whole_forward_samples() -> None:
    model, prompt = _model(), torch.tensor([1, 2])
    cached = generate(model, prompt, 6, generator=torch.Generator().manual_seed(3))
    reference = _sliding(model, prompt, 6, torch.Generator().manual_seed(3))
    assert cached.tolist() == reference.tolist()  # 8 tokens: the window never slides


def test_generation_past_the_window_restarts_from_its_newest_half() -> None:
    """The reference recomputes the whole visible context per token; the context restarts
    from the newest seq_len // 2 tokens whenever it would exceed the window."""
    model, prompt, n = _model(), torch.tensor([1, 2, 3]), 20
    out = generate(model, prompt, n, generator=torch.Generator().manual_seed(1))
    g, ids, start, window = torch.Generator().manual_seed(1), prompt.clone(), 0, 8
    with torch.no_grad():
        for _ in range(n):
            if len(ids) - start > window:
                start = len(ids) - window // 2
            logits = model(ids[start:].unsqueeze(0))[0, -1] / 0.8
            ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1, generator=g)])
    assert out.tolist() == ids.tolist()
