"""Reading a checkpoint without running code from it: DCP's `.metadata` pickle through an
allow list, and DCP's non-tensor entries with `weights_only`.

DCP's `FileSystemReader` unpickles `.metadata` with plain `pickle`, and its default load
planner reads non-tensor entries (an optimizer's learning rate, betas) with
`torch.load(weights_only=False)`; tensors it reads with `weights_only=True`. A checkpoint
from elsewhere could thus run code on load. `SafeReader` hands DCP metadata unpickled by an
allow list (DCP's own dataclasses and enums, `torch.Size`, dtypes, layouts, paths), and
`SafeLoadPlanner` reads non-tensor entries with `weights_only=True` (numbers, strings,
tuples and lists pass).
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

__all__ = ["SafeLoadPlanner", "SafeReader", "read_metadata"]

_METADATA = ".metadata"  # DCP's FileSystemWriter names its global metadata file so
_DCP = "torch.distributed.checkpoint."
# globals a DCP `.metadata` pickle refers to besides DCP's own dataclasses and enums
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` and refuses any other global (no code of the file runs)."""

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        if (module, name) in _ALLOWED or isinstance(found, torch.dtype):
            return found
        # constructing a DCP dataclass or enum only stores its fields
        is_data = isinstance(found, type) and (
            dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)
        )
        if module.startswith(_DCP) and is_data:
            return found
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which DCP metadata never does")


def read_metadata(path: Path) -> Metadata:
    """DCP's metadata of the checkpoint at `path`, unpickled through the allow list."""
    file = path / _METADATA
    try:
        metadata = _MetadataUnpickler(io.BytesIO(file.read_bytes())).load()
    except Exception as err:  # a damaged pickle raises any of a dozen exception types
        raise ValueError(f"{file} is not readable DCP metadata ({err})") from err
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{file} holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader, with metadata read through the allow list."""

    def __init__(self, path: Path, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata if metadata is not None else read_metadata(Path(path))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            _set(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _set(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """`root[path[0]][path[1]]... = value` (DCP's flattened key back to its place)."""
    for key in path[:-1]:
        root = root[key]
    root[path[-1]] = value
