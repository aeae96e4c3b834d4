"""Context parallelism's attention: causal ring attention over zigzag sequence shards.

The sequence of S tokens is cut into 2·cp chunks of S / (2·cp); rank i of the cp group
holds chunks i and 2·cp − 1 − i (head-tail or "zigzag" load balancing, as in
ring-flash-attention and torch's `_HeadTailLoadBalancer`), so every rank does the same
share of the causal triangle. Each rank attends its queries to its own key/value block,
then to the cp − 1 blocks passed around the ring; the partial results merge exactly by
their log-sum-exp (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; the
merge is flash-attention's online softmax, Dao et al. 2022). Under zigzag, of a block
from an earlier rank only its head chunk counts, for all of this rank's queries; a block
from a later rank counts whole, for the tail queries only: every step after the first is
c × 2c scores, unmasked.

**Backward** (`RingAttention`) recomputes each block's probabilities from the saved
global log-sum-exp (flash-attention's backward) and passes dK/dV accumulators around
the ring with their key/value blocks, so each block's gradient comes home complete.

**Attention dropout** multiplies each block's normalised probabilities by its part of a
keep mask of this rank's queries against every global key position (0 or 1/(1 − p));
the log-sum-exp stays that of the undropped scores, so the merges are unchanged and the
result is the unsplit attention's with the same mask. The caller draws the mask keyed
by global (query, key) positions (`plait.keyed`), so cp ranks drop what one process
drops; it is [b, h, 2c, S] per rank (booleans, kept for backward), not per block.

**Communication** sits behind one small protocol so that one compute code serves two
rings: the per-rank computation is a generator that yields `Post(tensors)` (send to the
next rank, receive from the previous; answered at once with a ticket) and
`Wait(ticket)` (answered with what the previous rank posted). `run_on_group` answers
with gloo/NCCL `isend`/`irecv` (the next block's transfer is posted before the current
block's attention, so they overlap); `run_emulated` runs every rank of a ring in one
process, answering by indexing (the unit tests' ring).

**Why plait writes it** rather than use torch's experimental
`torch.distributed.tensor.experimental.context_parallel`: torch's ring replaces only the
CUDA kernels' aten ops (`_scaled_dot_product_flash/efficient/cudnn_attention`), while on
CPU `scaled_dot_product_attention` runs `_scaled_dot_product_flash_attention_for_cpu`,
which it leaves alone (checked on torch 2.13 with a dispatch trace): it cannot run on
gloo/CPU, where plait's tests run. It also patches SDPA process-wide with DTensors,
which does not fit inside plait's own pipeline stages. The block attention here is
written in plain torch (scores materialised per block: c × 2c), not a fused kernel.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from plait.parallel.zigzag import zigzag_positions, zigzag_shard, zigzag_unshard

__all__ = [
    "Post",
    "RingAttention",
    "Wait",
    "attention_backward_steps",
    "attention_forward_steps",
    "ring_attention",
    "run_emulated",
    "run_on_group",
    "zigzag_positions",
    "zigzag_shard",
    "zigzag_unshard",
]

T = TypeVar("T")
Tensors = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Post:
    """Send `tensors` to the next rank of the ring; receive as many from the previous."""

    tensors: Tensors


@dataclass(frozen=True)
class Wait:
    """Block until the transfer of ticket `ticket` is done; answered with the received."""

    ticket: int


Steps = Generator[Post | Wait, Any, T]


# --- block attention -------------------------------------------------------------------


def _block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out, lse) of q [b, h, n, d] attending to k, v [b, h, m, d]; lse [b, h, n]. `keep`
    [b, h, n, m] (0 or 1/(1 − p)) drops probabilities after the softmax; lse is of the
    scores, undropped, so that the merge still normalises by the whole softmax."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:  # local order is increasing global order, so local causality is global
        n, m = scores.shape[-2:]
        below = torch.ones(n, m, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~below, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return (probs if keep is None else probs * keep) @ v, lse


def _merge(
    out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lo: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax results over disjoint keys as one (exact, by log-sum-exp)."""
    new = torch.logaddexp(lse, lo)
    merged = out * torch.exp(lse - new).unsqueeze(-1) + o * torch.exp(lo - new).unsqueeze(-1)
    return merged, new


