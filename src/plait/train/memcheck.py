"""Will the run fit? A memory estimate taken before any worker starts.

A batch or sequence far too large for the machine otherwise shows up minutes later as an
out-of-memory kill of one worker (on a CPU, the kernel's OOM killer takes the whole
machine's memory down first). This check predicts the largest worker's peak with the
simulator's memory model (`plait.sim`: model state by ZeRO stage, activations held by
the schedule's micro-batches in flight) for the transformer models, and refuses a run
whose prediction exceeds what each worker has: a CPU worker's share of the memory now
available, or a GPU's memory. Any other model (ResNet-18, MoE-GPT, a user's module) gets a
bound below its need: its parameters, gradients and optimizer state (counted on a model
built on the meta device) spread evenly over every worker, plus the global batch, which
every worker draws whole (its bytes per sample measured on a one-sample-per-micro-batch
batch); a run over that bound cannot fit under any layout.

Under `--plan auto` the layout is not known yet, so the check asks whether the most
frugal layout of the workers fits (a pipeline as deep as the model allows, micro-batches
of one sample, full recomputation, ZeRO-3 over any data-parallel ranks); if even that
does not, no plan will. The prediction leaves out allocator fragmentation and framework workspace,
so a run it passes can still run out of memory near the limit; a run it refuses would
need more than the memory there is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from plait.cluster import GIB
from plait.config import TrainConfig
from plait.cost.memory import Optimizer

__all__ = ["MemoryEstimate", "check_memory", "estimate_memory", "worker_memory_bytes"]

_VOCAB = {"stdlib": 256, "synthetic": 64}  # at most the corpus's characters, or exactly
_MAX_SIMULATED_MICROBATCHES = 4  # per pipeline stage and model chunk; more are extrapolated


@dataclass(frozen=True)
class MemoryEstimate:
    """The predicted peak of the largest worker, and what the prediction assumed."""

    peak_bytes: float
    model_state_bytes: float
    activation_bytes: float
    layout: str  # the layout predicted (the frugal one under --plan auto)
    batch_bytes: float = 0.0  # the step's token windows, which every worker draws in full
    bound: bool = False  # a bound below the need (a model outside the cost model)


def worker_memory_bytes(nproc: int, device: str = "auto") -> float:
    """What one of `nproc` local workers on `--device device` may use: a GPU's memory, or
    an even share of the memory available now (CPU workers share it)."""
    from plait.device import resolve, total_memory_bytes

    kind = resolve(device)
    if kind != "cpu":
        import torch

        return float(total_memory_bytes(torch.device(kind, 0)) or 0)
    return _available_bytes() / max(1, nproc)


def _available_bytes() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 8.0 * GIB


def estimate_memory(cfg: TrainConfig, nproc: int) -> MemoryEstimate | None:
    """The largest worker's predicted peak under `cfg` on `nproc` workers; None for a
    model the cost model does not describe."""
    from plait.profile import GPTSpec
    from plait.sim import SimPlan

    m, par = cfg.model, cfg.parallel
    if m.name not in ("gpt", "hf-gpt2", "hf-llama") or cfg.data not in _VOCAB:
        return _lower_bound(cfg, nproc)
    vocab = _VOCAB[cfg.data]
    if cfg.init_from is not None:  # the pretrained model's vocabulary, however small the data's
        from plait.pretrained import read_pretrained

        vocab = read_pretrained(cfg.init_from).vocab_size
    spec = GPTSpec(num_layers=m.layers, hidden=m.hidden, num_heads=m.heads, seq_len=m.seq_len,
                   vocab_size=vocab, ffn_hidden=m.ffn_hidden or 0,
                   dropout=m.dropout)  # fmt: skip
    optimizer: Optimizer = "adam" if cfg.optimizer == "adamw" else "sgd"
    if cfg.plan == "auto":
        pp = max(k for k in range(1, min(nproc, m.layers + 2) + 1) if nproc % k == 0)
        dp = nproc // pp
        size = 1 if cfg.batch_size % dp == 0 else cfg.batch_size // dp
        plan = SimPlan(dp=dp, pp=pp, microbatches=max(1, cfg.batch_size // (dp * size)),
                       micro_batch_size=size, recompute="full", zero=3 if dp > 1 else 0,
                       dtype=par.dtype, optimizer=optimizer, seq_len=m.seq_len)  # fmt: skip
    elif par.pipelines is not None:  # heterogeneous: the worst pipeline's worker
        size = max(1, cfg.batch_size // sum(p.microbatches for p in par.pipelines))
        plans = [SimPlan.of(replace(par, pipelines=None, wsp_staleness=None, dp=1,
                                    dp_replicate=None, dp_shard=None,
                                    pp=len(p.partition) // par.chunks,
                                    microbatches=p.microbatches, partition=None),
                            micro_batch_size=size, optimizer=optimizer, seq_len=m.seq_len)
                 for p in par.pipelines]  # fmt: skip
        found = [_estimate(cfg, spec, one) for one in plans]
        return max(found, key=lambda e: e.peak_bytes)
    else:
        plan = SimPlan.of(replace(par, partition=None),
                          micro_batch_size=max(1, cfg.batch_size // (par.dp * par.microbatches)),
                          optimizer=optimizer, seq_len=m.seq_len)  # fmt: skip
    return _estimate(cfg, spec, plan)


def _estimate(cfg: TrainConfig, spec: Any, plan: Any) -> MemoryEstimate:
    """The largest worker's predicted peak of `plan` (a `SimPlan`) for the GPT `spec`."""
    from plait.cluster import local_cpu
    from plait.device import resolve
    from plait.plan.predict import predict

    m = cfg.model
    device_type = resolve(cfg.device)  # where the workers train
    blocks = spec.block_costs(micro_batch_size=plan.micro_batch_size, dtype=plan.dtype,
                              layout=plan, device_type=device_type)  # fmt: skip
    cluster = local_cpu(devices=plan.world_size)  # memory is judged here, not by the cluster

    def peak(microbatches: int) -> tuple[float, float]:
        result = predict(blocks, cluster, replace(plan, microbatches=microbatches)).result
        worst = max(result.ranks, key=lambda r: r.memory.total).memory
        return worst.total, worst.params + worst.grads + worst.optimizer + worst.weight_copies

    # A schedule's actions grow with its micro-batches, so a batch of 10^10 samples would
    # take minutes to simulate. Past a few micro-batches per stage the peak grows by a
    # constant per micro-batch (nothing for 1F1B-like schedules, one micro-batch's
    # activations for GPipe), so two short simulations, pp micro-batches apart (schedules
    # that need a multiple of pp accept both), extrapolate it exactly.
    cap = _MAX_SIMULATED_MICROBATCHES * plan.pp * plan.chunks
    if plan.microbatches <= cap:
        total, state = peak(plan.microbatches)
    else:
        total, state = peak(cap)
        per_microbatch = (total - peak(cap - plan.pp)[0]) / plan.pp
        total += (plan.microbatches - cap) * per_microbatch
    layout = (f"dp={plan.dp} tp={plan.tp} pp={plan.pp} microbatches={plan.microbatches} "
              f"recompute={plan.recompute} zero={plan.zero}")  # fmt: skip
    # every worker draws the whole global batch (int64 windows of seq_len + 1 tokens) and
    # slices its share: a huge batch fills memory before the first block runs
    batch = float(cfg.batch_size) * (m.seq_len + 1) * 8
    return MemoryEstimate(total + batch, state, total - state, layout, batch)


