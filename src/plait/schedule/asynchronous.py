"""Generators of asynchronous pipeline schedules: 1F1B streams that never flush.

Every schedule here is PipeDream's 1F1B-RR program (Narayanan et al., "PipeDream:
Generalized Pipeline Parallelism for DNN Training", SOSP 2019) as one steady window of m
micro-batches: stage s (on rank s) runs, for j = 0..m-1,

    F(j)  B(j - W_s)  [REDUCE, UPDATE when B(j - W_s) completes an update group]

so it keeps W_s + 1 micro-batches in flight and never idles in the steady state. In the
stream (`plait.schedule.stream`) the backwards of negative micro-batches fall away, which
leaves the warm-up F(0..W_s-1), and the drain runs the backwards still owed. The
schedules differ in the warm-up W_s, the update group (one UPDATE per micro-batch, or per
batch of m) and the weight version v_s(x) that micro-batch x computes on at stage s
(forward and backward alike). Writing x for a global micro-batch id and t = floor(x / m)
for its batch:

| kind | W_s | update group | v_s(x) | policy |
| --- | --- | --- | --- | --- |
| pipedream | p-1-s | 1 | x - W_s: the latest weights | stash |
| pipedream-vs | p-1-s | 1 | x - (p-1) on every stage | vertical |
| 2bw | min(p-1-s, m) | m | t - 1 | 2bw |
| spectrain | p-1-s | 1 | x, predicted | predict |
| xpipe | p-1-s | m | t, predicted | predict |

Versions below 0 are the initial weights. So PipeDream's stage s computes micro-batch x
on weights with the updates of micro-batches up to x - (p - s) (SOSP 2019, §3.3: the
gradient is exact for a model whose stage s is p-1-s updates old); vertical sync makes
every stage p-1 updates old. PipeDream-2BW (Narayanan et al., "Memory-Efficient
Pipeline-Parallel DNN Training", ICML 2021) computes batch t on W^(t-1) and applies its
averaged gradient to W^(t): W^(t+1) = W^(t) - lr·∇f(W^(t-1)), staleness exactly 1, with
two weight buffers; capping the warm-up at m keeps that true for m < p - 1 (the pipeline
then idles). SpecTrain (Chen, Yang and Cheng, "Efficient and Robust Parallel DNN Training
through Model Parallelism on Multi-GPU Platform", 2018) and XPipe (Guan, Yin, Li and Lu,
"XPipe: Efficient Pipeline Model Parallelism for Multi-GPU DNN Training", 2019) stash
nothing: micro-batch x computes on weights predicted for the version its gradient will be
applied to, Ŵ = W - d·lr·u, with d the number of updates still to come before then and u
the optimizer's last update direction (SGD's momentum buffer; Adam's m̂/(√v̂ + ε));
XPipe predicts once per batch, at its first micro-batch, for the batch's update.

Weight versions alive at once on stage s (`plait.schedule.versions` counts them; a stash
of the current version is the live weights), and copies besides the live weights, at the
peak over a run; the test suite checks them against the validator for p <= 6, m <= 9:

| kind | versions on stage s < p-1 | copies | last stage (s = p-1) |
| --- | --- | --- | --- |
| pipedream | p - s | p - s | 1 version, no copy |
| pipedream-vs | p | p on stage 0, p - 1 after | p versions, p - 1 copies |
| 2bw | 2 | 2 | 2 versions, 1 copy |
| spectrain | p - s + 1 | p - s | 1 version, no copy |
| xpipe | 2 + ceil((p-1-s)/m) | 1 + ceil((p-1-s)/m) | 1 version, no copy |

PipeDream's own code holds p - s stashed clones plus the live weights, as here. Under
vertical sync every stage keeps p versions, not p - s + 1: besides those of its in-flight
micro-batches, a stage must keep the versions its later forwards will still ask for.
2BW's paper counts two buffers; here a forward on the current version whose backward
follows the next update computes on a copy (autograd saves the tensors it ran on), so a
stage holds the live weights and two copies.

Optimizer state is never copied; gradients accumulate into the live weights' `.grad`.
"""

from __future__ import annotations

from collections.abc import Callable

from plait.schedule.generators import check_sizes
from plait.schedule.ir import Action, Op, Schedule

__all__ = ["pipedream", "pipedream_2bw", "pipedream_vertical", "spectrain", "xpipe"]

Version = Callable[[int, int], int]  # (stage, micro-batch) -> version, relative to window 0


def _stream(
    kind: str,
    policy: str,
    p: int,
    m: int,
    warmup: Callable[[int], int],
    version: Version,
    group: int,
) -> Schedule:
    """The window of a 1F1B stream (see the module docstring)."""
    check_sizes(p, m)
    programs = []
    for s in range(p):
        w = warmup(s)
        program = []
        for j in range(m):
            y = j - w  # the micro-batch whose backward pairs with forward j
            program += [Action(Op.F, s, j, version(s, j)), Action(Op.B, s, y, version(s, y))]
            if (y + 1) % group == 0:
                program.append(Action(Op.UPDATE, s, y, (y + 1) // group))
        programs.append(program)
    return Schedule(
        kind=kind,
        num_ranks=p,
        num_microbatches=m,
        stage_to_rank=tuple(range(p)),
        ranks=tuple(tuple(program) for program in programs),
        policy=policy,
    )


def pipedream(num_stages: int, num_microbatches: int) -> Schedule:
    """PipeDream's 1F1B-RR with weight stashing: an update per micro-batch; stage s
    computes micro-batch x on the weights it holds then, version x - (p-1-s)."""
    p = num_stages
    return _stream(
        "pipedream",
        "stash",
        p,
        num_microbatches,
        lambda s: p - 1 - s,
        lambda s, x: x - (p - 1 - s),
        1,
    )


def pipedream_vertical(num_stages: int, num_microbatches: int) -> Schedule:
    """PipeDream with vertical sync: every stage computes micro-batch x on version
    x - (p-1), the one its first stage used."""
    p = num_stages
    return _stream(
        "pipedream-vs",
        "vertical",
        p,
        num_microbatches,
        lambda s: p - 1 - s,
        lambda s, x: x - (p - 1),
        1,
    )


def pipedream_2bw(num_stages: int, num_microbatches: int) -> Schedule:
    """PipeDream-2BW: an update per batch of m micro-batches; batch t computes on version
    t - 1 on every stage (staleness exactly 1), at most two versions alive per stage."""
    p, m = num_stages, num_microbatches
    return _stream("2bw", "2bw", p, m, lambda s: min(p - 1 - s, m), lambda s, x: x // m - 1, m)


def spectrain(num_stages: int, num_microbatches: int) -> Schedule:
    """SpecTrain: an update per micro-batch; micro-batch x computes on weights predicted
    for version x, the one its gradient is applied to."""
    p = num_stages
    return _stream(
        "spectrain", "predict", p, num_microbatches, lambda s: p - 1 - s, lambda s, x: x, 1
    )


def xpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """XPipe: an update per batch of m micro-batches; batch t computes on weights
    predicted (once, at its first micro-batch) for version t."""
    p, m = num_stages, num_microbatches
    return _stream("xpipe", "predict", p, m, lambda s: p - 1 - s, lambda s, x: x // m, m)
