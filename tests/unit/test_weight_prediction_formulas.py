"""Weight prediction and 2BW's delayed update against their papers' formulas, written out
by hand in the test: SpecTrain's Ŵ = W − s·lr·v (v SGD's smoothed gradient, s the
version gap), XPipe's Adam-based Ŵ = W − s·lr·m̂/(√v̂ + ε), and PipeDream-2BW's
W(t+1) = W(t) − lr·∇f(W(t−1))."""

from __future__ import annotations

import math

import torch
from torch import nn

from plait.emulate.versions import Emulator, version_plan
from plait.runtime.predict import optimizer_predictor
from plait.schedule import build

GRADS = [torch.tensor([0.5, -1.0]), torch.tensor([0.25, 2.0])]


def _stepped(optimizer: torch.optim.Optimizer, p: nn.Parameter) -> None:
    for g in GRADS:
        p.grad = g.clone()
        optimizer.step()


def _predicted(optimizer: torch.optim.Optimizer, p: nn.Parameter, distance: int) -> torch.Tensor:
    live, out = nn.Module(), nn.Module()
    live.w, out.w = p, nn.Parameter(torch.zeros(2))
    optimizer_predictor({0: optimizer})(0, live, out, distance)
    return out.w.detach()


def test_spectrain_predicts_from_the_smoothed_gradient_over_the_version_gap() -> None:
    lr, mu, s = 0.1, 0.9, 3
    p = nn.Parameter(torch.tensor([1.0, 2.0]))
    optimizer = torch.optim.SGD([p], lr=lr, momentum=mu)
    _stepped(optimizer, p)
    v = mu * GRADS[0] + GRADS[1]  # torch's momentum buffer: v1 = g1, v2 = μ·v1 + g2
    w = torch.tensor([1.0, 2.0]) - lr * GRADS[0] - lr * v
    torch.testing.assert_close(p.detach(), w)
    torch.testing.assert_close(_predicted(optimizer, p, s), w - s * lr * v)


def test_xpipe_predicts_with_adam_s_bias_corrected_step() -> None:
    lr, (b1, b2), eps, s = 0.01, (0.9, 0.999), 1e-8, 2
    p = nn.Parameter(torch.tensor([1.0, 2.0]))
    optimizer = torch.optim.Adam([p], lr=lr, betas=(b1, b2), eps=eps)
    _stepped(optimizer, p)
    m = (1 - b1) * (b1 * GRADS[0] + GRADS[1])
    v = (1 - b2) * (b2 * GRADS[0] ** 2 + GRADS[1] ** 2)
    direction = (m / (1 - b1**2)) / ((v / (1 - b2**2)).sqrt() + eps)
    torch.testing.assert_close(_predicted(optimizer, p, s), p.detach() - s * lr * direction)
    assert math.isclose(float(_predicted(optimizer, p, 0)[0]), float(p.detach()[0]))  # s = 0


def test_2bw_updates_the_newest_weights_with_the_gradient_of_the_version_before() -> None:
    """One weight, f(w) = (w·x − y)² on micro-batches (x_k, y_k), SGD: per window t of m
    micro-batches, W(t+1) = W(t) − lr·mean_k ∇f(W(max(t−1, 0)))."""
    lr, m, windows = 0.05, 2, 4
    xs = [1.0, 2.0, -1.0, 0.5, 1.5, -2.0, 1.0, 0.5]
    ys = [2.0, 1.0, 0.0, 1.0, -1.0, 2.0, 1.0, 3.0]
    model = nn.Sequential(nn.Linear(1, 1, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(0.3)
    emulator = Emulator(model, 1, lambda ps: torch.optim.SGD(ps, lr=lr),
                        lambda out, y: ((out.squeeze(1) - y) ** 2).mean())  # fmt: skip
    plan = version_plan(build("2bw", 1, m), windows)
    emulator.train(plan, lambda k: (torch.tensor([[xs[k]]]), torch.tensor([ys[k]])))
    w = [0.3]
    for t in range(windows):
        old = w[max(t - 1, 0)]
        grad = sum(2 * (old * xs[k] - ys[k]) * xs[k] for k in range(t * m, (t + 1) * m)) / m
        w.append(w[t] - lr * grad)
    assert math.isclose(float(model[0].weight.detach()), w[-1], rel_tol=1e-6)
