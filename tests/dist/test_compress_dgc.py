"""Deep Gradient Compression (`compress="dgc:..."`) through `parallelize`: training under dp
and dp × pp equals one process that applies Lin et al.'s rules to each replica's gradient
(local clipping at clip/√N, momentum correction, momentum factor masking, the sparsity
warm-up, vectors averaged whole) and then plain SGD; at ratio 1 without masking DGC is
momentum SGD on the averaged gradient (a plain PyTorch reference); its velocity, momentum
and step count are checkpointed, so a resumed run equals the uninterrupted one."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.blocks import as_blocks
from plait.checkpoint import CheckpointStore
from plait.config import ParallelPlan
from plait.models import GPT
from plait.parallel.dgc import DGCState
from plait.train.checkpointing import resume, save
from plait.train.parallelize import parallelize

from .harness import run_world
from .test_compress import _dgc_share
from .test_compress_engine import _replica_grads
from .test_hybrid import _batch, _full, _model

pytestmark = pytest.mark.dist

LR, MU, CLIP, STEPS = 0.1, 0.9, 0.3, 4
SPEC = "dgc:0.05:warmup=2"
STAGE_BLOCKS = {1: [[0, 1, 2, 3]], 2: [[0, 1], [2, 3]]}  # embedding, 2 layers, head


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MU)  # type: ignore[arg-type]


class _Stage:
    """One stage's DGC state in the emulator (one bucket): every replica's momentum and
    velocity per parameter."""

    def __init__(self, params: list[torch.nn.Parameter], dp: int) -> None:
        self.u = [[torch.zeros_like(p) for p in params] for _ in range(dp)]
        self.v = [[torch.zeros_like(p) for p in params] for _ in range(dp)]

    def step(
        self, grads: list[list[torch.Tensor]], step: int, clip: float | None
    ) -> list[torch.Tensor]:
        """The update each parameter gets (SGD without momentum applies lr × it)."""
        dp = len(grads)
        out = [torch.zeros_like(g) for g in grads[0]]
        for r, gs in enumerate(grads):
            if clip is not None:
                norm = float(torch.cat([g.reshape(-1) for g in gs]).norm())
                gs = [g * min(1.0, clip / math.sqrt(dp) / (norm + 1e-6)) for g in gs]
            for i, g in enumerate(gs):
                self.u[r][i] = MU * self.u[r][i] + g
                self.v[r][i] = self.v[r][i] + self.u[r][i]
                k = math.ceil(_dgc_share(0.05, 2, step) * g.numel())
                keep = torch.zeros(g.numel(), dtype=torch.bool)
                keep[self.v[r][i].reshape(-1).abs().argsort(descending=True)[:k]] = True
                keep = keep.view(g.shape)
                out[i] += torch.where(keep, self.v[r][i], 0.0) / dp
                self.v[r][i] = torch.where(keep, 0.0, self.v[r][i])
                self.u[r][i] = torch.where(keep, 0.0, self.u[r][i])
        return out


def _emulated_dgc(plan: ParallelPlan, clip: float | None) -> None:
    model = _model()
    ref = copy.deepcopy(model)
    engine = parallelize(model, plan, _sgd, GPT.loss, device="cpu", grad_clip=clip)
    ref_blocks = as_blocks(ref)
    groups = STAGE_BLOCKS[plan.pp]
    params = [[p for b in blocks for p in ref_blocks[b].parameters()] for blocks in groups]
    index = {id(p): i for i, p in enumerate(ref.parameters())}
    stages = [_Stage(ps, plan.dp) for ps in params]
    for step in range(STEPS):
        grads = _replica_grads(ref, step, plan.dp)
        update: dict[int, torch.Tensor] = {}
        for ps, st in zip(params, stages, strict=True):
            mine = [[g[index[id(p)]] for p in ps] for g in grads]
            for p, u in zip(ps, st.step(mine, step, clip), strict=True):
                update[id(p)] = u
        engine.step(_batch(step))
        with torch.no_grad():
            for p in ref.parameters():
                p -= LR * update[id(p)]
        where = f"{plan} clip={clip} step {step} rank {dist.get_rank()}"
        for stage in engine.stages.values():
            assert [stage.first_block + j for j in range(len(stage.blocks))] in groups, where
            for j, block in enumerate(stage.blocks):
                theirs = ref_blocks[stage.first_block + j].parameters()
                for p, q in zip(block.parameters(), theirs, strict=True):
                    torch.testing.assert_close(_full(p.grad), update[id(q)], rtol=1e-5,
                                               atol=1e-6, msg=where)  # fmt: skip
                    torch.testing.assert_close(_full(p), q, rtol=1e-5, atol=1e-6, msg=where)
    # the hook took SGD's momentum over: the optimizers step without their own
    assert all(g["momentum"] == 0.0 for o in engine.optimizers.values() for g in o.param_groups)


def _full_ratio_is_momentum_sgd(plan: ParallelPlan) -> None:
    """dgc:1 without masking sends everything: u ← μu + g averaged, applied by plain SGD,
    is momentum SGD on the whole batch (one process, torch's SGD)."""
    model = _model()
    ref = copy.deepcopy(model)
    engine = parallelize(model, plan, _sgd, GPT.loss, device="cpu", grad_clip=None)
    ref_opt = _sgd(ref.parameters())
    ref_blocks = as_blocks(ref)
    for step in range(STEPS):
        x, y = _batch(step)
        ref_opt.zero_grad()
        GPT.loss(ref(x), y).backward()
        ref_opt.step()
        engine.step((x, y))
        for stage in engine.stages.values():
            for j, block in enumerate(stage.blocks):
                theirs = ref_blocks[stage.first_block + j].parameters()
                for p, q in zip(block.parameters(), theirs, strict=True):
                    torch.testing.assert_close(_full(p), q, rtol=1e-5, atol=1e-6)


def _resumed_equals_straight(tmp: str) -> None:
    plan = ParallelPlan(dp=2, pp=1, microbatches=1, compress=SPEC)
    root = Path(tmp) / "dgc"
    store = CheckpointStore(root)
    straight = parallelize(_model(), plan, _sgd, GPT.loss, device="cpu")
    for step in range(STEPS):
        straight.step(_batch(step))
        if step == 1:
            state = straight.grad_sync.hook_state  # type: ignore[union-attr]
            assert isinstance(state, DGCState) and state.steps == {0: 2}
            save(straight, store, 2, {"plan": {}})
    store.wait()
    for fresh in (False, True):
        resumed = parallelize(_model(), plan, _sgd, GPT.loss, device="cpu")
        assert resume(resumed, CheckpointStore(root), "auto") is not None
        state = resumed.grad_sync.hook_state  # type: ignore[union-attr]
        assert isinstance(state, DGCState) and state.momentum == MU
        if fresh:  # without the saved velocity, momentum and step the runs part
            state.residuals, state.momenta, state.steps = {}, {}, {}
        else:
            assert state.steps == {0: 2} and state.residuals[0].abs().sum() > 0
        for step in range(2, STEPS):
            resumed.step(_batch(step))
        same = all(
            torch.equal(p, q)
            for a, b in zip(resumed.stages.values(), straight.stages.values(), strict=True)
            for p, q in zip(a.parameters(), b.parameters(), strict=True)
        )
        assert same is not fresh, "the resumed run differs" if not fresh else "state unused"


def _two(rank: int, world: int, tmp: str) -> None:
    torch.use_deterministic_algorithms(True)
    for clip in (None, CLIP):
        _emulated_dgc(ParallelPlan(dp=2, pp=1, microbatches=2, compress=SPEC), clip)
    _full_ratio_is_momentum_sgd(ParallelPlan(dp=2, pp=1, microbatches=1,
                                             compress="dgc:1:no-masking"))  # fmt: skip
    _resumed_equals_straight(tmp)
    dist.barrier()


def _four(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    _emulated_dgc(ParallelPlan(dp=2, pp=2, microbatches=2, compress=SPEC), CLIP)
    dist.barrier()


def test_dgc_trains_as_the_paper_defines_it_and_resumes(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _two, str(tmp_path))
    run_world(tmp_path, 4, _four)


def test_momentum_correction_needs_sgd() -> None:
    from plait.parallel.dgc import take_momentum

    state = DGCState(None, 0.01)  # type: ignore[arg-type]
    adam = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match=r"needs the sgd optimizer.*dgc:0.01:no-correction"):
        take_momentum(state, [adam], None)
