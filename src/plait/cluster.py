"""What the hardware is: devices (speed, memory), links (latency, bandwidth) and their topology.

A `Cluster` is a list of node groups, each a number of identical nodes holding identical
devices joined by an intra-node link; nodes talk over one inter-node link. Global ranks are
numbered node by node, groups in order, so a cluster may mix device kinds (two nodes of
A100 followed by two nodes of V100). Presets (`local-cpu`, `dgx-a100-80gb`, `dgx-h100`)
describe one node; `Cluster.with_nodes(n)` scales them; TOML files (read and written by
`plait.presets`) describe anything else; `plait.presets.load_cluster` takes either.

Limits: one flat inter-node link (no rail-optimised or fat-tree oversubscription model);
a link's bandwidth is per device and per direction.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache

__all__ = [
    "DTYPE_BYTES",
    "LOCAL",
    "Cluster",
    "Device",
    "Link",
    "NodeGroup",
    "calibrate_local_cpu",
    "dtype_bytes",
    "local_cpu",
    "measured_cluster",
    "normalize_dtype",
]

GIB = 1 << 30

#: Bytes per element of each canonical dtype (tf32 is stored as fp32).
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1}
_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float8": "fp8",
}


def normalize_dtype(name: str) -> str:
    """The canonical dtype name (`fp32`, `tf32`, `fp16`, `bf16`, `fp8`) for `name`."""
    key = name.strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ValueError(f"dtype {name!r} is unknown; use one of {sorted(DTYPE_BYTES)}")
    return key


@cache  # the planner asks for each of tens of thousands of candidates
def dtype_bytes(name: str) -> int:
    """Bytes per element of dtype `name`."""
    return DTYPE_BYTES[normalize_dtype(name)]


def _positive(owner: str, name: str, value: float) -> None:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (number and value > 0 and not math.isnan(value)):
        raise ValueError(f"{owner}: {name}={value!r} must be a positive number")


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator: peak FLOP/s per dtype, the fraction of peak large matmuls achieve,
    memory capacity, memory bandwidth (which bounds the optimizer step), the bandwidth of the
    link to host memory (which bounds offload), the measured seconds per gradient entry
    of each gradient compression's encode + decode, by `--compress` value
    (`plait.profile.codec`; empty: the cost model estimates them), and `dispatch_s`, the
    host seconds a process takes to issue one block's forward or backward (its operators'
    Python and kernel-launch overhead, `plait.sim.replica`; 0: unknown, never binding).

    `dispatch_s` is per block action because the block is the cost model's unit (a
    `BlockCost` carries FLOPs and bytes, no operator count) and the unit `plait profile`
    times; a stage's action issues as many of them as it has blocks.

    `message_s` is the time a rank's computing thread spends posting one message of a
    pipeline boundary (a send or a receive, `plait.sim.host.posting_times`): on CPU workers gloo's
    `isend`/`irecv` run on the thread that computes (0.08-0.13 ms each among 4 workers on a
    2-core host, where the runtime's send and receive actions with their bookkeeping took
    0.1-0.5 ms, and a 4-stage pipeline's middle rank posts 16 a step); measured for local
    workers by `plait.profile.calibrate.posting_s`. 0: posting is free (NCCL's is
    asynchronous)."""

    name: str
    peak_flops: Mapping[str, float] = field(hash=False)
    efficiency: float = 1.0
    memory_bytes: int
    memory_bandwidth_Bps: float = 1e11
    # the host link (PCIe 4.0 x16 moves about 25 GB/s each way): offloaded activations and
    # optimizer state cross it (`plait.cost.memory.offload_time`)
    host_bandwidth_Bps: float = 2.5e10
    codec_s_per_entry: Mapping[str, float] = field(default_factory=dict, hash=False)
    # a device this many times slower than its numbers say: its achievable FLOP/s are
    # divided by it, and plait's runtime pads its ranks' compute to that many times its
    # time (`plait.emulate.slowdown`), so heterogeneous plans can be tried on one CPU
    slowdown: float = 1.0
    dispatch_s: float = 0.0
    message_s: float = 0.0

    def __post_init__(self) -> None:
        owner = f"device {self.name!r}"
        if not self.peak_flops:
            raise ValueError(f"{owner}: peak_flops is empty; give e.g. {{'bf16': 312e12}}")
        flops = {normalize_dtype(k): float(v) for k, v in self.peak_flops.items()}
        for key, value in flops.items():
            _positive(owner, f"peak_flops[{key}]", value)
        object.__setattr__(self, "peak_flops", flops)
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"{owner}: efficiency={self.efficiency} must lie in (0, 1]")
        _positive(owner, "memory_bytes", self.memory_bytes)
        _positive(owner, "memory_bandwidth_Bps", self.memory_bandwidth_Bps)
        _positive(owner, "host_bandwidth_Bps", self.host_bandwidth_Bps)
        codec = {str(k): float(v) for k, v in self.codec_s_per_entry.items()}
        for key, value in codec.items():
            if not math.isfinite(value):
                raise ValueError(f"{owner}: codec_s_per_entry[{key}]={value!r} must be finite")
            _positive(owner, f"codec_s_per_entry[{key}]", value)
        object.__setattr__(self, "codec_s_per_entry", codec)
        if not (isinstance(self.slowdown, int | float) and 1 <= self.slowdown < math.inf):
            raise ValueError(f"{owner}: slowdown={self.slowdown!r} must be a number >= 1")
        for name, what in (("dispatch_s", "block action"), ("message_s", "message posted")):
            value = getattr(self, name)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not (number and 0 <= value < math.inf):
                raise ValueError(
                    f"{owner}: {name}={value!r} must be a finite number of seconds >= 0 "
                    f"(0: no host time per {what})"
                )

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s in `dtype` (fp32 falls back on nothing: name what the device has)."""
        key = normalize_dtype(dtype)
        if key not in self.peak_flops:
            raise ValueError(
                f"device {self.name!r} has no peak_flops for {key!r}; it knows "
                f"{sorted(self.peak_flops)}: add {key} to its peak_flops or train in one of those"
            )
        return self.peak_flops[key]

    def achievable_flops(self, dtype: str) -> float:
        """FLOP/s a large matmul reaches: peak × efficiency (/ slowdown)."""
        return self.peak(dtype) * self.efficiency / self.slowdown


@dataclass(frozen=True, kw_only=True)
class Link:
    """A connection between two devices: time for n bytes is latency + n / bandwidth."""

    latency_s: float
    bandwidth_Bps: float

    def __post_init__(self) -> None:
        number = isinstance(self.latency_s, int | float) and not isinstance(self.latency_s, bool)
        if not (number and self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"link: latency_s={self.latency_s!r} must be finite and >= 0")
        _positive("link", "bandwidth_Bps", self.bandwidth_Bps)

    def time(self, num_bytes: float) -> float:
        """Seconds to move `num_bytes` point to point (alpha-beta model)."""
        return self.latency_s + num_bytes / self.bandwidth_Bps if num_bytes > 0 else 0.0


#: The link of a rank with itself: free.
LOCAL = Link(latency_s=0.0, bandwidth_Bps=math.inf)


@dataclass(frozen=True, kw_only=True)
class NodeGroup:
    """`num_nodes` identical nodes, each with `devices_per_node` devices on `intra_node`.

    `processors`: the devices of a node time-share this many processors, device i running
    on processor i mod `processors` (CPU workers outnumbering the cores they are pinned to,
    see `plait.mesh.cpu_cores_for`); None when every device computes on its own.
    `sharing_efficiency`: the share of a processor's speed its devices keep while they
    time-share it (context switches and cache refills cost the rest; measured, see
    `plait.bench.sim_accuracy`).
    """

    device: Device
    devices_per_node: int
    intra_node: Link
    num_nodes: int = 1
    processors: int | None = None
    sharing_efficiency: float = 1.0

    def __post_init__(self) -> None:
        for name in ("devices_per_node", "num_nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"node group {self.device.name!r}: {name}={value!r} must be >= 1")
        if self.processors is not None and not (
            isinstance(self.processors, int) and self.processors >= 1
        ):
            raise ValueError(
                f"node group {self.device.name!r}: processors={self.processors!r} must be an "
                "integer >= 1, or None when each device has its own"
            )
        if not 0.0 < self.sharing_efficiency <= 1.0:
            raise ValueError(
                f"node group {self.device.name!r}: sharing_efficiency={self.sharing_efficiency} "
                "must be in (0, 1]"
            )

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Node groups in rank order, and the link between any two nodes."""

    name: str
    groups: tuple[NodeGroup, ...]
    inter_node: Link
    _node_of: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _group_of: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _processor_of: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError(f"cluster {self.name!r} has no node groups; add at least one")
        object.__setattr__(self, "groups", tuple(self.groups))
        node_of: list[int] = []
        group_of: list[int] = []
        processor_of: list[int] = []
        node = 0
        for g_index, group in enumerate(self.groups):
            per_node = group.devices_per_node
            for _ in range(group.num_nodes):
                node_of += [node] * per_node
                group_of += [g_index] * per_node
                base = len(processor_of)  # processors are numbered by their node's first device
                processor_of += [base + i % (group.processors or per_node) for i in range(per_node)]
                node += 1
        object.__setattr__(self, "_node_of", tuple(node_of))
        object.__setattr__(self, "_group_of", tuple(group_of))
        object.__setattr__(self, "_processor_of", tuple(processor_of))

    @property
    def num_devices(self) -> int:
        return len(self._node_of)

    @property
    def num_nodes(self) -> int:
        return sum(g.num_nodes for g in self.groups)

    @property
    def is_homogeneous(self) -> bool:
        return len({g.device for g in self.groups}) == 1

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_devices:
            raise ValueError(
                f"rank {rank} is outside cluster {self.name!r} of {self.num_devices} devices; "
                "use fewer ranks or more nodes"
            )

    def node_of(self, rank: int) -> int:
        """The node index that global rank `rank` sits on."""
        self._check_rank(rank)
        return self._node_of[rank]

    def sharing_efficiency(self, rank: int) -> float:
        """What is left of a processor's speed while devices time-share it (1.0: ideal)."""
        self._check_rank(rank)
        return self.groups[self._group_of[rank]].sharing_efficiency

    def processor(self, rank: int) -> int:
        """The processor global rank `rank` computes on (ranks that share one time-share it)."""
        self._check_rank(rank)
        return self._processor_of[rank]

    @property
    def shares_processors(self) -> bool:
        """Whether some devices time-share a processor (see `NodeGroup.processors`)."""
        return len(set(self._processor_of)) < self.num_devices

    def device(self, rank: int) -> Device:
        """The device of global rank `rank`."""
        self._check_rank(rank)
        return self.groups[self._group_of[rank]].device

    def link(self, a: int, b: int) -> Link:
        """The link two ranks share: free on the same rank, intra-node on one node, else
        inter-node."""
        if a == b:
            self._check_rank(a)
            return LOCAL
        if self.node_of(a) == self.node_of(b):
            return self.groups[self._group_of[a]].intra_node
        return self.inter_node

    def group_link(self, ranks: Sequence[int]) -> Link:
        """The bottleneck link of a collective over `ranks`: the largest latency and the
        smallest bandwidth among the links a ring through them uses."""
        members = sorted(set(ranks))
        if len(members) < 2:
            return LOCAL
        links = {self.groups[self._group_of[r]].intra_node for r in members}
        if len({self.node_of(r) for r in members}) > 1:
            links.add(self.inter_node)
        return Link(
            latency_s=max(link.latency_s for link in links),
            bandwidth_Bps=min(link.bandwidth_Bps for link in links),
        )

    def with_nodes(self, num_nodes: int) -> Cluster:
        """The same cluster with `num_nodes` nodes of its (single) node kind."""
        if len(self.groups) != 1:
            raise ValueError(
                f"cluster {self.name!r} mixes {len(self.groups)} node kinds; set the count of "
                "each [[nodes]] entry in its TOML file instead of num_nodes"
            )
        if not isinstance(num_nodes, int) or num_nodes < 1:
            raise ValueError(f"num_nodes={num_nodes!r} must be an integer >= 1")
        return replace(self, groups=(replace(self.groups[0], num_nodes=num_nodes),))


