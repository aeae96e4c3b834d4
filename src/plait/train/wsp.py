"""Wave Synchronous Parallel (Park et al., HetPipe, USENIX ATC 2020): virtual workers train
on their own weights and exchange the sum of their updates once per wave.

Each virtual worker (one pipeline; one rank in the one-device case, which is stale-
synchronous parallel, Ho et al., NIPS 2013) updates its own weights with its own
optimizer after each of its minibatches. A wave is `wave` consecutive minibatches; at its
end the worker pushes its wave update ũ_{i,c} = (weights after wave c) − (weights before
it, others' updates applied), and before wave c it adds the others' wave updates of waves
≤ c − D − 1. Minibatch p of worker i, in wave c, therefore computes on exactly

    w̃_{i,p} = w_0 + Σ_{q < p} u_{i,q} + Σ_{j ≠ i} Σ_{c' ≤ c − D − 1} ũ_{j,c'}

(its own updates at once: a synchronous schedule inside the worker), and the global
weights w_0 + Σ_{i, c} ũ_{i,c} are every worker's weights after `finish`. D = 0 is
bulk-synchronous over waves with summed updates (for plain SGD with the loss scaled by
the worker's batch share, exactly synchronous data parallelism).

How the updates travel: collectives, not a parameter-server rank. At the end of wave c
each block group (the ranks holding the same blocks, one per worker;
`plait.parallel.hetero`) starts an asynchronous all-reduce(sum) of its flat wave update;
the worker waits for it only before wave c + D + 1. A worker can thus run D waves ahead
of the slowest and no further (its wait needs the slowest one's push), the staleness is
exactly D waves whatever the timing (testable, deterministic), no rank is spent on a
server, and the exchange needs no global names for blocks cut differently by each
pipeline. The cost: every worker takes part in every wave's reduction (a server would let
a worker read the newest sum instead, the paper's "at most D", nondeterministic), and each
rank keeps D + 1 own wave updates and D reductions in flight (memory D·|W_rank| + |W_rank|).

`at_most` (`--wsp-at-most`) relaxes "exactly D" to the paper's "at most D" without a
server: at the start of a wave a worker still waits for the waves more than D behind, and
also takes in, oldest first, every later wave whose reductions have already completed
(polled, not waited for). The staleness is then between 0 and D waves and depends on
timing, so such runs are not reproducible bit for bit; `lags` records it per wave.

Limits: the schedule inside each worker must be synchronous (one flush per minibatch);
optimizer state is each worker's own; learning-rate schedules step per own minibatch.

Checkpoints (`state`, `load_state`) are taken at a wave's end: each worker's own weights and
optimizer state (`plait.checkpoint.state`), and the others' updates of the waves it has not
taken in yet, so a run resumed on the same layout goes on bit for bit.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from plait.parallel.hetero import BlockBuckets

__all__ = ["WaveExchange"]


class WaveExchange:
    """The wave bookkeeping of one rank: snapshots, pushes, and delayed applies."""

    def __init__(
        self, buckets: BlockBuckets, *, staleness: int, wave: int, at_most: bool = False
    ) -> None:
        self.buckets, self.staleness, self.wave, self.at_most = buckets, staleness, wave, at_most
        self.lags: list[int] = []  # per wave begun: own waves whose others' are not taken in
        self.steps = 0  # minibatches begun
        self.start: list[torch.Tensor] = []  # weights at the start of the current wave
        # per pushed wave: (own updates, reductions in flight with their buffers)
        self.pending: deque[tuple[list[torch.Tensor], list[tuple[Any, torch.Tensor]]]] = deque()
        self._expected = 0  # pushed waves the checkpoint to be loaded holds (`expect`)

    @property
    def waves(self) -> int:
        """Waves begun."""
        return -(-self.steps // self.wave)

    def before_step(self) -> None:
        """At the start of a wave: take in the others' waves due, remember the weights."""
        if self.steps % self.wave == 0:
            while len(self.pending) > self.staleness:
                self._apply(self.pending.popleft())
            while self.at_most and self.pending and self._reduced(self.pending[0]):
                self._apply(self.pending.popleft())
            self.lags.append(len(self.pending))
            self.start = [self.buckets.flat(i) for i in range(len(self.buckets))]
        self.steps += 1

    def after_step(self) -> None:
        if self.steps % self.wave == 0:
            self._push()

    def finish(self) -> None:
        """Push a partial last wave, then take in every wave: the global weights."""
        if self.steps % self.wave:
            self._push()
            self.steps += self.wave - self.steps % self.wave
        while self.pending:
            self._apply(self.pending.popleft())

    def _push(self) -> None:
        own, works = [], []
        for i in range(len(self.buckets)):
            delta = self.buckets.flat(i) - self.start[i]
            own.append(delta)
            total = delta.clone()
            group = self.buckets.buckets[i][0]
            works.append((dist.all_reduce(total, group=group, async_op=True), total))
        self.pending.append((own, works))

    # ------------------------------------------------------------ checkpoints
    def state(self, *, for_load: bool = False) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps to continue exactly, saved at a wave's end: per pushed
        wave whose others' updates are not taken in yet, per bucket, those updates
        (`pending.<wave>.<bucket>`; the reduction is waited for, which changes nothing: the
        sum is the same whenever it is read). `for_load`: buffers for `expect` waves."""
        if for_load:
            shapes = [self.buckets.flat(i) for i in range(len(self.buckets))]
            return {f"pending.{j}.{i}": torch.zeros_like(flat)
                    for j in range(self._expected) for i, flat in enumerate(shapes)}  # fmt: skip
        if self.steps % self.wave:
            raise RuntimeError(
                f"a WSP checkpoint is saved at a wave's end, not after {self.steps} steps of "
                f"waves of {self.wave}: save every multiple of wsp_wave"
            )
        out = {}
        for j, (own, works) in enumerate(self.pending):
            for i, (work, total) in enumerate(works):
                work.wait()
                out[f"pending.{j}.{i}"] = total - own[i]
        return out

    def expect(self, pending: int) -> None:
        """The number of pushed waves the checkpoint about to be loaded holds."""
        self._expected = pending

    def load_state(self, state: dict[str, torch.Tensor], steps: int) -> None:
        """Continue after `steps` minibatches from a checkpoint's `state`: the others'
        updates of its pending waves are taken in when their turn comes, as they would
        have been. Without it (another layout's checkpoint) none is pending."""
        self.steps, self.pending = steps, deque()
        self.start = [self.buckets.flat(i) for i in range(len(self.buckets))]
        for j in range(self._expected if state else 0):
            others = [state[f"pending.{j}.{i}"] for i in range(len(self.buckets))]
            zero = [torch.zeros_like(x) for x in others]
            self.pending.append((zero, [(_Done(), x) for x in others]))

    @staticmethod
    def _reduced(entry: tuple[list[torch.Tensor], list[tuple[Any, torch.Tensor]]]) -> bool:
        return all(work.is_completed() for work, _ in entry[1])

    def _apply(self, entry: tuple[list[torch.Tensor], list[tuple[Any, torch.Tensor]]]) -> None:
        own, works = entry
        for i, (work, total) in enumerate(works):
            work.wait()
            self.buckets.add(i, total - own[i])  # the others' updates: own is applied


class _Done:
    """A reduction read from a checkpoint: already complete."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True
