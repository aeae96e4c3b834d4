"""The modes `plait bench faults` kills runs of: each mode's worker count and flags, and
the files (a heterogeneous plan, a cluster with one slow device) some of them read."""

from __future__ import annotations

__all__ = ["HETERO_PLAN", "MODES", "SLOW_CLUSTER"]

HETERO_PLAN = {
    "dp": 2, "pp": 2, "tp": 1, "schedule": "1f1b", "microbatches": 2,
    "pipelines": [{"partition": [4], "microbatches": 2}, {"partition": [2, 2], "microbatches": 2}],
}  # fmt: skip
MODES: dict[str, tuple[int, tuple[str, ...]]] = {
    "1f1b": (2, ("--pp", "2")),
    "interleaved": (2, ("--pp", "2", "--schedule", "interleaved", "--chunks", "2")),
    "pipedream": (2, ("--pp", "2", "--schedule", "pipedream", "--flush-every", "EVERY")),
    "2bw": (2, ("--pp", "2", "--schedule", "2bw", "--flush-every", "EVERY")),
    "zb-v": (2, ("--pp", "2", "--schedule", "zb-v", "--chunks", "2")),
    "heterogeneous": (3, ("--plan", "PLAN")),
    "wsp": (2, ("--dp", "2", "--pp", "1", "--wsp-staleness", "1", "--wsp-wave", "2")),
    "zero3": (2, ("--dp", "2", "--pp", "1", "--zero", "3")),
    "tp": (2, ("--tp", "2", "--pp", "1")),
    "ep": (2, ("--dp", "2", "--pp", "1", "--model", "moe-gpt", "--ep", "2")),
    "compression": (2, ("--dp", "2", "--pp", "1", "--compress", "powersgd:2")),
    "repartition": (2, ("--pp", "2", "--repartition", "auto", "--cluster", "SLOW")),
}
# rank 1 of the re-partitioning runs trains 3× slower (`plait.train.slowdown`), so blocks move
SLOW_CLUSTER = """name = "one-slow"
inter_node = { latency_s = 2e-5, bandwidth_Bps = 4e9 }

[[nodes]]
count = 1
devices_per_node = 1
intra_node = { latency_s = 2e-5, bandwidth_Bps = 4e9 }
device = { name = "fast", peak_flops = { fp32 = 2e10 }, memory_gib = 4 }

[[nodes]]
count = 1
devices_per_node = 1
intra_node = { latency_s = 2e-5, bandwidth_Bps = 4e9 }
device = { name = "slow", peak_flops = { fp32 = 2e10 }, memory_gib = 4, slowdown = 3 }
"""
