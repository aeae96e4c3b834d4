"""CIFAR-100 read from a local copy of its official Python (pickle) release.

Krizhevsky, "Learning Multiple Layers of Features from Tiny Images" (2009). Nothing is
downloaded: extract the 'CIFAR-100 python version' archive under a folder of your
choice and pass that folder as `root`. Each split file is a pickled dict (written by
Python 2, so read with `encoding="bytes"`) holding `b"data"` (uint8 [N, 3072]: 1024 red,
then 1024 green, then 1024 blue values of a 32×32 image in row-major order),
`b"fine_labels"` (100 classes) and `b"coarse_labels"` (20 superclasses).

The files are unpickled with an allow-list that admits only what the release contains
(numpy arrays), so a tampered file cannot run code.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

__all__ = ["CIFAR100_MEAN", "CIFAR100_STD", "CIFAR100_URL", "cifar100_classes", "load_cifar100"]

CIFAR100_URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
# Per-channel mean and standard deviation of the 50,000 training images, pixels in [0, 1].
CIFAR100_MEAN = (0.5070751592371323, 0.48654887331495095, 0.4409178433670343)
CIFAR100_STD = (0.2673342858792401, 0.2564384629170883, 0.27615047132568404)

_FOLDER = "cifar-100-python"
_FILES = ("train", "test", "meta")
_ALLOWED = {
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),  # bytes inside a protocol-2 pickle written by Python 3
}


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("numpy.core"):  # the name numpy had when the files were written
            module = "numpy._core" + module.removeprefix("numpy.core")
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(
                f"{module}.{name} is not part of the CIFAR-100 release: the file is not the "
                f"official one; extract {CIFAR100_URL} again"
            )
        return super().find_class(module, name)


def _folder(root: str | Path) -> Path:
    root = Path(root)
    folder = root if root.name == _FOLDER else root / _FOLDER
    missing = [name for name in _FILES if not (folder / name).is_file()]
    if missing:
        expected = ", ".join(str(folder / name) for name in _FILES)
        raise FileNotFoundError(
            f"CIFAR-100 not found under {root}: expected the files {expected} "
            f"(missing: {', '.join(missing)}). Download the 'CIFAR-100 python version' "
            f"archive from {CIFAR100_URL} and extract it with "
            f"`tar -xzf cifar-100-python.tar.gz -C {root}`"
        )
    return folder


def _unpickle(path: Path) -> dict[bytes, Any]:
    with path.open("rb") as f:
        content = _ArrayUnpickler(f, encoding="bytes").load()
    if not isinstance(content, dict):
        raise ValueError(f"{path} holds a {type(content).__name__}, not the CIFAR-100 dict")
    return content


def load_cifar100(
    root: str | Path,
    split: Literal["train", "test"] = "train",
    *,
    label_kind: Literal["fine", "coarse"] = "fine",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(images float32 [N, 3, 32, 32] normalised per channel, labels int64 [N]).

    `root` is the folder that contains `cifar-100-python/` (or that folder itself);
    `label_kind` picks the 100 fine classes or the 20 coarse superclasses.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r} is not a CIFAR-100 split: use 'train' or 'test'")
    if label_kind not in ("fine", "coarse"):
        raise ValueError(f"label_kind={label_kind!r}: use 'fine' (100) or 'coarse' (20)")
    path = _folder(root) / split
    content = _unpickle(path)
    key = f"{label_kind}_labels".encode()
    if b"data" not in content or key not in content:
        raise ValueError(f"{path} lacks b'data' or {key!r}: extract {CIFAR100_URL} again")
    data = np.asarray(content[b"data"], dtype=np.uint8)
    labels = torch.tensor(list(content[key]), dtype=torch.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or data.shape[0] != len(labels):
        raise ValueError(
            f"{path} holds data of shape {data.shape} and {len(labels)} labels; expected "
            f"[N, 3072] and N labels: extract {CIFAR100_URL} again"
        )
    images = torch.from_numpy(data.copy()).view(-1, 3, 32, 32).float().div_(255.0)
    mean = torch.tensor(CIFAR100_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR100_STD).view(1, 3, 1, 1)
    return images.sub_(mean).div_(std), labels


def cifar100_classes(
    root: str | Path, *, label_kind: Literal["fine", "coarse"] = "fine"
) -> list[str]:
    """The class names, indexed by label, from the release's `meta` file."""
    path = _folder(root) / "meta"
    key = f"{label_kind}_label_names".encode()
    names = _unpickle(path).get(key)
    if names is None:
        raise ValueError(f"{path} lacks {key!r}: extract {CIFAR100_URL} again")
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]
