"""What a compressed gradient reduction costs: bytes on the wire, collectives, and the
local encode/decode work (`plait.parallel.compress` defines the methods).

Per method, for `n` data-parallel ranks reducing `N` gradient entries:

- `none`: one all-reduce of the gradients (their dtype's bytes).
- `fp16`, `bf16`: one all-reduce of N two-byte entries; casting is two passes over memory.
- `powersgd:r`: per m×k matrix, all-reduces of P (m·r) and Q (k·r) in fp32 and two
  matmuls (4·m·k·r FLOPs) plus an orthogonalisation; vectors are all-reduced as they
  are. Without the matrices' shapes, square matrices of side `matrix_dim` are assumed.
- `threshold:τ`: an all-gather of every rank's 4-byte codes, as many as entries whose
  residual reached τ (the `density`, data-dependent: measured by `plait bench compress`
  or assumed), plus an all-gather of the counts.
- `topk:ρ`: an all-gather of ρ·N indices and values (8 bytes each).
- `sign`: an all-gather of N/8 bytes of signs and one 4-byte scale.
- `dgc:ρ`: an all-gather of ρ·N indices and values (8 bytes each); with `dense-vectors`
  and the matrices' shapes, ρ·M of the M matrix entries and an all-reduce of the other
  N − M entries. The steady state: its sparsity warm-up sends more in the first steps.

Encode and decode are memory-bound passes over the N fp32 entries (their count per
method below, from the hooks' code), charged at the device's memory bandwidth, unless
the device carries measured seconds per entry (`Device.codec_s_per_entry`, which
`plait profile` measures by running the hooks themselves: `plait.profile.codec`): then
the codec costs that figure × N. A figure is looked up by the `--compress` value
(`powersgd:4`), else by the method's name, else from the same method measured at other
parameters: PowerSGD's a line through its ranks (its matmuls grow linearly with the
rank), the others the nearest parameter measured. `codec_source` says which was used.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from plait.cluster import Device
from plait.compression import Compression, check_zero, parse_compression
from plait.cost.comm import AxisLinks, Collective, CollectiveAxis, CollectiveKind, dp_sync_time

__all__ = [
    "codec_figure",
    "codec_source",
    "codec_time",
    "compressed_collectives",
    "compressed_sync_time",
    "gradient_sync_time",
    "wire_bytes",
]

# passes over the fp32 residual per step, encode + decode (read or write of N entries)
_PASSES = {"none": 0, "fp16": 2, "bf16": 2, "powersgd": 6, "threshold": 8, "topk": 10, "sign": 8,
           "dgc": 14}  # fmt: skip


def compressed_collectives(
    compression: Compression | str,
    num_entries: float,
    *,
    dp: int,
    grad_bytes: int = 4,
    matrices: Sequence[tuple[int, int]] | None = None,
    matrix_dim: int = 1024,
    density: float = 0.001,
    axis: CollectiveAxis = "dp",
) -> list[Collective]:
    """The collectives one step's reduction of `num_entries` gradients issues per rank
    over the `dp` ranks of `axis` (`num_bytes` as `plait.cost.comm` counts them: an
    all-gather's output)."""
    c = parse_compression(compression) if isinstance(compression, str) else compression
    return _collectives(c, float(num_entries), dp, grad_bytes, matrices, matrix_dim, density, axis)


def _collectives(
    c: Compression,
    n: float,
    dp: int,
    grad_bytes: int,
    matrices: Sequence[tuple[int, int]] | None,
    matrix_dim: int,
    density: float,
    axis: CollectiveAxis,
) -> list[Collective]:
    def on_axis(kind: CollectiveKind, num_bytes: float) -> Collective:
        return Collective(kind=kind, num_bytes=num_bytes, axis=axis)

    if c.method == "none":
        return [on_axis("all_reduce", n * grad_bytes)]
    if c.method in ("fp16", "bf16"):
        return [on_axis("all_reduce", n * 2)]
    if c.method == "powersgd":
        r = int(c.value or 1)
        shapes = list(matrices) if matrices is not None else []
        in_matrices = sum(a * b for a, b in shapes)
        if matrices is None:  # all of it in square matrices of side matrix_dim
            count = n / (matrix_dim * matrix_dim)
            p = q = count * matrix_dim * r
            vectors = 0.0
        else:
            p = sum(a * min(r, a, b) for a, b in shapes)
            q = sum(b * min(r, a, b) for a, b in shapes)
            vectors = max(0.0, n - in_matrices)
        return [
            on_axis("all_reduce", vectors * 4),
            on_axis("all_reduce", p * 4),
            on_axis("all_reduce", q * 4),
        ]
    if c.method == "threshold":
        if not 0 <= density <= 1:
            raise ValueError(f"density={density} must lie in [0, 1] (share of entries sent)")
        return [
            on_axis("all_gather", dp * 8),
            on_axis("all_gather", dp * math.ceil(density * n) * 4),
        ]
    if c.method == "topk":
        k = max(1, math.ceil(float(c.value or 1.0) * n))
        return [on_axis("all_gather", dp * k * 8)]
    if c.method == "dgc":
        whole = matrices is None or c.dgc is None or not c.dgc.dense_vectors
        sparse = n if whole else float(sum(a * b for a, b in matrices or ()))
        k = max(1, math.ceil(float(c.value or 1.0) * sparse))
        return [
            on_axis("all_reduce", max(0.0, n - sparse) * 4),
            on_axis("all_gather", dp * k * 8),
        ]
    return [on_axis("all_gather", dp * (math.ceil(n / 8) + 4))]  # sign


def wire_bytes(compression: Compression | str, num_entries: float, **kw: object) -> float:
    """Bytes one rank hands to collectives per step (its input: an all-gather's output
    divided by the ranks), the quantity `plait bench compress` measures."""
    dp = int(kw.get("dp", 1))  # type: ignore[call-overload]
    total = 0.0
    for col in compressed_collectives(compression, num_entries, **kw):  # type: ignore[arg-type]
        total += col.num_bytes / dp if col.kind == "all_gather" else col.num_bytes
    return total


def compressed_sync_time(
    compression: Compression | str,
    num_entries: float,
    *,
    links: AxisLinks,
    device: Device,
    axis: CollectiveAxis = "dp",
    grad_bytes: int = 4,
    matrices: Sequence[tuple[int, int]] | None = None,
    matrix_dim: int = 1024,
    density: float = 0.001,
    codec_s_per_entry: Mapping[str, float] | None = None,
) -> float:
    """Seconds of one step's compressed reduction over the group `links` gives `axis`:
    its collectives on that group's link plus encode/decode on `device` (or from a
    measured `codec_s_per_entry`); nothing on one rank."""
    c = parse_compression(compression) if isinstance(compression, str) else compression
    n, link = links.group(axis)
    if n == 1 or link is None:
        return 0.0
    collectives = compressed_collectives(
        c, num_entries, dp=n, grad_bytes=grad_bytes, matrices=matrices,
        matrix_dim=matrix_dim, density=density, axis=axis,
    )  # fmt: skip
    wire = links.time(collectives)
    codec = codec_time(
        c, num_entries, device=device, matrices=matrices, matrix_dim=matrix_dim,
        codec_s_per_entry=codec_s_per_entry,
    )  # fmt: skip
    return wire + codec


def codec_time(
    compression: Compression | str,
    num_entries: float,
    *,
    device: Device,
    matrices: Sequence[tuple[int, int]] | None = None,
    matrix_dim: int = 1024,
    codec_s_per_entry: Mapping[str, float] | None = None,
) -> float:
    """Seconds of one step's encode + decode of `num_entries` gradients on `device`: the
    measured figure (`codec_s_per_entry`, else the device's) × entries, or the estimate."""
    c = parse_compression(compression) if isinstance(compression, str) else compression
    figures = device.codec_s_per_entry if codec_s_per_entry is None else codec_s_per_entry
    found = codec_figure(c, figures)
    if found is not None:
        return found[0] * num_entries
    codec = _PASSES[c.method] * num_entries * 4 / device.memory_bandwidth_Bps
    if c.method == "powersgd":
        side = matrix_dim if matrices is None else max(1, max(min(a, b) for a, b in matrices))
        flops = 4 * num_entries * min(int(c.value or 1), side)
        codec += flops / (_fp32_flops(device) * device.efficiency)
    return codec


def codec_figure(
    compression: Compression | str, figures: Mapping[str, float]
) -> tuple[float, str] | None:
    """(seconds per entry, which measurement gave it) for `compression` from measured
    `figures` keyed by `--compress` value or method; None when none fits (the module
    docstring gives the order of the look-up)."""
    c = parse_compression(compression) if isinstance(compression, str) else compression
    if c.method == "none":
        return None
    for key in (str(c), c.method):
        if key in figures:
            return figures[key], f"measured at {key}"
    same = sorted(
        (x.value, v) for x, v in ((_parsed(k), v) for k, v in figures.items())
        if x is not None and x.method == c.method and x.value is not None
    )  # fmt: skip
    if not same or c.value is None:
        return None
    label = ", ".join(f"{c.method}:{_shown(c.method, p)}" for p, _ in same)
    if c.method == "powersgd" and len(same) >= 2:
        slope, at_zero = _line(same)
        fitted = at_zero + slope * c.value
        if fitted > 0:
            return fitted, f"a line through {label}"
    value = c.value
    p, seconds = min(same, key=lambda item: abs(math.log(item[0] / value)))
    return seconds, f"measured at {c.method}:{_shown(c.method, p)}"


def codec_source(compression: Compression | str, device: Device) -> str:
    """Where `codec_time` takes `compression`'s encode/decode time on `device` from, in
    words (for `plait simulate` and `plait plan`)."""
    c = parse_compression(compression) if isinstance(compression, str) else compression
    found = codec_figure(c, device.codec_s_per_entry)
    if found is not None:
        return f"{found[0] * 1e9:.3g} ns per entry, {found[1]} (the profile's measurement)"
    return (
        f"estimated from {device.name}'s memory bandwidth (no measured figure: "
        "`plait profile --json > FILE` measures it, `--profile FILE` uses it)"
    )


def _parsed(key: str) -> Compression | None:
    try:
        return parse_compression(key)
    except ValueError:
        return None  # a bare method name with a parameter (`powersgd`): exact look-up only


def _shown(method: str, value: float) -> str:
    return str(int(value)) if method == "powersgd" else f"{value:g}"


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through (x, y) points."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return slope, my - slope * mx


def _fp32_flops(device: Device) -> float:
    """PowerSGD's matmuls run in fp32; a device that names no fp32 peak gets its lowest."""
    try:
        return device.peak("fp32")
    except ValueError:
        return min(device.peak_flops.values())


def gradient_sync_time(
    compression: Compression | str,
    num_params: float,
    *,
    zero_stage: int,
    links: AxisLinks,
    device: Device,
    param_bytes: int,
    axis: CollectiveAxis = "dp",
    codec_s_per_entry: Mapping[str, float] | None = None,
) -> float:
    """Seconds of one stage's gradient reduction over `axis` ("dp", or "edp" for expert
    gradients; its degree and link from `links`) under `compression`: the compressed
    reduction (ZeRO-1 then gathers the updated weights), or under ZeRO-2/3 a
    reduce-scatter in the lower dtype."""
    c = parse_compression(compression) if isinstance(compression, str) else compression
    check_zero(c, zero_stage)
    if c.method == "none":
        return dp_sync_time(num_params * param_bytes, zero_stage=zero_stage, links=links, axis=axis)
    if zero_stage >= 2:
        return dp_sync_time(num_params * 2, zero_stage=zero_stage, links=links, axis=axis)
    reduce = compressed_sync_time(
        c, num_params, links=links, axis=axis, device=device, grad_bytes=param_bytes,
        codec_s_per_entry=codec_s_per_entry,
    )  # fmt: skip
    if zero_stage == 1:  # the updated weights gathered (nothing on one rank)
        gather = Collective(kind="all_gather", num_bytes=num_params * param_bytes, axis=axis)
        reduce += links.time([gather])
    return reduce