def _block_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    causal: bool,
    keep: torch.Tensor | None = None,
) -> Tensors:
    """(dq, dk, dv) of one block given the merged output's lse and delta = rowsum(dO·O).
    With dropout (`keep`) delta is still rowsum(dO·O): O is the dropped probabilities
    times V, so rowsum(dO·O) = rowsum(dP_dropped · P_dropped), flash-attention's identity."""
    scores = (q @ k.transpose(-2, -1)) * scale
    probs = torch.exp(scores - lse.unsqueeze(-1))
    if causal:
        n, m = scores.shape[-2:]
        below = torch.ones(n, m, dtype=torch.bool, device=q.device).tril()
        probs = probs.masked_fill(~below, 0.0)
    dprobs = dout @ v.transpose(-2, -1)
    if keep is not None:
        dprobs = dprobs * keep
    dv = (probs if keep is None else probs * keep).transpose(-2, -1) @ dout
    dscores = probs * (dprobs - delta.unsqueeze(-1)) * scale
    return dscores @ k, dscores.transpose(-2, -1) @ q, dv


def _chunk(q: torch.Tensor) -> int:
    """The chunk length c of a rank's 2c zigzag tokens."""
    n = q.shape[-2]
    if n % 2:
        raise ValueError(
            f"a rank's sequence shard has {n} tokens, an odd number: under context "
            "parallelism it holds two equal chunks (zigzag); shard the sequence with "
            "zigzag_shard, from a seq_len divisible by 2·cp"
        )
    return n // 2


