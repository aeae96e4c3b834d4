"""What crosses a stage boundary: a tensor, or a tuple/dict of tensors, flattened for P2P.

The structure and the shapes of each boundary are negotiated once (see `negotiate`) and
cached, so that every later message is a bare tensor transfer into a preallocated buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

__all__ = ["BoundaryMeta", "flatten", "unflatten"]


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
