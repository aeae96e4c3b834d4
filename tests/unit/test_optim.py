"""The optimizer and schedule built from a config: learning rates step for step equal to
torch's own schedulers, weight decay only on matrices, bad settings refused."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR

from plait.config import TrainConfig
from plait.train.optim import optimizer_factory, scheduler_factory


def _dummy(lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)


def _torch_reference(cfg: TrainConfig, opt: torch.optim.Optimizer, u: int) -> LRScheduler:
    """The schedule as torch's building blocks spell it (warm-up from lr/(w+1))."""
    w, total = cfg.warmup_steps * u, cfg.max_steps * u
    if cfg.lr_schedule == "cosine":
        decay: LRScheduler = CosineAnnealingLR(opt, T_max=total - w, eta_min=cfg.min_lr)
    elif cfg.lr_schedule == "linear":
        decay = LinearLR(opt, 1.0, cfg.min_lr / cfg.lr, total_iters=total - w)
    else:
        decay = LinearLR(opt, 1.0, 1.0, total_iters=1)
    if w == 0:
        return decay
    warm = LinearLR(opt, start_factor=1 / (w + 1), end_factor=1.0, total_iters=w)
    return SequentialLR(opt, [warm, decay], milestones=[w])


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
@pytest.mark.parametrize(("warmup", "u"), [(0, 1), (3, 1), (2, 4)])
def test_lr_per_update_equals_torch_schedulers(schedule: str, warmup: int, u: int) -> None:
    cfg = TrainConfig(max_steps=10, lr=0.3, min_lr=0.01, warmup_steps=warmup, lr_schedule=schedule)
    ours_opt, ref_opt = _dummy(cfg.lr), _dummy(cfg.lr)
    ours = scheduler_factory(cfg)(ours_opt, u)
    with _quiet():
        ref = _torch_reference(cfg, ref_opt, u)
    for k in range(cfg.max_steps * u):
        got, want = ours_opt.param_groups[0]["lr"], ref_opt.param_groups[0]["lr"]
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12), (k, got, want)
        ours_opt.step()
        ref_opt.step()
        ours.step()
        with _quiet():
            ref.step()


def test_resumed_schedule_continues_exactly() -> None:
    cfg = TrainConfig(max_steps=8, lr=0.1, warmup_steps=4, lr_schedule="cosine")
    opt = _dummy(cfg.lr)
    sched = scheduler_factory(cfg)(opt, 1)
    for _ in range(2):
        opt.step()
        sched.step()
    state, opt_state = sched.state_dict(), opt.state_dict()
    rest = []
    for _ in range(6):
        opt.step()
        sched.step()
        rest.append(opt.param_groups[0]["lr"])
    opt2 = _dummy(cfg.lr)
    sched2 = scheduler_factory(cfg)(opt2, 1)
    opt2.load_state_dict(opt_state)
    sched2.load_state_dict(state)
    again = []
    for _ in range(6):
        opt2.step()
        sched2.step()
        again.append(opt2.param_groups[0]["lr"])
    assert again == rest


def test_weight_decay_skips_biases_and_norms() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Embedding(5, 4), nn.BatchNorm1d(4))
    cfg = TrainConfig(weight_decay=0.1)
    opt = optimizer_factory(cfg)(model.parameters())
    decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        matrix = name in ("0.weight", "2.weight")
        assert decay[id(p)] == (0.1 if matrix else 0.0), name
    assert isinstance(opt, torch.optim.AdamW)
    sgd = optimizer_factory(TrainConfig(optimizer="sgd", momentum=0.9, nesterov=True))(
        model.parameters()
    )
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["nesterov"]


@pytest.mark.parametrize(
    ("impl", "fused", "foreach"),
    [("auto", True, None), ("fused", True, None), ("foreach", None, True), ("loop", None, False)],
)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_implementation_is_the_one_asked_for(
    impl: str, fused: bool | None, foreach: bool | None, optimizer: str
) -> None:
    """On CPU parameters: torch has fused kernels there, which auto takes."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    cfg = TrainConfig(optimizer=optimizer, optimizer_impl=impl, momentum=0.9)
    opt = optimizer_factory(cfg)(model.parameters())
    assert opt.defaults["fused"] is fused and opt.defaults["foreach"] is foreach
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # torch accepts the choice for these parameters


def test_each_implementation_takes_the_same_step() -> None:
    """fused, foreach and the loop give the weights of torch's plain AdamW to 1e-6."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    x = torch.randn(8, 4)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(
        [
            {"params": [ref[0].weight], "weight_decay": 0.01},
            {"params": [ref[0].bias, ref[1].weight, ref[1].bias], "weight_decay": 0.0},
        ],
        lr=3e-3,
    )
    copies = {impl: copy.deepcopy(model) for impl in ("fused", "foreach", "loop")}
    opts = {i: optimizer_factory(TrainConfig(optimizer_impl=i))(m.parameters())
            for i, m in copies.items()}  # fmt: skip
    for _ in range(3):
        for m, o in [(ref, ref_opt), *((copies[i], opts[i]) for i in copies)]:
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for impl, m in copies.items():
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=impl)


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("lr", float("inf"), "lr=inf"),
        ("lr", float("nan"), "lr=nan"),
        ("optimizer", "adam", "optimizer='adam'"),
        ("lr_schedule", "step", "lr_schedule='step'"),
        ("min_lr", 1.0, "min_lr=1.0"),
        ("warmup_steps", -1, "warmup_steps=-1"),
        ("beta2", 1.0, "beta2=1.0"),
        ("eval_every", 0, "eval_every=0"),
        ("optimizer_impl", "apex", "optimizer_impl='apex'"),
    ],
)
def test_bad_settings_name_the_value(key: str, value: object, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        TrainConfig(**{key: value})  # type: ignore[arg-type]


def _quiet() -> warnings.catch_warnings:  # type: ignore[type-arg]
    """Silence torch's warnings about SequentialLR's internal step(epoch) calls."""
    return warnings.catch_warnings(action="ignore")
