"""Datasets that need no download: the Python standard library as a text corpus, synthetic."""

from plait.data.corpus import CharCorpus, stdlib_corpus

__all__ = ["CharCorpus", "stdlib_corpus"]