def measured_cluster(
    *,
    name: str,
    flops: Mapping[str, float],
    memory_bytes: int,
    devices_per_node: int,
    intra_node: Link,
    inter_node: Link | None = None,
    num_nodes: int = 1,
    memory_bandwidth_Bps: float = 1e11,
) -> Cluster:
    """A cluster of identical devices from measured numbers (the profiler's hook).

    `flops` are achieved FLOP/s per dtype, so efficiency is 1."""
    device = Device(
        name=name,
        peak_flops=dict(flops),
        efficiency=1.0,
        memory_bytes=memory_bytes,
        memory_bandwidth_Bps=memory_bandwidth_Bps,
    )
    group = NodeGroup(
        device=device, devices_per_node=devices_per_node, intra_node=intra_node, num_nodes=num_nodes
    )
    return Cluster(name=name, groups=(group,), inter_node=inter_node or intra_node)


def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 8 * GIB


def local_cpu(*, flops: float = 2e10, devices: int | None = None) -> Cluster:
    """This machine: one device per CPU core, sharing memory; nominal speed unless
    `flops` (per device, fp32, e.g. from `calibrate_local_cpu`) is given."""
    count = devices or os.cpu_count() or 1
    return measured_cluster(
        name="local-cpu",
        flops={"fp32": flops, "bf16": flops / 2, "fp16": flops / 4},
        memory_bytes=max(1, _physical_memory() // count),
        devices_per_node=count,
        intra_node=Link(latency_s=2e-5, bandwidth_Bps=4e9),  # gloo over shared memory
        inter_node=Link(latency_s=1e-4, bandwidth_Bps=1.25e9),  # 10 Gb/s Ethernet
        memory_bandwidth_Bps=1e10,
    )


def calibrate_local_cpu(*, size: int = 512, repeats: int = 5) -> float:
    """Measured fp32 matmul FLOP/s of one core of this machine (numpy, about 0.1 s).

    numpy may use several threads; the profiler measures per-rank speed with torch."""
    import time

    import numpy as np

    a = np.ones((size, size), dtype=np.float32)
    a @ a  # warm up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / max(best, 1e-9)
