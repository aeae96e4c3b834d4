"""The `--compress` setting: which gradient compression the data-parallel reduction uses.

Parsed and validated here, beneath everything that reads it (the config, the cost model,
the reducer's hooks in `plait.parallel.compress`), so a bad value is an error before any
worker starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["METHODS", "Compression", "check_zero", "parse_compression"]

METHODS = ("none", "fp16", "bf16", "powersgd", "threshold", "topk", "sign")


@dataclass(frozen=True)
class Compression:
    """A parsed `--compress` value: the method and its parameter (rank, tau or ratio)."""

    method: str = "none"
    value: float | None = None

    def __str__(self) -> str:
        if self.value is None:
            return self.method
        shown = int(self.value) if self.method == "powersgd" else self.value
        return f"{self.method}:{shown}"

    @property
    def error_feedback(self) -> bool:
        return self.method in ("threshold", "topk", "sign", "powersgd")


def parse_compression(text: str) -> Compression:
    """`none`, `fp16`, `bf16`, `powersgd:RANK`, `threshold:TAU`, `topk:RATIO` or `sign`."""
    method, _, arg = str(text).partition(":")
    usage = "none, fp16, bf16, powersgd:RANK, threshold:TAU, topk:RATIO or sign"
    if method not in METHODS:
        raise ValueError(f"compress={text!r}: unknown method; give one of {usage}")
    needs = {"powersgd": "RANK", "threshold": "TAU", "topk": "RATIO"}
    if method not in needs:
        if arg:
            raise ValueError(f"compress={text!r}: {method} takes no parameter; give {method}")
        return Compression(method)
    if not arg:
        raise ValueError(
            f"compress={text!r}: give {method}:{needs[method]} (e.g. {_EXAMPLE[method]})"
        )
    try:
        value = float(arg)
    except ValueError:
        raise ValueError(f"compress={text!r}: {needs[method]} must be a number") from None
    if method == "powersgd" and (value != int(value) or value < 1):
        raise ValueError(f"compress={text!r}: RANK must be a whole number >= 1")
    if method == "threshold" and not (value > 0 and math.isfinite(value)):
        raise ValueError(f"compress={text!r}: TAU must be a positive number")
    if method == "topk" and not 0 < value <= 1:
        raise ValueError(f"compress={text!r}: RATIO must be in (0, 1], the share of entries sent")
    return Compression(method, value)


_EXAMPLE = {"powersgd": "powersgd:2", "threshold": "threshold:0.01", "topk": "topk:0.01"}


def check_zero(compression: Compression | str, zero_stage: int) -> None:
    """ZeRO-2/3 reduce through FSDP2's reduce-scatter, which takes a lower reduce dtype but
    no hook: there only fp16 and bf16 apply."""
    c = parse_compression(compression) if isinstance(compression, str) else compression
    if zero_stage >= 2 and c.method not in ("none", "fp16", "bf16"):
        raise ValueError(
            f"compress={c} with zero={zero_stage}: ZeRO-2/3 reduce by FSDP2's reduce-scatter, "
            "which can only lower its dtype; use compress fp16 or bf16 there, or zero 0 or 1"
        )
