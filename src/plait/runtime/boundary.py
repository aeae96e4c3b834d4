"""What crosses a stage boundary: a tensor, or a tuple/dict of tensors, flattened for P2P.

The structure and the shapes of each boundary are negotiated once (see `negotiate`) and
cached, so that every later message is a bare tensor transfer into a preallocated buffer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.compat import pytree
from plait.device import fork_rng
from plait.schedule import Schedule

__all__ = ["BoundaryMeta", "NegotiationTimeout", "flatten", "negotiate", "unflatten"]


@dataclass(frozen=True)
class BoundaryMeta:
    """Structure, shapes and dtypes of the value one stage hands to the next."""

    spec: str  # pytree.treespec_dumps of the structure
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @staticmethod
    def of(value: object) -> BoundaryMeta:
        leaves, spec = pytree.tree_flatten(value)
        bad = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)]
        if bad:
            raise TypeError(
                f"a stage boundary may carry only tensors (in a tuple, list or dict); found "
                f"{bad}: return non-tensor values from the last block only"
            )
        return BoundaryMeta(
            pytree.treespec_dumps(spec),
            tuple(tuple(t.shape) for t in leaves),
            tuple(str(t.dtype).removeprefix("torch.") for t in leaves),
        )

    def torch_dtypes(self) -> list[torch.dtype]:
        return [getattr(torch, d) for d in self.dtypes]

    def grad_indices(self) -> list[int]:
        """Leaves that carry a gradient back: the floating-point ones."""
        return [i for i, d in enumerate(self.torch_dtypes()) if d.is_floating_point]

    def empty(self, device: torch.device) -> list[torch.Tensor]:
        return [
            torch.empty(s, dtype=d, device=device)
            for s, d in zip(self.shapes, self.torch_dtypes(), strict=True)
        ]

    def empty_grads(self, device: torch.device) -> list[torch.Tensor]:
        dtypes = self.torch_dtypes()
        return [
            torch.empty(self.shapes[i], dtype=dtypes[i], device=device) for i in self.grad_indices()
        ]


def flatten(value: object) -> list[torch.Tensor]:
    leaves, _ = pytree.tree_flatten(value)
    return leaves


def unflatten(meta: BoundaryMeta, leaves: list[torch.Tensor]) -> object:
    return pytree.tree_unflatten(leaves, pytree.treespec_loads(meta.spec))


def negotiate(
    schedule: Schedule,
    stages: Mapping[int, nn.Module],
    rank: int,
    sample: object,
    *,
    group: dist.ProcessGroup | None,
    device: torch.device,
    forward_context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> dict[int, BoundaryMeta]:
    """The meta of every input boundary of this rank's stages (stage -> meta), learnt by
    probing: stages are probed along each pipeline in order with one forward each under
    no_grad, in eval mode and with the RNG state restored, so the probe changes nothing,
    and under the training's `forward_context` (its autocast), so that a bf16 stage's
    boundary is described in the dtype it sends. A rank learns the input of its stage
    from the previous stage's rank; a first stage takes `sample` (a micro-batch; needed
    only on ranks that hold a first stage). A collective over the pipeline group."""
    meta: dict[int, BoundaryMeta] = {}
    if schedule.num_stages == 1:  # no boundary to describe
        return meta
    place, local = schedule.stage_to_rank, dict[int, object]()
    objects = device if device.type != "cpu" else None  # NCCL sends objects from the GPU
    for pipeline in schedule.graph[0]:
        for s in (s for s in pipeline if s in stages):
            before, after = schedule.prev_stage(s), schedule.next_stage(s)
            if before is None:
                value: object = sample
            elif place[before] == rank:
                value = local[before]
            else:
                box: list[Any] = [None]
                with _named(f"stage {s} waited for the description of its input", place[before]):
                    dist.recv_object_list(box, group=group, group_src=place[before], device=objects)
                meta[s] = box[0]
                value = unflatten(box[0], [t.zero_() for t in box[0].empty(device)])
            local[s] = out = _probe(stages[s], value, device, forward_context)
            if after is None:
                continue
            meta[after] = BoundaryMeta.of(out)  # the boundary between s and after
            if place[after] != rank:
                with _named(f"stage {s} waited to describe its output", place[after]):
                    dist.send_object_list([meta[after]], group=group, group_dst=place[after],
                                          device=objects)  # fmt: skip
    return meta


class NegotiationTimeout(TimeoutError):
    """A peer did not take part in describing a boundary within the group's timeout."""


@contextmanager
def _named(what: str, peer: int) -> Iterator[None]:
    """Turn the backend's bare timeout into one naming what waited and for which rank."""
    try:
        yield
    except RuntimeError as err:
        if "timed out" not in str(err).lower():
            raise
        raise NegotiationTimeout(f"{what} from rank {peer}") from err


def _probe(
    module: nn.Module,
    value: object,
    device: torch.device,
    forward_context: Callable[[], AbstractContextManager[Any]],
) -> object:
    was_training = module.training
    try:
        module.eval()
        with torch.no_grad(), fork_rng(device), forward_context():
            return module(value)
    finally:
        module.train(was_training)
