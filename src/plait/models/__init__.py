"""Reference models, each exposing its layers as pipeline blocks."""

from plait.models.gpt import GPT, GPTConfig
from plait.models.moe import MoEConfig, MoEGPT
from plait.models.record import load_exported
from plait.models.resnet import ResNet18
from plait.models.skip_mlp import SkipMLP

__all__ = ["GPT", "GPTConfig", "MoEConfig", "MoEGPT", "ResNet18", "SkipMLP", "load_exported"]
