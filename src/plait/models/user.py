"""A user's model named on the command line as `MODULE:FACTORY` (`plait train --model
examples/my_model.py:build`), imported and built in every worker.

MODULE is an importable module name (`my_package.models`) or the path of a `.py` file.
FACTORY is called as `FACTORY(vocab_size=V, seq_len=S)`: V is the data's vocabulary (the
tokenizer's), S is `--seq-len`; it trains on token data like plait's GPT (inputs [batch,
seq] of ids, targets the next ids). It returns either

- a module, cut into pipeline stages by its `blocks()` method or, for an `nn.Sequential`,
  by its children; its loss is its `loss(output, targets)` when it has one, else the mean
  next-token cross-entropy of logits [batch, seq, vocab]; or
- a pair `(module, loss)` with `loss(output, targets)` a mean over the micro-batch.

Every worker calls FACTORY after `torch.manual_seed(seed)`, so all start from the same weights.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["build_user_model", "load_factory"]


def _module(name: str, spec: str) -> Any:
    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"model={spec!r}: {name} is not a file")
        digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        key = f"plait_user_model_{digest}"
        if key in sys.modules:
            return sys.modules[key]
        found = importlib.util.spec_from_file_location(key, path)
        if found is None or found.loader is None:
            raise ValueError(f"model={spec!r}: {name} cannot be imported")
        module = importlib.util.module_from_spec(found)
        sys.modules[key] = module  # dataclasses and pickling look classes up there
        found.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ValueError(
            f"model={spec!r}: module {name!r} cannot be imported ({err}); give an importable "
            "module or the path of a .py file"
        ) from None


def load_factory(spec: str) -> Callable[..., Any]:
    """The callable `spec` ("MODULE:FACTORY") names; ValueError naming what is missing."""
    name, sep, attr = spec.rpartition(":")
    if not sep or not name or not attr:
        raise ValueError(
            f"model={spec!r} must read MODULE:FACTORY, e.g. examples/my_model.py:build"
        )
    factory = getattr(_module(name, spec), attr, None)
    if not callable(factory):
        raise ValueError(f"model={spec!r}: {name} has no callable {attr!r}")
    return factory


def build_user_model(
    spec: str, *, vocab_size: int, seq_len: int
) -> tuple[nn.Module, Callable[..., Any] | None]:
    """The user's model and its loss (None: the caller's default), built by the factory."""
    made = load_factory(spec)(vocab_size=vocab_size, seq_len=seq_len)
    model, loss = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model={spec!r} returned {type(model).__name__}: FACTORY must return an nn.Module "
            "or a pair (module, loss)"
        )
    if not (hasattr(model, "blocks") or isinstance(model, nn.Sequential)):
        raise ValueError(
            f"model={spec!r}: {type(model).__name__} has no blocks() method and is not an "
            "nn.Sequential: plait cannot cut it into pipeline stages"
        )
    if loss is None and callable(getattr(model, "loss", None)):
        loss = model.loss
    return model, loss