def _keep_of(
    keep: torch.Tensor | None, *, source: int, cp: int, head_only: bool, tail_rows: bool
) -> torch.Tensor | None:
    """The dropout multipliers of the block from rank `source`: `keep` [b, h, 2c, S] holds
    this rank's query rows against every global key position; a block's columns are its
    keys' global positions (its head chunk only, or all), its rows this rank's queries
    (the tail chunk only, or all)."""
    if keep is None:
        return None
    n, seq_len = keep.shape[-2:]
    cols = zigzag_positions(seq_len, cp, source).to(keep.device)
    if head_only:
        cols = cols[: n // 2]
    rows = keep[..., n // 2 :, :] if tail_rows else keep
    return rows.index_select(-1, cols)


# --- the ring --------------------------------------------------------------------------


def attention_forward_steps(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rank: int, cp: int, scale: float,
    keep: torch.Tensor | None = None,
) -> Steps[Tensors]:  # fmt: skip
    """One rank's forward: (out [b, h, 2c, d], lse [b, h, 2c]) of its zigzag queries
    against every rank's keys and values, causal by global position. The next block's
    transfer is posted before the current block's attention, so the two overlap.
    `keep` [b, h, 2c, S]: attention dropout's multipliers (0 or 1/(1 − p)) of this rank's
    queries against every global key position; None: no dropout."""
    c = _chunk(q)
    ticket: int = (yield Post((k, v))) if cp > 1 else -1
    own = _keep_of(keep, source=rank, cp=cp, head_only=False, tail_rows=False)
    out, lse = _block(q, k, v, scale, causal=True, keep=own)  # local order is global order
    for t in range(1, cp):
        k, v = yield Wait(ticket)
        if t < cp - 1:
            ticket = yield Post((k, v))
        source = (rank - t) % cp
        if source < rank:  # an earlier rank's block: its head chunk, all queries
            part = _keep_of(keep, source=source, cp=cp, head_only=True, tail_rows=False)
            o, lo = _block(q, k[..., :c, :], v[..., :c, :], scale, causal=False, keep=part)
            out, lse = _merge(out, lse, o, lo)
        else:  # a later rank's block: all of it, for the tail queries only
            part = _keep_of(keep, source=source, cp=cp, head_only=False, tail_rows=True)
            o, lo = _block(q[..., c:, :], k, v, scale, causal=False, keep=part)
            tail, tail_lse = _merge(out[..., c:, :], lse[..., c:], o, lo)
            out = torch.cat([out[..., :c, :], tail], dim=-2)
            lse = torch.cat([lse[..., :c], tail_lse], dim=-1)
    return out, lse


def attention_backward_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    *,
    rank: int,
    cp: int,
    scale: float,
    keep: torch.Tensor | None = None,
) -> Steps[Tensors]:
    """One rank's backward: (dq, dk, dv) of its own q, k, v. dK/dV accumulators travel
    with their block around the ring (one step behind it) and come home after cp
    transfers; the next block's transfer overlaps the current block's gradients.
    `keep`: the forward's dropout multipliers (see `attention_forward_steps`)."""
    c = _chunk(q)
    delta = (dout * out).sum(-1)  # [b, h, 2c]
    kv_ticket: int = (yield Post((k, v))) if cp > 1 else -1
    own = _keep_of(keep, source=rank, cp=cp, head_only=False, tail_rows=False)
    dq, dk, dv = _block_grads(q, k, v, dout, lse, delta, scale, causal=True, keep=own)
    if cp == 1:
        return dq, dk, dv
    acc: int = yield Post((dk, dv))
    for t in range(1, cp):
        k, v = yield Wait(kv_ticket)
        if t < cp - 1:
            kv_ticket = yield Post((k, v))
        source = (rank - t) % cp
        if source < rank:
            part = _keep_of(keep, source=source, cp=cp, head_only=True, tail_rows=False)
            gq, gk, gv = _block_grads(q, k[..., :c, :], v[..., :c, :], dout, lse, delta,
                                      scale, causal=False, keep=part)  # fmt: skip
            dq = dq + gq
            dk, dv = yield Wait(acc)  # this block's accumulators, from the previous rank
            dk = torch.cat([dk[..., :c, :] + gk, dk[..., c:, :]], dim=-2)
            dv = torch.cat([dv[..., :c, :] + gv, dv[..., c:, :]], dim=-2)
        else:
            part = _keep_of(keep, source=source, cp=cp, head_only=False, tail_rows=True)
            gq, gk, gv = _block_grads(q[..., c:, :], k, v, dout[..., c:, :], lse[..., c:],
                                      delta[..., c:], scale, causal=False,
                                      keep=part)  # fmt: skip
            dq = torch.cat([dq[..., :c, :], dq[..., c:, :] + gq], dim=-2)
            dk, dv = yield Wait(acc)
            dk, dv = dk + gk, dv + gv
        acc = yield Post((dk, dv))
    dk, dv = yield Wait(acc)  # the accumulators of this rank's own block, complete
    return dq, dk, dv


def run_emulated(steps: Sequence[Steps[T]]) -> list[T]:
    """Run one generator per rank of a ring in this process: a `Wait` of rank r is
    answered with what rank r − 1 posted under the same ticket, once it has."""
    n = len(steps)
    posted: list[list[Tensors]] = [[] for _ in range(n)]
    requests: dict[int, Post | Wait] = {}
    done: dict[int, T] = {}
    for r, gen in enumerate(steps):
        _advance(gen, None, r, requests, done)
    while len(done) < n:
        progressed = False
        for r, gen in enumerate(steps):
            request = requests.get(r)
            if r in done or request is None:
                continue
            if isinstance(request, Post):
                posted[r].append(tuple(t.detach().clone() for t in request.tensors))
                answer: Any = len(posted[r]) - 1
            elif request.ticket < len(posted[(r - 1) % n]):
                answer = posted[(r - 1) % n][request.ticket]
            else:  # the previous rank has not posted it yet
                continue
            progressed = True
            _advance(gen, answer, r, requests, done)
        if not progressed:
            raise RuntimeError("the emulated ring is stuck: a rank waits for what none posts")
    return [done[r] for r in range(n)]


def _advance(
    gen: Steps[T], answer: Any, rank: int, requests: dict[int, Post | Wait], done: dict[int, T]
) -> None:
    try:
        requests[rank] = gen.send(answer)
    except StopIteration as stop:
        done[rank] = stop.value


def run_on_group(steps: Steps[T], group: dist.ProcessGroup) -> T:
    """Run this rank's generator on the ring of `group` (rank r sends to r + 1 and
    receives from r − 1): a `Post` starts `isend`/`irecv` and returns at once."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    to = dist.get_global_rank(group, (rank + 1) % size)
    source = dist.get_global_rank(group, (rank - 1) % size)
    transfers: list[tuple[list[Any], Tensors]] = []
    answer: Any = None
    while True:
        try:
            request = steps.send(answer)
        except StopIteration as stop:
            return stop.value
        if isinstance(request, Post):
            sent = tuple(t.contiguous() for t in request.tensors)
            received = tuple(torch.empty_like(t) for t in sent)
            works = [dist.isend(t, to, group=group) for t in sent]
            works += [dist.irecv(t, source, group=group) for t in received]
            transfers.append((works, received))
            answer = len(transfers) - 1
        else:
            works, received = transfers[request.ticket]
            for work in works:
                if work is not None:
                    work.wait()
            answer = received


class RingAttention(torch.autograd.Function):
    """Causal ring attention of zigzag shards q, k, v [b, h, 2c, d] over a cp group, with
    a ring backward (see the module docstring). Its softmax and merges run in fp32 under
    any autocast (as flash-attention accumulates); the results take the inputs' dtypes."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: dist.ProcessGroup,
        scale: float,
        keep: torch.Tensor | None,
        p: float,
    ) -> torch.Tensor:
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        dtypes = (q.dtype, k.dtype, v.dtype)
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = (t.float() for t in (q, k, v))
            scaled = _multipliers(keep, p)
            steps = attention_forward_steps(q, k, v, rank=rank, cp=cp, scale=scale, keep=scaled)
            out, lse = run_on_group(steps, group)
        ctx.save_for_backward(q, k, v, out, lse, keep)  # the mask as booleans: 1/4 the bytes
        ctx.group, ctx.scale, ctx.dtypes, ctx.p = group, scale, dtypes, p
        return out.to(dtypes[0])

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, keep = ctx.saved_tensors
        group = ctx.group
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        with torch.autocast(q.device.type, enabled=False):
            steps = attention_backward_steps(
                q, k, v, out, lse, dout.float().contiguous(), rank=rank, cp=cp,
                scale=ctx.scale, keep=_multipliers(keep, ctx.p),
            )  # fmt: skip
            grads = run_on_group(steps, group)
        dq, dk, dv = (g.to(t) for g, t in zip(grads, ctx.dtypes, strict=True))
        return dq, dk, dv, None, None, None, None


def _multipliers(keep: torch.Tensor | None, p: float) -> torch.Tensor | None:
    """A keep mask as dropout's multipliers: 0 where dropped, 1/(1 − p) where kept."""
    return None if keep is None else keep.float() / (1.0 - p)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    keep: torch.Tensor | None = None,
    p: float = 0.0,
) -> torch.Tensor:
    """Causal attention of this rank's zigzag shards q, k, v [b, h, 2c, d] against the
    whole sequence held by the ranks of `group` (SDPA's scale, 1/√d). Attention dropout:
    `keep` [b, h, 2c, S] (bool) says which probabilities of this rank's queries against
    every global key position survive, each kept one scaled by 1/(1 − `p`)."""
    _chunk(q)
    if keep is not None and keep.shape[-2] != q.shape[-2]:
        raise ValueError(
            f"keep has {keep.shape[-2]} query rows, q {q.shape[-2]}: give the mask of this "
            "rank's queries against every global key position, [b, h, 2c, S]"
        )
    scale = q.shape[-1] ** -0.5
    out: torch.Tensor = RingAttention.apply(q, k, v, group, scale, keep, p)  # type: ignore[no-untyped-call]
    return out
