"""The `--compress` setting: which gradient compression the data-parallel reduction uses.

Parsed and validated here, beneath everything that reads it (the config, the cost model,
the reducer's hooks in `plait.parallel.compress`), so a bad value is an error before any
worker starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DEFAULT_CODECS", "DGC_OPTIONS", "METHODS", "Compression", "DGCOptions",
           "check_zero", "parse_compression"]  # fmt: skip

METHODS = ("none", "fp16", "bf16", "powersgd", "threshold", "topk", "sign", "dgc")
# DGC's remedies that `dgc:RATIO:no-NAME` turns off (Lin et al., ICLR 2018, §3)
DGC_OPTIONS = ("correction", "masking", "clipping", "warmup")
#: What `plait profile` measures: each method, PowerSGD at two ranks (a line through them
#: gives the others, `plait.cost.compress.codec_figure`).
DEFAULT_CODECS = ("fp16", "bf16", "powersgd:1", "powersgd:4", "threshold:0.01", "topk:0.01", "sign")
_DGC_WARMUP = 20  # steps of the sparsity warm-up unless `warmup=STEPS` says otherwise


@dataclass(frozen=True)
class DGCOptions:
    """Deep Gradient Compression's remedies (Lin et al., ICLR 2018): momentum correction,
    momentum factor masking, local gradient clipping (at the run's clip threshold ×
    N^-1/2, or `clip`), and the sparsity warm-up over `warmup_steps` steps; and
    `dense_vectors`, the authors' code's choice of all-reducing tensors of one dimension
    whole (the paper sparsifies every layer), and `global_topk`, one top-k over each
    bucket instead of one per tensor (Shi et al., ICDCS 2019, "gTop-k")."""

    correction: bool = True
    masking: bool = True
    clipping: bool = True
    warmup_steps: int = _DGC_WARMUP
    clip: float | None = None
    dense_vectors: bool = False
    global_topk: bool = False

    def __str__(self) -> str:
        parts = [f"no-{name}" for name in DGC_OPTIONS[:3] if not getattr(self, name)]
        if self.warmup_steps != _DGC_WARMUP:
            parts.append(f"warmup={self.warmup_steps}" if self.warmup_steps else "no-warmup")
        if self.clip is not None:
            parts.append(f"clip={self.clip:g}")
        if self.dense_vectors:
            parts.append("dense-vectors")
        if self.global_topk:
            parts.append("global-topk")
        return "".join(f":{p}" for p in parts)


@dataclass(frozen=True)
class Compression:
    """A parsed `--compress` value: the method and its parameter (rank, tau or ratio)."""

    method: str = "none"
    value: float | None = None
    dgc: DGCOptions | None = None  # dgc's remedies (None for the other methods)

    def __str__(self) -> str:
        if self.value is None:
            return self.method
        shown = int(self.value) if self.method == "powersgd" else self.value
        return f"{self.method}:{shown}{self.dgc or ''}"

    @property
    def error_feedback(self) -> bool:
        return self.method in ("threshold", "topk", "sign", "powersgd", "dgc")


def parse_compression(text: str) -> Compression:
    """`none`, `fp16`, `bf16`, `powersgd:RANK`, `threshold:TAU`, `topk:RATIO`, `sign` or
    `dgc:RATIO[:OPTION...]` (RATIO the share of entries sent, `0.001`, or the factor
    fewer, `1000x`; OPTION `no-correction`, `no-masking`, `no-clipping`, `no-warmup`,
    `warmup=STEPS`, `clip=NORM`, `dense-vectors` or `global-topk`: see
    `plait.parallel.dgc`)."""
    method, _, arg = str(text).partition(":")
    usage = "none, fp16, bf16, powersgd:RANK, threshold:TAU, topk:RATIO, sign or dgc:RATIO"
    if method not in METHODS:
        raise ValueError(f"compress={text!r}: unknown method; give one of {usage}")
    if method == "dgc":
        return _parse_dgc(text, arg)
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


def _parse_dgc(text: str, arg: str) -> Compression:
    ratio, *options = arg.split(":") if arg else [""]
    if not ratio:
        raise ValueError(f"compress={text!r}: give dgc:RATIO (e.g. dgc:0.001 or dgc:1000x)")
    try:
        value = 1 / float(ratio[:-1]) if ratio.endswith("x") else float(ratio)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"compress={text!r}: RATIO must be a number (0.001) or a factor "
                         "(1000x)") from None  # fmt: skip
    if not 0 < value <= 1:
        raise ValueError(f"compress={text!r}: RATIO must be in (0, 1], the share of entries "
                         "sent, or a factor >= 1 such as 1000x")  # fmt: skip
    fields: dict[str, object] = {}
    for option in options:
        key, eq, number = option.partition("=")
        if not eq and key.removeprefix("no-") in DGC_OPTIONS and key.startswith("no-"):
            name = key.removeprefix("no-")
            fields.update({"warmup_steps": 0} if name == "warmup" else {name: False})
        elif eq and key in ("warmup", "clip"):
            fields.update(_dgc_number(text, key, number))
        elif option in ("dense-vectors", "global-topk"):
            fields[option.replace("-", "_")] = True
        else:
            raise ValueError(
                f"compress={text!r}: unknown dgc option {option!r}; give no-correction, "
                "no-masking, no-clipping, no-warmup, warmup=STEPS, clip=NORM, dense-vectors "
                "or global-topk"
            )
    return Compression("dgc", value, DGCOptions(**fields))  # type: ignore[arg-type]


def _dgc_number(text: str, key: str, number: str) -> dict[str, object]:
    try:
        x = float(number)
    except ValueError:
        x = math.nan
    if key == "warmup":
        if not (x >= 0 and x == int(x)):
            raise ValueError(f"compress={text!r}: warmup=STEPS takes a whole number >= 0")
        return {"warmup_steps": int(x)}
    if not (x > 0 and math.isfinite(x)):
        raise ValueError(f"compress={text!r}: clip=NORM takes a positive number")
    return {"clip": x}


def check_zero(compression: Compression | str, zero_stage: int) -> None:
    """ZeRO-2/3 reduce through FSDP2's reduce-scatter, which takes a lower reduce dtype but
    no hook: there only fp16 and bf16 apply."""
    c = parse_compression(compression) if isinstance(compression, str) else compression
    if zero_stage >= 2 and c.method not in ("none", "fp16", "bf16"):
        raise ValueError(
            f"compress={c} with zero={zero_stage}: ZeRO-2/3 reduce by FSDP2's reduce-scatter, "
            "which can only lower its dtype; use compress fp16 or bf16 there, or zero 0 or 1"
        )
