"""Clipping, fp16 unscaling and the fused optimizers' skip, each against a formula written
here or a plain torch step: gradient norms as sqrt(Σ g²), unscaled gradients as g / scale,
a skipped update as no change at all."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from plait.parallel.clip import clip_grad_norm
from plait.train.precision import LossScaler, skips_on_device, step_unless_found


def _params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 3), (3,), (4, 4, 2), (1,)]
    params = [nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


def _norm(grads: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_scales_by_the_global_norm(max_norm: float) -> None:
    params = _params()
    before = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    want = _norm(before)
    total = clip_grad_norm(params, max_norm, pp_group=None)
    assert isinstance(total, torch.Tensor) and total.dim() == 0
    assert float(total) == pytest.approx(want, rel=1e-6)
    coef = min(1.0, max_norm / (want + 1e-6))
    for p, g in zip(params, before, strict=True):
        torch.testing.assert_close(p.grad, g * coef, rtol=1e-6, atol=1e-7)


def test_uncounted_replicas_are_clipped_but_not_counted() -> None:
    params = _params(1)
    before = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    want = _norm(before[:2])  # the last two are replicas another rank counts
    total = clip_grad_norm(params, 0.1, pp_group=None, uncounted=params[2:])
    assert float(total) == pytest.approx(want, rel=1e-6)
    for p, g in zip(params, before, strict=True):
        torch.testing.assert_close(p.grad, g * (0.1 / (want + 1e-6)), rtol=1e-6, atol=1e-7)


def test_parameters_without_gradients_are_left_out() -> None:
    params = _params(2)
    params[0].grad = None
    total = clip_grad_norm(params, 1e3, pp_group=None)
    assert float(total) == pytest.approx(_norm([p.grad for p in params[1:]]), rel=1e-6)  # type: ignore[misc]


def test_unscale_divides_by_the_scale_and_flags_nothing_when_finite() -> None:
    params = _params(3)
    before = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    scaler = LossScaler(init_scale=2.0**10)
    found = scaler.unscale_(params, torch.device("cpu"))
    assert float(found) == 0.0
    for p, g in zip(params, before, strict=True):
        assert torch.equal(p.grad, g / 2.0**10)  # a power of two: exact


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_unscale_flags_a_non_finite_gradient(bad: float) -> None:
    params = _params(4)
    params[2].grad[1, 2, 0] = bad  # type: ignore[index]
    assert float(LossScaler().unscale_(params, torch.device("cpu"))) > 0


def test_the_scale_halves_on_overflow_and_doubles_after_clean_steps() -> None:
    scaler = LossScaler(init_scale=8.0, growth_interval=3)
    scaler.update(True)
    assert (scaler.scale, scaler.skipped) == (4.0, 1)
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale == 4.0
    scaler.update(False)
    assert scaler.scale == 8.0
    state = scaler.state_dict()
    again = LossScaler()
    again.load_state_dict(state)
    assert again.state_dict() == state


def _adamw(params: list[nn.Parameter], **kind: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, **kind)


def test_only_fused_optimizers_skip_on_the_device() -> None:
    assert skips_on_device(_adamw(_params(), fused=True))
    assert not skips_on_device(_adamw(_params(), foreach=True))
    assert not skips_on_device(_adamw(_params(), foreach=False))
    params = _params()
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
    assert not skips_on_device(sgd)  # torch's fused SGD would leave empty momentum buffers
    sgd.step()
    assert skips_on_device(sgd)


def test_a_fused_step_with_the_flag_set_changes_nothing() -> None:
    params = _params(5)
    opt = _adamw(params, fused=True)
    opt.step()  # some state to keep
    weights = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.state_dict()["state"])
    step_unless_found(opt, torch.ones(()))
    for p, w in zip(params, weights, strict=True):
        assert torch.equal(p.detach(), w)
    after = opt.state_dict()["state"]
    for k, entry in state.items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(after[k][name]), torch.as_tensor(value)), name
    assert not hasattr(opt, "found_inf")


def test_a_fused_step_with_the_flag_clear_equals_a_plain_step() -> None:
    params, ref = _params(6), _params(6)
    opt, ref_opt = _adamw(params, fused=True), _adamw(ref, foreach=False)
    for _ in range(2):
        step_unless_found(opt, torch.zeros(()))
        ref_opt.step()
    for p, q in zip(params, ref, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
