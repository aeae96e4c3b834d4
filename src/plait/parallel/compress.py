"""Gradient compression for the data-parallel reduction, through DDP's comm-hook protocol.

A hook is `hook(state, bucket) -> torch.futures.Future[Tensor]`, the signature of DDP's
`register_comm_hook`: the future's value is the bucket's averaged (decompressed) flat
gradient. `GradReducer` hands each hook a `HookBucket`, which answers the questions
torch's hooks ask of DDP's `GradBucket` (`buffer`, `set_buffer`, `gradients`,
`parameters`, `index`, `is_last`), so `fp16_compress_hook`, `bf16_compress_hook` and
`powerSGD_hook` run unchanged; its `gradients()` are views of the buffer with each local
gradient's shape (a tensor-parallel shard keeps its own matrix shape), which PowerSGD
needs to compress per matrix.

torch has no hook for the methods below, so they are written here. Each keeps an error
feedback residual per bucket (what it has not sent yet): the gradient is added to the
residual, what is sent is subtracted from it, so over any number of steps the sum of
what was sent plus the residual equals the sum of the gradients, and nothing is lost,
only delayed.

- `threshold:TAU`, Ström (Interspeech 2015, "Scalable distributed DNN training using
  commodity GPU cloud computing"): each entry whose residual reaches ±TAU is sent as
  ±TAU, encoded with its sign in one 32-bit integer (index·2 + sign bit).
- `topk:RATIO`, top-k sparsification with error feedback (Aji & Heafield, EMNLP 2017;
  Lin et al., ICLR 2018, "Deep gradient compression"): the RATIO·n entries of largest
  residual magnitude, sent as index and value.
- `sign`, 1-bit compression with error feedback (Seide et al., Interspeech 2014, "1-bit
  SGD"; Tang et al., ICML 2021, "1-bit Adam"): the sign of every residual entry, packed
  eight to a byte, and one scale per bucket (the mean magnitude).
- `dgc:RATIO`, Deep Gradient Compression (Lin et al., ICLR 2018): top-k of the accumulated
  velocity with momentum correction, momentum factor masking, local gradient clipping and a
  sparsity warm-up, in `plait.parallel.dgc`.

The sparse methods exchange different amounts per rank, so they all-gather (sizes first)
instead of all-reducing, and block until done: they trade the reducer's overlap for
fewer bytes. Every hook counts the bytes it hands to collectives in `state.bytes_sent`
(the tensors' sizes, padding included).

Both kinds of state are training state, saved per rank in checkpoints
(`plait.checkpoint.state`): `ErrorFeedback.state_dict` its residuals, and
`powersgd_state_bytes` what torch's `PowerSGDState` carries from step to step (the error
feedback per bucket, the warm-start factors P and Q, the step count, which decides when
compression starts, and the NumPy generator that seeds new factors), as one serialised
blob: its factors' sizes follow from the parameters' shapes and the rank, and exist only
once compression has started, so the blob is read whole rather than into preallocated
tensors. It holds the buckets' shapes, and loads only into a state whose buckets have them.
"""

from __future__ import annotations

import io
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.compression import Compression, DGCOptions, parse_compression
from plait.parallel.error_feedback import ErrorFeedback, finished

__all__ = [
    "ErrorFeedback",
    "HookBucket",
    "hook_for",
    "load_powersgd_state",
    "powersgd_state_bytes",
    "sign_hook",
    "threshold_hook",
    "topk_hook",
]


class HookBucket:
    """One reducer bucket as DDP's `GradBucket` presents it to a comm hook."""

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        shapes: list[torch.Size],
        params: list[nn.Parameter],
        *,
        last: bool,
    ) -> None:
        self._index, self._buffer, self._shapes = index, buffer, shapes
        self._params, self._last = params, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor

    def gradients(self) -> list[torch.Tensor]:
        out, offset = [], 0
        for shape in self._shapes:
            n = shape.numel()
            out.append(self._buffer[offset : offset + n].view(shape))
            offset += n
        return out

    def parameters(self) -> list[nn.Parameter]:
        return self._params

    def is_last(self) -> bool:
        return self._last


