"""Checkpoints: an engine's state under layout-free names, saved in the background with
torch.distributed.checkpoint, published atomically and verified before it is loaded."""

from plait.checkpoint.state import engine_state, load_engine_state
from plait.checkpoint.store import Checkpoint, CheckpointStore, find, published, verify

__all__ = [
    "Checkpoint",
    "CheckpointStore",
    "engine_state",
    "find",
    "load_engine_state",
    "published",
    "verify",
]
