"""The `--offload-activations` setting: which blocks swap their saved activations to the host.

Parsed here, beneath everything that reads it (the config, the simulator's plan, the
planner and the runtime's hooks in `plait.train.offload`), so a bad value is an error
before any worker starts. Blocks are named by their index in the whole model (0 is the
embedding of a GPT), whatever the partition, so a plan keeps its meaning when it is
re-partitioned.
"""

from __future__ import annotations

__all__ = ["check_offload_blocks", "normalize_offload", "offloaded_blocks"]


def normalize_offload(spec: str) -> str:
    """The canonical form of an `offload_activations` value: "none", "all" or sorted,
    distinct block indices joined by commas. Raises ValueError naming the value."""
    text = spec.strip().lower() if isinstance(spec, str) else spec
    if text in ("none", "all"):
        return str(text)
    parts = [p.strip() for p in str(text).split(",")]
    if not text or not all(p.isdigit() for p in parts):
        raise ValueError(
            f"offload_activations={spec!r} must be 'none', 'all' or block indices such as "
            "'1,2' (0 is the model's first block)"
        )
    return ",".join(str(i) for i in sorted({int(p) for p in parts}))


def offloaded_blocks(spec: str, num_blocks: int) -> frozenset[int]:
    """The indices of the blocks `spec` (canonical or not) offloads, in a model of
    `num_blocks` blocks; indices past the model are refused (`check_offload_blocks`)."""
    spec = normalize_offload(spec)
    if spec == "none":
        return frozenset()
    if spec == "all":
        return frozenset(range(num_blocks))
    check_offload_blocks(spec, num_blocks)
    return frozenset(int(p) for p in spec.split(","))


def check_offload_blocks(spec: str, num_blocks: int) -> None:
    """Raise ValueError if `spec` names a block index the model does not have."""
    spec = normalize_offload(spec)
    if spec in ("none", "all"):
        return
    last = max(int(p) for p in spec.split(","))
    if last >= num_blocks:
        raise ValueError(
            f"offload_activations={spec!r} names block {last}, but the model has {num_blocks} "
            f"blocks (0..{num_blocks - 1}): use smaller indices or 'all'"
        )
