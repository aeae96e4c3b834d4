"""Asynchronous pipelines match a single-process emulator of their weight-version rules.

The emulator is plain PyTorch written here from the papers' update rules (no plait
runtime code): it keeps every stage's weights after each of its updates, computes each
micro-batch on the composite model the rule dictates (stage s on its own version, or on
weights predicted from an old version), accumulates the gradients of an update unit, and
steps a torch optimizer per stage on the latest weights. The distributed run must give
the same per-micro-batch losses and, after the drain, the same weights, to 1e-5 in fp32,
over at least 3·p updates per stage.
"""

from __future__ import annotations

import copy
import io
import math
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from plait.config import ParallelPlan
from plait.models import GPT, GPTConfig, SkipMLP
from plait.train.parallelize import parallelize

from .harness import run_world

pytestmark = pytest.mark.dist

TOL = {"rtol": 1e-5, "atol": 1e-5}
# bf16: the emulator autocasts the whole model at once, the runtime stage by stage; the
# same ops run in the same order on the same dtypes, so the same fp32 tolerance holds
BF16_TOL = TOL
LR = {"sgd": 0.05, "adamw": 2e-3}


# ------------------------------------------------------------------ models, data
def _model(name: str) -> tuple[torch.nn.Module, Callable[..., torch.Tensor]]:
    torch.manual_seed(0)
    if name == "gpt":
        cfg = GPTConfig(vocab_size=19, seq_len=6, num_layers=6, hidden=16, num_heads=2)
        return GPT(cfg), GPT.loss
    return SkipMLP(dim=6, hidden=10, classes=4, num_blocks=8), SkipMLP.loss


