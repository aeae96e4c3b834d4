"""The MoE layer against a dense loop over tokens and experts written here, the router
losses against their formulas, and `--model moe-gpt` configuration."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from plait.config import load_config
from plait.models import MoEConfig, MoEGPT
from plait.models.moe import MoELayer

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _reference(layer: MoELayer, x: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, ...]:
    """(output [T, h], aux, z, number of dropped copies) of `layer` on `x` [T, h], token by
    token: each token's top-k experts by probability, first choices of all tokens queued
    before second choices, and each expert FFN computed alone from the stacked weights."""
    t_count, e_count, k = x.shape[0], cfg.num_experts, cfg.top_k
    logits = x @ layer.router.gate.weight.t()
    probs = torch.exp(logits) / torch.exp(logits).sum(dim=1, keepdim=True)
    choices, gates = [], []
    for t in range(t_count):
        ranked = sorted(range(e_count), key=lambda e, t=t: -float(probs[t, e].detach()))[:k]
        chosen = torch.stack([probs[t, e] for e in ranked])
        choices.append(ranked)
        gates.append(chosen / chosen.sum() if k > 1 else chosen)
    cap = math.ceil(cfg.capacity_factor * t_count * k / e_count) if cfg.capacity_factor else None
    fill, kept = [0] * e_count, set()
    for c in range(k):
        for t in range(t_count):
            e = choices[t][c]
            if cap is None or fill[e] < cap:
                fill[e] += 1
                kept.add((t, c))
    ex = layer.experts
    rows = []
    for t in range(t_count):
        y = torch.zeros(x.shape[1])
        for c in range(k):
            if (t, c) in kept:
                e = choices[t][c]
                h = F.gelu(x[t] @ ex.w1[e] + ex.b1[e])
                y = y + gates[t][c] * (h @ ex.w2[e] + ex.b2[e])
        if layer.shared is not None:
            y = y + layer.shared.down(F.gelu(layer.shared.up(x[t])))
        rows.append(y)
    f = torch.tensor([sum(ch.count(e) for ch in choices) / (t_count * k) for e in range(e_count)])
    aux = e_count * sum(f[e] * probs[:, e].mean() for e in range(e_count))
    z = (torch.log(torch.exp(logits).sum(dim=1)) ** 2).mean()
    dropped = t_count * k - len(kept)
    return torch.stack(rows), aux, z, torch.tensor(dropped)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize(("capacity_factor", "shared"), [(0.5, False), (None, False), (0.8, True)])
def test_moe_layer_matches_a_dense_loop_with_its_gradients(
    top_k: int, capacity_factor: float | None, shared: bool
) -> None:
    cfg = MoEConfig(hidden=8, num_heads=2, ffn_hidden=12, num_experts=4, top_k=top_k,
                    capacity_factor=capacity_factor, shared_expert=shared,
                    aux_loss_coef=0.3, z_loss_coef=0.05)  # fmt: skip
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    with torch.no_grad():  # biases away from zero, and a router that is not uniform
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = torch.randn(2, 10, 8, requires_grad=True)
    probe = torch.randn(2, 10, 8)

    y, loss = layer(x)
    ref_y, aux, z, dropped = _reference(layer, x.reshape(-1, 8), cfg)
    ref_loss = 0.3 * aux + 0.05 * z
    torch.testing.assert_close(y.reshape(-1, 8), ref_y, **TOL)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert (int(dropped) > 0) == (capacity_factor is not None)  # dropping is exercised

    params = [x, *layer.parameters()]
    got = torch.autograd.grad((y * probe).sum() + loss, params)
    want = torch.autograd.grad((ref_y * probe.reshape(-1, 8)).sum() + ref_loss, params)
    for name, g, w in zip(["x", *(n for n, _ in layer.named_parameters())], got, want,
                          strict=True):  # fmt: skip
        torch.testing.assert_close(g, w, **TOL, msg=name)
    assert got[1].abs().sum() > 0  # the router weight has a gradient


def test_router_losses_follow_their_formulas() -> None:
    """Switch eq. 4 with k=1: E · Σ f_i P_i, f_i the share of tokens whose argmax is i;
    ST-MoE's z-loss: mean of logsumexp(logits)²."""
    cfg = MoEConfig(hidden=8, num_heads=2, num_experts=3, top_k=1)
    torch.manual_seed(1)
    layer = MoELayer(cfg)
    x = torch.randn(20, 8)
    routing = layer.router(x)
    logits = x @ layer.router.gate.weight.t()
    probs = logits.softmax(dim=1)
    top = probs.argmax(dim=1)
    f = torch.stack([(top == e).float().mean() for e in range(3)])
    torch.testing.assert_close(routing.aux_loss, 3 * (f * probs.mean(dim=0)).sum())
    torch.testing.assert_close(routing.z_loss, (logits.exp().sum(1).log() ** 2).mean())


