"""Datasets that need no download: the Python standard library as a text corpus, synthetic."""

from plait.data.cifar import load_cifar100
from plait.data.corpus import CharCorpus, stdlib_corpus
from plait.data.synthetic import SyntheticClassification, SyntheticTokens

__all__ = [
    "CharCorpus",
    "SyntheticClassification",
    "SyntheticTokens",
    "load_cifar100",
    "stdlib_corpus",
]
