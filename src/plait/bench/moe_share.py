"""`plait bench moe`'s all-to-all share.

Rows with W > 1: plait's exchange times its collectives on every rank, forward and
backward (`ExpertExchange.timings`); each is charged the least time any rank spent in it
(what remains when no rank waits for a later one), and their sum over all timed steps,
over those steps' time, is `all_to_all_share_measured` (a share of the run's time: a few
slow exchanges count for what they cost, which a median of per-step shares would hide).
`all_to_all_share_predicted` is the simulator's share for the same layer
(`predict_share`): the cost model's all-to-alls on an alpha-beta link, and the layer's
compute, both profiled in the same run in turn with the layers (this machine's load
moves both): the link (`link`) fitted to gloo all-to-alls of 1 KiB to 1 MiB per rank
under the cost model's all-to-all formula, the compute (`local_step_s`) the
forward+backward of what one rank computes without the exchange (E/ep experts taking its
tokens' top-k copies); `share_error` is the relative difference of the two shares.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from plait.bench import _common as common

if TYPE_CHECKING:
    import torch

    from plait.bench.moe_config import MoEBenchConfig
    from plait.sim import SimResult

__all__ = ["Probe", "all_to_all_share", "predict_share"]


def all_to_all_share(
    reports: list[dict[str, Any]], config: MoEBenchConfig, ep: int
) -> dict[str, Any]:
    """The exchange's share of plait's step, measured and predicted (see `predict_share`).

    Measured: each collective of a step is charged the least time any rank spent in it
    (the last rank to arrive waits for no one: what remains is the transfer, not another
    rank's lateness); their sum over all steps over the steps' time (each its slowest
    rank's). The link and the compute profile are means too, so that the prediction is
    of the same quantity."""
    steps = [r["all_to_all"][config.num_warmup :] for r in reports]
    slowest = [max(t) for t in zip(*(r["times"]["plait"] for r in reports), strict=True)]
    # per step, per collective: the least time over the ranks
    calls = [
        [min(call) for call in zip(*per_rank, strict=True)] for per_rank in zip(*steps, strict=True)
    ]
    seconds = [sum(step) for step in calls]
    compute_s = statistics.fmean(
        [max(t) for t in zip(*(r["times"]["local"] for r in reports), strict=True)]
    )
    link = _fit_all_to_all(reports, ep)
    result = _simulate_layer(config, ep=ep, compute_s=compute_s, **link)
    predicted = result.all_to_all_share
    predicted_s = statistics.fmean(r.ep_comm_s for r in result.ranks)
    # the share of the run's time: all steps' exchange seconds over all steps' seconds
    measured = sum(seconds) / sum(slowest)
    return {
        "all_to_all_s": statistics.fmean(seconds),
        "all_to_all_s_predicted": predicted_s,
        "all_to_all_calls": len(steps[0][0]) if steps[0] else 0,
        # median seconds of each: counts, dispatch, combine, then the backward's two
        "all_to_all_call_s": [common.median(list(c)) for c in zip(*calls, strict=True)],
        # their means: a few slow calls move these, not the medians (`plait bench arrival`)
        "all_to_all_call_mean_s": [statistics.fmean(c) for c in zip(*calls, strict=True)],
        # how far apart the ranks came to each (median of the most minus the least time a
        # rank spent in it): ranks that come together stall on some hosts
        "all_to_all_call_skew_s": [
            common.median(list(c)) for c in zip(*_skews(steps), strict=True)
        ],
        "probe_s": {
            str(size): common.median([min(step) for step in zip(*ranks, strict=True)])
            for size, ranks in zip(
                Probe.SIZES,
                zip(*(zip(*r["probes"], strict=True) for r in reports), strict=True),
                strict=True,
            )
        },
        "local_step_s": compute_s,
        "link": link,
        "all_to_all_share_measured": measured,
        "all_to_all_share_predicted": predicted,
        "share_error": abs(predicted - measured) / measured if measured > 0 else None,
    }


def _skews(steps: list[list[list[float]]]) -> list[list[float]]:
    """Per step, per collective: the most minus the least seconds a rank spent in it."""
    return [
        [max(call) - min(call) for call in zip(*per_rank, strict=True)]
        for per_rank in zip(*steps, strict=True)
    ]


def _fit_all_to_all(reports: list[dict[str, Any]], ep: int) -> dict[str, float]:
    """The alpha-beta link under the cost model's all-to-all (`all_to_all_time`: n - 1
    messages of latency alpha, (n - 1)/n of the B-byte send buffer at bandwidth beta),
    fitted to the probes: each probe's least time over the ranks, mean over the steps."""
    from plait.profile import fit_link

    per_size = zip(*(zip(*r["probes"], strict=True) for r in reports), strict=True)
    samples = []
    for size, ranks in zip(Probe.SIZES, per_size, strict=True):
        seconds = statistics.fmean([min(step) for step in zip(*ranks, strict=True)])
        # t = (n-1)·alpha + (n-1)/n·B/beta: a one-message sample (B/n bytes, t/(n-1))
        samples.append((size / ep, seconds / (ep - 1)))
    link = fit_link(samples)
    return {"latency_s": link.latency_s, "bandwidth_Bps": link.bandwidth_Bps}


def predict_share(
    config: MoEBenchConfig, *, ep: int, compute_s: float, latency_s: float, bandwidth_Bps: float
) -> float:
    """The simulator's all-to-all share of one step of the bench's layer over `ep` ranks
    (`_simulate_layer`)."""
    return _simulate_layer(
        config, ep=ep, compute_s=compute_s, latency_s=latency_s, bandwidth_Bps=bandwidth_Bps
    ).all_to_all_share


def _simulate_layer(
    config: MoEBenchConfig, *, ep: int, compute_s: float, latency_s: float, bandwidth_Bps: float
) -> SimResult:
    """The simulator's step of the bench's layer over `ep` ranks.

    The layer is the cost model's MoE layer (`plait.cost.moe_block_costs`, one layer, all
    of it MoE) with its compute replaced by `compute_s`, the measured forward+backward of
    one rank's share of it without the exchange (a profile, as `plait profile` measures
    blocks), split 1:2 between forward and backward; its all-to-alls are the cost
    model's, over an ep group joined by the measured link. The step is the bench's: one
    micro-batch of `tokens` tokens per rank, no gradient reduction and no optimizer step
    (the bench times neither).
    """
    from plait.cluster import Cluster, Link, NodeGroup, normalize_dtype
    from plait.cost import moe_block_costs
    from plait.cost.moe import MoEShape
    from plait.profile import measured_device
    from plait.sim import SimPlan, build_schedule, simulate

    dtype = normalize_dtype(config.dtype)
    moe = MoEShape(num_experts=config.num_experts, top_k=config.top_k,
                   capacity_factor=config.capacity_factor, moe_every=1)  # fmt: skip
    plan = SimPlan(dp=ep, ep=ep, dtype=dtype, seq_len=config.tokens, optimizer="sgd")
    layer = moe_block_costs(num_layers=1, hidden=config.hidden, num_heads=1,
                            seq_len=config.tokens, vocab_size=1, moe=moe,
                            ffn_hidden=config.ffn, dtype=dtype, layout=plan)[1]  # fmt: skip
    rate = 1e12  # any: the profile's seconds become FLOPs at this rate and back
    device = measured_device(name="cpu core", flops=rate, dtype=dtype, memory_bytes=1 << 40)
    layer = replace(layer, forward_flops=compute_s * rate / 3,
                    backward_input_flops=compute_s * rate * 2 / 3, backward_weight_flops=0.0,
                    num_params=0, expert_params=0)  # fmt: skip
    link = Link(latency_s=latency_s, bandwidth_Bps=bandwidth_Bps)
    group = NodeGroup(device=device, devices_per_node=ep, intra_node=link)
    cluster = Cluster(name=f"local-cpu ({ep} workers)", groups=(group,), inter_node=link)
    return simulate(build_schedule(plan), [layer], cluster, plan)


class Probe:
    """The link between the workers as the exchange meets it: one gloo all-to-all of each
    of `SIZES` bytes per rank (equal splits) per step, timed on every rank. In the layer
    every all-to-all follows compute, and the ranks that arrive first block until the
    last one comes: its messages then go to blocked processes, which on a loaded CPU must
    be scheduled again before they answer. So before each probe the last rank computes
    for `LATE_S` while the others wait; the least time over the ranks (the last rank's)
    is the exchange with blocked peers."""

    SIZES = (1 << 10, 1 << 16, 1 << 18, 1 << 20)
    LATE_S = 3e-3

    def __init__(self, group: Any) -> None:
        self.group, self.received = group, [0]
        self.samples: list[list[float]] = []

    def step(self, x: torch.Tensor, device: torch.device) -> tuple[float, torch.Tensor]:
        import torch
        import torch.distributed as dist

        times, late = [], dist.get_rank(self.group) == self.group.size() - 1
        a = torch.randn(64, 64, device=device)
        tiny = torch.zeros(self.group.size(), device=device)
        for size in self.SIZES:
            buf = torch.zeros(size // 4, device=device)
            out = torch.empty_like(buf)
            dist.all_to_all_single(torch.empty_like(tiny), tiny, group=self.group)  # together
            if late:
                common.busy(self.LATE_S, a, device)
            t0 = common.now(device)
            dist.all_to_all_single(out, buf, group=self.group)
            times.append(common.now(device) - t0)
        self.samples.append(times)
        return sum(times), x.detach()
