"""The user-facing engine: launching workers and running training on them."""

from plait.train.entry import run
from plait.train.launch import launch

__all__ = ["launch", "run"]