def test_router_stays_fp32_under_bf16_autocast() -> None:
    """Under a bf16 autocast (`--dtype bf16`) the gate still runs in fp32: the same logits
    as a plain fp32 matmul, hence the same routing."""
    cfg = MoEConfig(hidden=32, num_heads=2, num_experts=8, top_k=2)
    torch.manual_seed(3)
    layer = MoELayer(cfg)
    x = torch.randn(256, 32)
    logits = x @ layer.router.gate.weight.t()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        routing = layer.router(x)
    assert torch.equal(routing.expert.sort(dim=1).values,
                       logits.topk(2, dim=1).indices.sort(dim=1).values)  # fmt: skip
    torch.testing.assert_close(routing.z_loss, (logits.logsumexp(dim=1) ** 2).mean())


def test_experts_take_tensor_counts_and_keep_all_experts_local() -> None:
    cfg = MoEConfig(hidden=8, num_heads=2, num_experts=3)
    layer = MoELayer(cfg)
    grouped = torch.randn(5, 8)
    ex = layer.experts
    assert list(ex.local_experts) == [0, 1, 2]
    out = ex(grouped, torch.tensor([2, 0, 3]))
    want = torch.cat([F.gelu(grouped[:2] @ ex.w1[0] + ex.b1[0]) @ ex.w2[0] + ex.b2[0],
                      F.gelu(grouped[2:] @ ex.w1[2] + ex.b1[2]) @ ex.w2[2] + ex.b2[2]])  # fmt: skip
    torch.testing.assert_close(out, want)
    assert ex.w1.shape == (3, 8, 32) and ex.w2.shape == (3, 32, 8)


def test_moe_gpt_blocks_carry_the_router_losses_to_the_loss() -> None:
    cfg = MoEConfig(vocab_size=16, seq_len=8, num_layers=4, hidden=8, num_heads=2,
                    moe_every=2, aux_loss_coef=0.5, z_loss_coef=0.1)  # fmt: skip
    torch.manual_seed(2)
    model = MoEGPT(cfg)
    ids = torch.randint(0, 16, (3, 8))
    blocks = model.blocks()
    assert [isinstance(getattr(b, "ffn", None), MoELayer) for b in blocks] == [
        False, False, True, False, True, False,
    ]  # fmt: skip
    x, aux = blocks[0](ids)
    assert aux.dtype == torch.float32 and aux.shape == (1,) and float(aux) == 0.0
    expected = torch.zeros(())
    for block in blocks[1:-1]:
        h = x + block.attn(block.ln1(x))
        if isinstance(block.ffn, MoELayer):
            expected = expected + block.ffn(block.ln2(h))[1]
        x, aux = block((x, aux))
    logits, aux = blocks[-1]((x, aux))
    torch.testing.assert_close(aux, expected.reshape(1))
    ce = F.cross_entropy(logits.reshape(-1, 16), ids.flatten())
    torch.testing.assert_close(model.loss(model(ids), ids), ce + expected)


def test_moe_gpt_config_is_validated_and_refuses_sequence_parallelism() -> None:
    base = {"model.name": "moe-gpt", "data": "synthetic"}
    for overrides, message in [
        ({"model.top_k": 3, "model.experts": 2}, "top_k=3 exceeds experts=2"),
        ({"model.capacity_factor": -1.0}, "capacity_factor=-1.0 must be"),
        ({"model.moe_every": 5, "model.layers": 4}, "moe_every=5 with layers=4"),
        ({"model.experts": 0}, "experts=0 must be a positive integer"),
        ({"parallel.tp": 2, "parallel.sequence_parallel": True}, "sequence_parallel with model"),
        ({"parallel.tp": 2, "parallel.dp": 1, "parallel.ep": 4}, r"ep=4 does not divide dp × tp"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_config(**base, **overrides)
    with pytest.warns(UserWarning, match="top_k=1 has no effect with model 'gpt'"):
        load_config(**{"model.top_k": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(**base, **{"model.top_k": 1, "model.capacity_factor": 0.0})
    from plait.train.task import task_from_config

    task = task_from_config(cfg)
    model = task.model()
    assert isinstance(model, MoEGPT) and model.cfg.top_k == 1 and not model.cfg.capacity_factor
    ids, targets = task.batch(0)
    assert task.loss(model(ids), targets).shape == ()