def _microbatch(name: str, k: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global micro-batch k (every rank builds the same)."""
    g = torch.Generator().manual_seed(1000 + k)
    if name == "gpt":
        ids = torch.randint(0, 19, (size, 7), generator=g)
        return ids[:, :-1], ids[:, 1:]
    return torch.randn(size, 6, generator=g), torch.randint(0, 4, (size,), generator=g)


def _optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR[name], momentum=0.9)
    # eps well above rounding noise: attention's key bias gets a gradient that is zero up
    # to rounding (softmax ignores a shift), which Adam would otherwise blow up to full
    # steps that differ with the order of summation (one process vs an all-reduce)
    return torch.optim.AdamW(params, lr=LR[name], weight_decay=0.01, eps=1e-4)


# ---------------------------------------------------------------- the emulator
def _split(num_blocks: int, p: int) -> list[list[int]]:
    """Block indices per stage: equal parts, earlier stages take the remainder."""
    base, extra = divmod(num_blocks, p)
    out, start = [], 0
    for s in range(p):
        n = base + (1 if s < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def _direction(opt: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor:
    """The optimizer's last update direction for `param`, learning rate factored out."""
    state = opt.state.get(param, {})
    if isinstance(opt, torch.optim.SGD):
        return state["momentum_buffer"].clone() if state else torch.zeros_like(param)
    if not state:
        return torch.zeros_like(param)
    beta1, beta2 = opt.param_groups[0]["betas"]
    step = float(state["step"])
    m_hat = state["exp_avg"] / (1 - beta1**step)
    v_hat = state["exp_avg_sq"] / (1 - beta2**step)
    return m_hat / (v_hat.sqrt() + opt.param_groups[0]["eps"])


class Emulator:
    """Every stage's weights after each of its updates; one optimizer per stage."""

    def __init__(self, model: torch.nn.Module, p: int, opt_name: str, bf16: bool = False) -> None:
        self.bf16 = bf16  # the whole model under one bf16 autocast
        self.live = copy.deepcopy(model)
        self.scratch = copy.deepcopy(model)
        blocks = list(self.live.layers)
        self.stage_params = [
            [q for b in idx for q in blocks[b].parameters()] for idx in _split(len(blocks), p)
        ]
        scratch_blocks = list(self.scratch.layers)
        self.scratch_params = [
            [q for b in idx for q in scratch_blocks[b].parameters()]
            for idx in _split(len(blocks), p)
        ]
        self.opts = [_optimizer(opt_name, ps) for ps in self.stage_params]
        self.hist = [{0: [q.detach().clone() for q in ps]} for ps in self.stage_params]
        self.dirs = [{0: [torch.zeros_like(q) for q in ps]} for ps in self.stage_params]
        self.updates = [0] * p

    def weights(self, s: int, version: int, distance: int = 0) -> list[torch.Tensor]:
        lr = self.opts[s].param_groups[0]["lr"]
        return [
            w - distance * lr * d
            for w, d in zip(self.hist[s][version], self.dirs[s][version], strict=True)
        ]

    def grad(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable, weights, share: float):
        """Loss of one micro-batch on the composite weights; adds share × its gradient to
        the live weights' .grad."""
        with torch.no_grad():
            for ps, ws in zip(self.scratch_params, weights, strict=True):
                for q, w in zip(ps, ws, strict=True):
                    q.copy_(w)
        self.scratch.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            loss = loss_fn(self.scratch(x), y).float()
        (loss * share).backward()
        for ps, mine in zip(self.stage_params, self.scratch_params, strict=True):
            for q, g in zip(ps, mine, strict=True):
                q.grad = g.grad.clone() if q.grad is None else q.grad + g.grad
        return float(loss.detach())

    def step(self, s: int) -> None:
        self.opts[s].step()
        self.opts[s].zero_grad(set_to_none=True)
        self.updates[s] += 1
        v = self.updates[s]
        self.hist[s][v] = [q.detach().clone() for q in self.stage_params[s]]
        self.dirs[s][v] = [_direction(self.opts[s], q) for q in self.stage_params[s]]


def emulate(
    kind: str,
    p: int,
    m: int,
    model_name: str,
    opt_name: str,
    windows: int,
    size: int,
    bf16: bool = False,
):
    """Per-micro-batch losses and the final weights per stage, by the papers' rules."""
    model, loss_fn = _model(model_name)
    emu = Emulator(model, p, opt_name, bf16)
    warm = [p - 1 - s for s in range(p)]  # PipeDream's in-flight count W_s
    total = windows * m
    per_micro = kind in ("pipedream", "pipedream-vs", "spectrain")
    group = 1 if per_micro else m
    losses = []
    for unit in range(total // group):
        for k in range(unit * group, (unit + 1) * group):
            t = k // m
            weights = []
            for s in range(p):
                if kind == "pipedream":  # the latest weights when stage s forwards k
                    weights.append(emu.weights(s, max(0, k - warm[s])))
                elif kind == "pipedream-vs":  # stage 0's version on every stage
                    weights.append(emu.weights(s, max(0, k - (p - 1))))
                elif kind == "2bw":  # W(t+1) = W(t) - lr grad(W(t-1))
                    weights.append(emu.weights(s, max(0, t - 1)))
                elif kind == "spectrain":  # predicted for version k from the one held
                    j = max(0, k - warm[s])
                    weights.append(emu.weights(s, j, k - j))
                elif kind == "xpipe":  # predicted at the batch's first micro-batch
                    j = max(0, t - math.ceil(warm[s] / m))
                    weights.append(emu.weights(s, j, t - j))
                else:
                    raise AssertionError(kind)
            x, y = _microbatch(model_name, k, size)
            losses.append(emu.grad(x, y, loss_fn, weights, 1.0 / group))
        for s in range(p):
            emu.step(s)
    final = [[q.detach() for q in ps] for ps in emu.stage_params]
    return losses, final


# ------------------------------------------------------------ the distributed run
Reference = tuple[list[float], list[list[torch.Tensor]]]


class Case(NamedTuple):
    kind: str
    model: str
    opt: str
    dtype: str = "fp32"
    options: tuple[tuple[str, object], ...] = ()


def _windows(kind: str, pp: int, m: int) -> int:
    """At least 3p updates per stage: one per micro-batch, or one per window."""
    per_micro = kind in ("pipedream", "pipedream-vs", "spectrain")
    return max(2, -(-3 * pp // m)) if per_micro else 3 * pp


def _references(world: int, pp: int, m: int, cases: list[Case]) -> bytes:
    """The emulator's losses and weights for each case, computed once in the test process
    and handed to every rank (each rank computing them all cost the world size over),
    serialised: tensors handed to a worker as they are travel as one file each."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        refs = [emulate(c.kind, pp, m, c.model, c.opt, _windows(c.kind, pp, m),
                        2 * (world // pp), c.dtype == "bf16") for c in cases]  # fmt: skip
    finally:
        torch.use_deterministic_algorithms(deterministic)
    out = io.BytesIO()
    torch.save(refs, out)
    return out.getvalue()


def _loaded(references: bytes) -> list[Reference]:
    refs: list[Reference] = torch.load(io.BytesIO(references), weights_only=True)
    return refs


def _check(
    rank: int,
    world: int,
    kind: str,
    pp: int,
    m: int,
    model_name: str,
    opt_name: str,
    dtype: str = "fp32",
    compile: bool = False,
    reference: Reference | None = None,
    **options: object,
) -> None:
    """The engine's run against the emulator's (`reference`: computed ahead, else here)."""
    dp = world // pp
    windows = _windows(kind, pp, m)
    size = 2 * dp  # each replica trains on 2 samples of every global micro-batch
    model, loss_fn = _model(model_name)
    plan = ParallelPlan(dp=dp, pp=pp, schedule=kind, microbatches=m, dtype=dtype, **options)  # type: ignore[arg-type]
    engine = parallelize(
        model,
        plan,
        lambda ps: _optimizer(opt_name, list(ps)),
        loss_fn,
        device="cpu",
        compile=compile,
    )
    stream = (_microbatch(model_name, k, size) for k in range(windows * m))
    reports = list(engine.run(stream))
    got = [loss for report in reports for loss in report.losses]
    if reference is None:
        reference = emulate(kind, pp, m, model_name, opt_name, windows, size, dtype == "bf16")
    want, final = reference
    where = f"{kind} pp={pp} dp={dp} m={m} {model_name} {opt_name} {dtype} {options} rank {rank}"
    tol = TOL if dtype == "fp32" else BF16_TOL
    assert sum(r.updates for r in reports) >= 3 * pp, where  # per stage, drain included
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **tol, msg=where)
    for s, stage in engine.stages.items():
        mine = [q.detach() for q in stage.parameters()]
        for i, (q, w) in enumerate(zip(mine, final[s], strict=True)):
            torch.testing.assert_close(q, w, **tol, msg=f"{where} stage {s} parameter {i}")
        # no weight copy outlives the drain
        assert not engine.executor.weights.copies, where


KINDS = ("pipedream", "pipedream-vs", "2bw", "spectrain", "xpipe")


def _pipeline_cases(world: int) -> list[Case]:
    cases = [Case(kind, model_name, opt_name) for kind in KINDS for model_name in ("gpt", "skip")
             for opt_name in ("sgd", "adamw")]  # fmt: skip
    if world == 2:  # mixed precision: against the emulator under one bf16 autocast
        cases += [Case(kind, "gpt", "adamw", "bf16") for kind in KINDS]
        # forwards recomputed on weight copies
        cases += [Case(kind, "gpt", "sgd", options=(("recompute", "full"),))
                  for kind in ("pipedream", "2bw", "spectrain")]  # fmt: skip
    return cases


def _pipelines(rank: int, world: int, m: int, references: bytes) -> None:
    torch.use_deterministic_algorithms(True)
    for c, ref in zip(_pipeline_cases(world), _loaded(references), strict=True):
        _check(rank, world, c.kind, world, m, c.model, c.opt, c.dtype, reference=ref,
               **dict(c.options))  # fmt: skip
    dist.barrier()


def test_two_stages_match_the_emulator(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _pipelines, 4, _references(2, 2, 4, _pipeline_cases(2)))


def test_four_stages_match_the_emulator(tmp_path: Path) -> None:
    """m = 2 < p - 1: 2BW caps its warm-up at m; windows reach two back."""
    run_world(tmp_path, 4, _pipelines, 2, _references(4, 4, 2, _pipeline_cases(4)))


def _replicated_cases() -> list[Case]:
    cases = [Case(kind, "gpt", opt_name) for kind in KINDS for opt_name in ("sgd", "adamw")]
    # ZeRO-1: each replica steps its shard, per update
    return cases + [
        Case(kind, "skip", "adamw", options=(("zero", 1),)) for kind in ("pipedream", "2bw")
    ]


def _replicated(rank: int, world: int, references: bytes) -> None:
    torch.use_deterministic_algorithms(True)
    for c, ref in zip(_replicated_cases(), _loaded(references), strict=True):
        _check(rank, world, c.kind, 2, 3, c.model, c.opt, c.dtype, reference=ref,
               **dict(c.options))  # fmt: skip


def test_data_parallel_replicas_of_an_asynchronous_pipeline(tmp_path: Path) -> None:
    """dp = 2 × pp = 2: each update averages both replicas' gradients."""
    run_world(tmp_path, 4, _replicated, _references(4, 2, 3, _replicated_cases()))