def threshold_hook(state: ErrorFeedback, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """Ström's threshold quantisation: ±TAU for every entry whose residual reaches it."""
    tau = float(state.value or 0.0)
    flat = bucket.buffer()
    if flat.numel() >= 2**30:
        raise ValueError(f"a bucket of {flat.numel()} entries is too large to index in 31 bits")
    residual = state.accumulate(bucket.index(), flat)
    up = (residual >= tau).nonzero().flatten()
    down = (residual <= -tau).nonzero().flatten()
    residual[up] -= tau
    residual[down] += tau
    codes = torch.cat([up * 2, down * 2 + 1]).to(torch.int32)
    total = torch.zeros_like(residual)
    for sent in state._gather(codes):
        sent = sent.long()
        signs = 1.0 - 2.0 * (sent % 2).to(total.dtype)
        total.index_add_(0, sent // 2, signs * tau)
    return finished(bucket, total / dist.get_world_size(state.process_group))


def topk_hook(state: ErrorFeedback, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """Top-k sparsification: the RATIO·n entries of largest residual magnitude."""
    flat = bucket.buffer()
    residual = state.accumulate(bucket.index(), flat)
    k = max(1, math.ceil(float(state.value or 1.0) * residual.numel()))
    index = residual.abs().topk(k, sorted=False).indices
    values = residual[index].clone()
    residual[index] = 0.0
    total = torch.zeros_like(residual)
    for i, v in zip(
        state._gather_same(index.to(torch.int32)), state._gather_same(values), strict=True
    ):
        total.index_add_(0, i.long(), v)
    return finished(bucket, total / dist.get_world_size(state.process_group))


_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_signs(positive: torch.Tensor) -> torch.Tensor:
    """A bool vector as bytes, eight entries each (the first entry in the lowest bit)."""
    pad = (-positive.numel()) % 8
    bits = torch.cat([positive, positive.new_zeros(pad)]).view(-1, 8).to(torch.uint8)
    return (bits * _BITS.to(bits.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    bits = packed.unsqueeze(1).bitwise_and(_BITS.to(packed.device)).ne(0)
    return bits.view(-1)[:n]


def sign_hook(state: ErrorFeedback, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """1-bit compression: each residual entry's sign, scaled by the mean magnitude."""
    flat = bucket.buffer()
    residual = state.accumulate(bucket.index(), flat)
    scale = residual.abs().mean().reshape(1)
    positive = residual >= 0
    residual.sub_(torch.where(positive, scale, -scale))
    total = torch.zeros_like(residual)
    packed = state._gather_same(pack_signs(positive))
    scales = state._gather_same(scale)
    for bits, s in zip(packed, scales, strict=True):
        signs = unpack_signs(bits, residual.numel())
        total.add_(torch.where(signs, s, -s))
    return finished(bucket, total / dist.get_world_size(state.process_group))


def hook_for(compression: Compression | str, group: dist.ProcessGroup) -> tuple[Any, Any] | None:
    """(hook, state) for `GradReducer` under `compression`; None for `none`."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    c = parse_compression(compression) if isinstance(compression, str) else compression
    if c.method == "none":
        return None
    if c.method == "fp16":
        return default_hooks.fp16_compress_hook, group
    if c.method == "bf16":
        return default_hooks.bf16_compress_hook, group
    if c.method == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=int(c.value or 1),
            start_powerSGD_iter=2,  # torch's minimum with error feedback
        )
        return powerSGD_hook.powerSGD_hook, state
    if c.method == "dgc":
        from plait.parallel.dgc import DGCState, dgc_hook

        return dgc_hook, DGCState(group, c.value, options=c.dgc or DGCOptions())
    hooks = {"threshold": threshold_hook, "topk": topk_hook, "sign": sign_hook}
    return hooks[c.method], ErrorFeedback(group, c.value)


def powersgd_state_bytes(state: Any, shapes: dict[int, list[list[int]]]) -> bytes:
    """torch's `PowerSGDState` as bytes (its process group left out, as its own
    `__getstate__` does), with `shapes`, each bucket's parameters' shapes, that it fits."""
    kind, key, position, has_gauss, gauss = state.rng.get_state()
    blob = {
        "shapes": {int(i): [list(map(int, s)) for s in v] for i, v in shapes.items()},
        "rank": int(state.matrix_approximation_rank),
        "iter": int(state.iter),
        "error": dict(state.error_dict),
        "p": dict(state.p_memory_dict),
        "q": dict(state.q_memory_dict),
        "rng": (str(kind), torch.from_numpy(key.astype("int64")), int(position),
                int(has_gauss), float(gauss)),
        "stats": (int(state.total_numel_before_compression),
                  int(state.total_numel_after_compression), int(state.next_stats_report)),
    }  # fmt: skip
    out = io.BytesIO()
    torch.save(blob, out)
    return out.getvalue()


def load_powersgd_state(
    state: Any, data: bytes, shapes: dict[int, list[list[int]]], device: torch.device
) -> bool:
    """Restore `state` from `powersgd_state_bytes`, its tensors onto `device`; False
    (`state` untouched: PowerSGD starts afresh) when the blob was saved for other
    buckets' shapes or another rank."""
    import numpy as np

    blob = torch.load(io.BytesIO(data), weights_only=True, map_location=device)
    ours = {int(i): [list(map(int, s)) for s in v] for i, v in shapes.items()}
    if blob["shapes"] != ours or blob["rank"] != state.matrix_approximation_rank:
        return False
    state.iter = blob["iter"]
    state.error_dict = {int(i): t for i, t in blob["error"].items()}
    state.p_memory_dict = {int(i): t for i, t in blob["p"].items()}
    state.q_memory_dict = {int(i): t for i, t in blob["q"].items()}
    kind, key, position, has_gauss, gauss = blob["rng"]
    state.rng.set_state((kind, key.cpu().numpy().astype(np.uint32), position, has_gauss, gauss))
    before, after, report = blob["stats"]
    state.total_numel_before_compression = before
    state.total_numel_after_compression = after
    state.next_stats_report = report
    return True
