"""CIFAR-100 from a local folder in the official pickle format (a tiny fake one here)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.data import load_cifar100
from plait.data.cifar import CIFAR100_MEAN, CIFAR100_STD, CIFAR100_URL, cifar100_classes


def _split(num: int, seed: int) -> dict[bytes, object]:
    """One split with the keys of the release (the originals are Python 2 dicts of str,
    which Python 3 reads back as bytes with encoding='bytes')."""
    rng = np.random.default_rng(seed)
    return {
        b"batch_label": b"training batch 1 of 1",
        b"filenames": [f"img_{i}.png".encode() for i in range(num)],
        b"fine_labels": [int(x) for x in rng.integers(0, 100, num)],
        b"coarse_labels": [int(x) for x in rng.integers(0, 20, num)],
        b"data": rng.integers(0, 256, (num, 3072), dtype=np.uint8),
    }


def _write(path: Path, content: object, *, numpy_core: bool = False) -> None:
    raw = pickle.dumps(content, protocol=2)  # protocol 2, as Python 2's cPickle wrote them
    if numpy_core:  # the module name numpy had when the release was pickled
        raw = raw.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    path.write_bytes(raw)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    _write(folder / "train", _split(6, seed=0), numpy_core=True)
    _write(folder / "test", _split(4, seed=1))
    meta = {
        b"fine_label_names": [f"fine{i}".encode() for i in range(100)],
        b"coarse_label_names": [f"coarse{i}".encode() for i in range(20)],
    }
    _write(folder / "meta", meta)
    return tmp_path


def test_load_train_and_test_splits(root: Path) -> None:
    images, labels = load_cifar100(root, "train")
    assert images.shape == (6, 3, 32, 32) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and labels.tolist() == _split(6, seed=0)[b"fine_labels"]
    raw = _split(6, seed=0)[b"data"]
    assert isinstance(raw, np.ndarray)
    # pixel (row 2, col 5) of image 3, green channel: offset 1024 + 2·32 + 5 in the row
    pixel = raw[3, 1024 + 2 * 32 + 5] / 255.0
    expected = (pixel - CIFAR100_MEAN[1]) / CIFAR100_STD[1]
    assert images[3, 1, 2, 5].item() == pytest.approx(expected, rel=1e-5)

    test_images, coarse = load_cifar100(root / "cifar-100-python", "test", label_kind="coarse")
    assert test_images.shape == (4, 3, 32, 32)
    assert coarse.tolist() == _split(4, seed=1)[b"coarse_labels"]
    assert cifar100_classes(root)[:2] == ["fine0", "fine1"]
    assert len(cifar100_classes(root, label_kind="coarse")) == 20


def test_missing_folder_names_the_files_and_the_archive(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        load_cifar100(tmp_path / "data")
    message = str(info.value)
    for name in ("train", "test", "meta"):
        assert str(tmp_path / "data" / "cifar-100-python" / name) in message
    assert CIFAR100_URL in message and "CIFAR-100 python version" in message


def test_bad_split_and_foreign_pickles_are_refused(root: Path) -> None:
    with pytest.raises(ValueError, match=r"split='valid'.*'train' or 'test'"):
        load_cifar100(root, "valid")  # type: ignore[arg-type]
    _write(root / "cifar-100-python" / "test", {b"data": os.system})  # code, not data
    with pytest.raises(pickle.UnpicklingError, match="not part of the CIFAR-100 release"):
        load_cifar100(root, "test")
