"""Labelled images held in memory, split once into training and validation samples.

Batches follow `CharCorpus.batch`: the training batch of a step is a pure function of
(seed, step), drawn with replacement, so every rank and every resumed run sees the same
batches. The validation split is read in order, whole.

`digits()` is scikit-learn's copy of the UCI optical handwritten digits (Alpaydin &
Kaynak, 1998: 1,797 8×8 grey images of 0-9, 16 grey levels), which ships inside the
scikit-learn package, so a classifier trains to a real accuracy without a download
(`pip install 'plait[data]'`). `cifar100(root)` reads a local CIFAR-100 python release
(`plait.data.cifar`), its test split used for validation.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ImageClassification", "cifar100", "digits"]


@dataclass(frozen=True)
class ImageClassification:
    """Training and validation images [n, channels, h, w] float32 with labels [n] int64."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    val_images: torch.Tensor
    val_labels: torch.Tensor
    num_classes: int

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(self.train_images.shape[1:])

    def batch(
        self, step: int, batch_size: int, *, seed: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(images, labels) of training step `step`: the same for the same (seed, step)."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        picked = torch.randint(0, len(self.train_labels), (batch_size,), generator=g)
        return self.train_images[picked], self.train_labels[picked]

    def validation(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The validation split in order, in batches of at most `batch_size`."""
        for start in range(0, len(self.val_labels), batch_size):
            end = start + batch_size
            yield self.val_images[start:end], self.val_labels[start:end]


def digits(*, val_fraction: float = 0.2) -> ImageClassification:
    """scikit-learn's digits as [n, 1, 8, 8] images scaled to [0, 1] (then centred); the
    last `val_fraction` of a fixed shuffle is the validation split."""
    try:
        datasets = importlib.import_module("sklearn.datasets")
    except ImportError as err:
        raise ImportError(
            "data='digits' reads scikit-learn's bundled digits: pip install 'plait[data]'"
        ) from err
    bunch = datasets.load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).div_(16.0).sub_(0.5)[:, None]
    labels = torch.tensor(bunch.target, dtype=torch.int64)
    # a fixed shuffle: the file is sorted by writer, the split should not be
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    images, labels = images[order], labels[order]
    cut = len(labels) - int(len(labels) * val_fraction)
    return ImageClassification(images[:cut], labels[:cut], images[cut:], labels[cut:], 10)


def cifar100(root: str | Path) -> ImageClassification:
    """CIFAR-100 from a local python release under `root`: train split, test split for
    validation, the 100 fine classes."""
    from plait.data.cifar import load_cifar100

    train_images, train_labels = load_cifar100(root, "train")
    val_images, val_labels = load_cifar100(root, "test")
    return ImageClassification(train_images, train_labels, val_images, val_labels, 100)
