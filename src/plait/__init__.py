"""plait: train one PyTorch model on many workers, with a plan it predicts before it runs."""

__version__ = "0.1.0"