def _lower_bound(cfg: TrainConfig, nproc: int) -> MemoryEstimate | None:
    """What any worker needs at least (see the module docstring); None when the model
    cannot be built on the meta device or its data not drawn small."""
    import torch

    from plait.compat import pytree
    from plait.train.task import task_from_config

    small = replace(cfg, batch_size=cfg.parallel.step_microbatches)
    try:
        task = task_from_config(small)
        with torch.device("meta"):
            model = task.model()
        batch = task.batch(0)
    except Exception:  # a model or data this cannot build cheaply: no check
        return None
    leaves = [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    per_sample = sum(x.numel() * x.element_size() for x in leaves) / small.batch_size
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = 2 if cfg.optimizer == "adamw" else int(cfg.momentum > 0)
    state = weights * (2 + moments) / nproc  # weights, gradients, optimizer state
    drawn = per_sample * cfg.batch_size
    return MemoryEstimate(state + drawn, state, 0.0, "any layout", drawn, bound=True)


def check_memory(cfg: TrainConfig, nproc: int, available: float | None = None) -> None:
    """Refuse a run whose largest worker is predicted to need more memory than it has
    (`available` bytes per worker; default `worker_memory_bytes`)."""
    found = estimate_memory(cfg, nproc)
    if found is None:
        return
    have = worker_memory_bytes(nproc, cfg.device) if available is None else available
    if found.peak_bytes <= have:
        return
    m = cfg.model
    fix = ("use a smaller --batch-size or --seq-len, more --microbatches, --recompute full, "
           "or more workers")  # fmt: skip
    if found.batch_bytes > have:  # no layout helps: every worker holds the whole batch
        fix = "use a smaller --batch-size or --seq-len (every worker draws the whole batch)"
    which = ("even the most frugal layout of the workers (" + found.layout + ")"
             if cfg.plan == "auto" else "the largest worker")  # fmt: skip
    if found.bound:
        fix = ("use a smaller --batch-size (every worker draws the whole batch)"
               if found.batch_bytes > have else "use more workers or a smaller model")  # fmt: skip
        raise ValueError(
            f"batch_size={cfg.batch_size} ({m.name}): each worker needs at least "
            f"{found.peak_bytes / GIB:.1f} GiB under any layout "
            f"({found.model_state_bytes / GIB:.1f} model state spread over all {nproc} "
            f"workers, {found.batch_bytes / GIB:.1f} the batch, which every worker draws "
            f"whole) but each has {have / GIB:.1f} GiB: {fix}"
        )
    raise ValueError(
        f"batch_size={cfg.batch_size} × seq_len={m.seq_len} (hidden {m.hidden}, "
        f"{m.layers} layers): {which} needs about {found.peak_bytes / GIB:.1f} GiB "
        f"({found.model_state_bytes / GIB:.1f} model state, "
        f"{found.activation_bytes / GIB:.1f} activations, {found.batch_bytes / GIB:.1f} "
        f"the batch's tokens) but each of {nproc} workers has "
        f"{have / GIB:.1f} GiB: {fix}"
    )
