"""Reference models, each exposing its layers as pipeline blocks."""

from plait.models.gpt import GPT, GPTConfig
from plait.models.skip_mlp import SkipMLP

__all__ = ["GPT", "GPTConfig", "SkipMLP"]
