"""Datasets that need no download: the standard library as text, images shipped with a
package or in a local folder, synthetic data; and a user's own text or token files
(`plait.data.sources`, read as `plait train --data` names them)."""

from plait.data.cifar import load_cifar100
from plait.data.corpus import CharCorpus, stdlib_corpus
from plait.data.images import ImageClassification, cifar100, digits
from plait.data.sources import TokenData, token_data
from plait.data.synthetic import SyntheticClassification, SyntheticTokens

__all__ = [
    "CharCorpus",
    "ImageClassification",
    "SyntheticClassification",
    "SyntheticTokens",
    "TokenData",
    "cifar100",
    "digits",
    "load_cifar100",
    "stdlib_corpus",
    "token_data",
]
