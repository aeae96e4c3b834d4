"""Expert parallelism: plait's MoE layer vs torchtitan's, forward and backward, same sizes.

For each worker count W in `--workers`, W local workers (gloo, one thread each) hold one
MoE layer of each runtime, its `E` experts split over ep = W ranks (W = 1: one process,
no all-to-all, the baseline row), and take turns every step (the order alternates, a
barrier before each turn) so machine load hits both alike. A turn is one forward and
backward on the rank's own `tokens` random tokens; a step lasts as long as its slowest
rank; the figures are medians over `--steps` steps after `--warmup`.

The peer is torchtitan's `MoE` (`torchtitan.models.common.moe`, the layer of its
DeepSeek-V3 and Llama-4 models) with its `AllToAllTokenDispatcher`, the experts sliced
by hand as its expert-parallel plan slices them (rank r keeps experts [r·E/ep,
(r+1)·E/ep)) and the ep mesh wired as its `parallelize` wires it. What is the same: a
softmax router over `E` experts without bias, top-k with the chosen probabilities
renormalised (`route_norm`), dropless routing (torchtitan has no capacity), per-expert
counts exchanged first and variable-split all-to-alls. Both routers get the same gate
weights, so both send the same token copies to the same experts: the bench checks it
(`routing_agrees`, `*_received_copies`). What differs, each the runtime's own choice:
torchtitan's experts are SwiGLU (three matrices) run as bf16 grouped GEMMs
(`torch._grouped_mm`), plait's are GELU FFNs with biases (two matrices) run as one
autograd node (`plait.models.grouped_ffn`), in bf16 under plait's bf16 autocast
(`--dtype bf16`, the default: the peer's precision) or in fp32 (`--dtype fp32`); both
keep their routers in fp32. The peer's expert width is 2/3 of `ffn` (rounded down to a
multiple of 8, which its grouped GEMM needs), the usual SwiGLU sizing that gives both
the same parameters and FLOPs per token copy. plait's loss adds its router's
load-balancing and z losses (torchtitan balances by an expert bias updated outside the
layer, left off here). With `--capacity-factor` > 0 plait drops copies past capacity and
the peer does not, so the received copies differ. The outputs cannot be compared value
by value (the expert functions differ); the bench checks their shapes.

The all-to-all share (rows with W > 1): plait's exchange times its collectives on every
rank, forward and backward (`ExpertExchange.timings`); each is charged the least time any
rank spent in it (what remains when no rank waits for a later one), and their sum over
all timed steps, over those steps' time, is `all_to_all_share_measured` (a share of the
run's time: a few slow exchanges count for what they cost, which a median of per-step
shares would hide). `all_to_all_share_predicted` is the
simulator's share for the same layer (`predict_share`): the cost model's all-to-alls on
an alpha-beta link, and the layer's compute, both profiled in the same run in turn with
the layers (this machine's load moves both): the link (`link`) fitted to gloo
all-to-alls of 1 KiB to 1 MiB per rank under the cost model's all-to-all formula, the
compute (`local_step_s`) the forward+backward of what one rank computes without the
exchange (E/ep experts taking its tokens' top-k copies); `share_error` is the relative
difference of the two shares.

Install the peer (its imports, without the training stack it declares, so that torch
stays at the pinned version):
`pip install --no-deps -c constraints.txt torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17
docstring_parser==0.18.0 triton==3.9.0`. Without it the bench prints plait's rows only.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from plait.bench import _common as common

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "PEER",
    "MoEBenchConfig",
    "add_arguments",
    "peer_version",
    "predict_share",
    "run",
    "run_bench",
]

PEER = "torchtitan"
INSTALL = (
    "pip install --no-deps -c constraints.txt torchtitan==0.3.0 spmd_types==0.2.3 "
    "tyro==1.0.17 docstring_parser==0.18.0 triton==3.9.0"
)


def peer_version() -> str | None:
    """torchtitan's version when its MoE layer imports here, else None."""
    try:
        import importlib.metadata

        from torchtitan.models.common.moe import MoE  # noqa: F401
    except ImportError:
        return None
    return importlib.metadata.version(PEER)


@dataclass(frozen=True, kw_only=True)
class MoEBenchConfig:
    workers: tuple[int, ...] = (1, 2)
    tokens: int = 512  # per rank
    hidden: int = 256
    ffn: int = 768
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 0.0  # dropless, as torchtitan routes
    num_steps: int = 20
    num_warmup: int = 3
    # plait's precision: bf16 autocast (its `--dtype bf16`) computes the experts in bf16
    # and keeps the router in fp32, as the peer always does; fp32 computes all in fp32
    dtype: str = "bf16"
    peer: bool = True

    def __post_init__(self) -> None:
        from plait.models.moe import MoEConfig
        from plait.parallel.experts import check_expert_parallel

        if not self.workers or min(self.workers) < 1:
            raise ValueError(f"workers={self.workers}: give worker counts >= 1")
        if self.tokens < 1 or self.num_steps < 1 or self.num_warmup < 0:
            raise ValueError(
                f"tokens={self.tokens}, steps={self.num_steps} must be >= 1, "
                f"warmup={self.num_warmup} >= 0"
            )
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype={self.dtype!r}: give fp32 or bf16")
        for w in self.workers:
            check_expert_parallel(self.num_experts, w)
        if self.peer and (self.hidden % 8 or self.peer_ffn < 8):
            raise ValueError(
                f"hidden={self.hidden}, ffn={self.ffn}: torchtitan's grouped GEMM needs a "
                "hidden size that is a multiple of 8 and ffn >= 12 (or give --no-peer)"
            )
        MoEConfig(hidden=self.hidden, num_heads=1, ffn_hidden=self.ffn,
                  num_experts=self.num_experts, top_k=self.top_k,
                  capacity_factor=self.capacity_factor)  # fmt: skip

    @property
    def peer_ffn(self) -> int:
        """The peer's SwiGLU width: 2/3 of `ffn`, a multiple of 8 (same parameters, FLOPs)."""
        return 2 * self.ffn // 3 // 8 * 8


def run_bench(config: MoEBenchConfig) -> dict[str, Any]:
    from plait.train import launch

    version = peer_version() if config.peer else None
    out: dict[str, Any] = {
        "config": {**asdict(config), "peer_ffn": config.peer_ffn},
        "peer": {"name": PEER, "version": version},
        "workers": {},
    }
    if version is None:
        missing = f"{PEER} is not installed: {INSTALL}" if config.peer else "off (--no-peer)"
        out["peer"]["missing"] = missing
    for w in config.workers:
        per_rank = launch(_worker, w, config, version is not None)
        out["workers"][str(w)] = _summarise([per_rank[r] for r in sorted(per_rank)])
    return out


def _summarise(reports: list[dict[str, Any]]) -> dict[str, Any]:
    def step(name: str) -> float:
        # a step lasts as long as its slowest rank
        slowest = [max(t) for t in zip(*(r["times"][name] for r in reports), strict=True)]
        return common.median(slowest)

    row: dict[str, Any] = {
        "ep": len(reports),
        "plait_step_s": step("plait"),
        "plait_received_copies": sum(r["received"]["plait"] for r in reports),
        "peer_step_s": None,
        "ratio": None,
    }
    if "all_to_all" in reports[0]:
        row.update(_all_to_all_share(reports, row["plait_step_s"], row["ep"]))
    if "peer" in reports[0]["times"]:
        row.update(
            peer_step_s=step("peer"),
            ratio=row["plait_step_s"] / step("peer"),
            peer_received_copies=sum(r["received"]["peer"] for r in reports),
            routing_agrees=min(r["routing_agrees"] for r in reports),
            same_output_shape=all(r["same_output_shape"] for r in reports),
        )
    return row


def _all_to_all_share(reports: list[dict[str, Any]], step_s: float, ep: int) -> dict[str, Any]:
    """The exchange's share of plait's step, measured and predicted (see `predict_share`).

    Measured: each collective of a step is charged the least time any rank spent in it
    (the last rank to arrive waits for no one: what remains is the transfer, not another
    rank's lateness); their sum over all steps over the steps' time (each its slowest
    rank's). The link and the compute profile are means too, so that the prediction is
    of the same quantity."""
    config = reports[0]["config"]
    warmup = config["num_warmup"]
    steps = [r["all_to_all"][warmup:] for r in reports]
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
    bench = MoEBenchConfig(**{**config, "workers": tuple(config["workers"])})
    predicted = predict_share(bench, ep=ep, compute_s=compute_s, **link)
    # the exchange alone: with 1 s of compute the share is a / (1 + a), a its seconds
    unit = predict_share(bench, ep=ep, compute_s=1.0, **link)
    predicted_s = unit / (1 - unit)
    # the share of the run's time: all steps' exchange seconds over all steps' seconds
    measured = sum(seconds) / sum(slowest)
    return {
        "all_to_all_s": statistics.fmean(seconds),
        "all_to_all_s_predicted": predicted_s,
        "all_to_all_calls": len(steps[0][0]) if steps[0] else 0,
        # median seconds of each: counts, dispatch, combine, then the backward's two
        "all_to_all_call_s": [common.median(list(c)) for c in zip(*calls, strict=True)],
        "probe_s": {
            str(size): common.median([min(step) for step in zip(*ranks, strict=True)])
            for size, ranks in zip(
                _Probe.SIZES,
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


def _fit_all_to_all(reports: list[dict[str, Any]], ep: int) -> dict[str, float]:
    """The alpha-beta link under the cost model's all-to-all (`all_to_all_time`: n - 1
    messages of latency alpha, (n - 1)/n of the B-byte send buffer at bandwidth beta),
    fitted to the probes: each probe's least time over the ranks, mean over the steps."""
    from plait.profile import fit_link

    per_size = zip(*(zip(*r["probes"], strict=True) for r in reports), strict=True)
    samples = []
    for size, ranks in zip(_Probe.SIZES, per_size, strict=True):
        seconds = statistics.fmean([min(step) for step in zip(*ranks, strict=True)])
        # t = (n-1)·alpha + (n-1)/n·B/beta: a one-message sample (B/n bytes, t/(n-1))
        samples.append((size / ep, seconds / (ep - 1)))
    link = fit_link(samples)
    return {"latency_s": link.latency_s, "bandwidth_Bps": link.bandwidth_Bps}


def predict_share(
    config: MoEBenchConfig, *, ep: int, compute_s: float, latency_s: float, bandwidth_Bps: float
) -> float:
    """The simulator's all-to-all share of one step of the bench's layer over `ep` ranks.

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
    result = simulate(build_schedule(plan), [layer], cluster, plan)
    return result.all_to_all_share


# ------------------------------------------------------------------ in the workers
def _worker(config: MoEBenchConfig, with_peer: bool) -> dict[str, Any]:
    common.single_thread()
    import torch.distributed as dist

    from plait.mesh import init_worker

    env, device = init_worker(timeout_s=300.0)
    try:
        out = _measure(config, with_peer, env.rank, env.world_size, device)
        out["config"] = asdict(config)
        return out
    finally:
        dist.destroy_process_group()


def _measure(
    config: MoEBenchConfig, with_peer: bool, rank: int, world: int, device: torch.device
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from plait.models.moe import MoEConfig, MoELayer
    from plait.parallel.experts import ExpertExchange, shard_experts
    from plait.train.precision import autocast_context

    cfg = MoEConfig(hidden=config.hidden, num_heads=1, ffn_hidden=config.ffn,
                    num_experts=config.num_experts, top_k=config.top_k,
                    capacity_factor=config.capacity_factor)  # fmt: skip
    torch.manual_seed(0)  # the same layer on every rank, as a model is built
    plait = MoELayer(cfg).to(device)
    group = dist.group.WORLD
    assert group is not None
    shard_experts(plait, group)
    plait_loss = functools.partial(_plait_loss, autocast_context(config.dtype, device))
    runners: dict[str, Any] = {"plait": _Turn(plait, plait.experts, plait_loss)}
    timings: list[list[float]] = []
    if world > 1:
        # the compute profile: what one rank of the ep group computes, without the
        # exchange: E/ep experts taking its T tokens' top-k copies (T·k copies over E/ep
        # experts, as the ep ranks' copies are on average), timed in turn with the others
        torch.manual_seed(0)
        per_rank = config.num_experts // world
        local = MoELayer(replace(cfg, num_experts=per_rank, top_k=min(cfg.top_k, per_rank)))
        runners["local"] = _Turn(local.to(device), local.experts, plait_loss)
        # the link profile, in turn with the others too (the machine's load moves it)
        runners["link"] = _Probe(group)
        exchange = plait.exchange
        assert isinstance(exchange, ExpertExchange)
        exchange.timings = []
        runners["plait"].timings = timings, exchange.timings
    if with_peer:
        peer = _peer_layer(config, plait.router.gate.weight, rank, world, device)
        inner = peer.routed_experts.inner_experts
        runners["peer"] = _Turn(peer, inner, _peer_loss)
    torch.manual_seed(1 + rank)  # but each rank its own tokens
    x = torch.randn(config.tokens, config.hidden, device=device, requires_grad=True)
    names = list(runners)
    out: dict[str, Any] = {"times": {n: [] for n in names}}
    if world > 1:
        out["all_to_all"] = timings
    outputs = {}
    for i in range(config.num_warmup + config.num_steps):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            x.grad = None
            seconds, y = runners[name].step(x, device)
            outputs[name] = y.shape
            if i >= config.num_warmup:
                out["times"][name].append(seconds)
    out["received"] = {n: statistics.fmean(r.received) for n, r in runners.items()}
    if "link" in runners:
        out["probes"] = runners["link"].samples[config.num_warmup :]
    if with_peer:
        out["same_output_shape"] = outputs["plait"] == outputs["peer"] == x.shape
        out["routing_agrees"] = _routing_agrees(plait, runners["peer"].layer, x)
    return out


class _Turn:
    """One runtime's layer, its loss, and the token copies its local experts received;
    with `timings` (steps, the exchange's list), the exchange's collective seconds of
    each step are appended to the steps."""

    def __init__(self, layer: nn.Module, experts: nn.Module, loss: Any) -> None:
        self.layer, self.loss = layer, loss
        self.received: list[int] = []
        self.timings: tuple[list[list[float]], list[float]] | None = None
        experts.register_forward_hook(lambda _m, args, _o: self.received.append(args[0].shape[0]))

    def step(self, x: torch.Tensor, device: torch.device) -> tuple[float, torch.Tensor]:
        for p in self.layer.parameters():
            p.grad = None
        t0 = _now(device)
        y = self.loss(self.layer, x)
        t1 = _now(device)
        if self.timings is not None:
            steps, calls = self.timings
            steps.append(list(calls))
            calls.clear()
        return t1 - t0, y


class _Probe:
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
            end = time.perf_counter() + self.LATE_S
            while late and time.perf_counter() < end:
                a @ a
            t0 = _now(device)
            dist.all_to_all_single(out, buf, group=self.group)
            times.append(_now(device) - t0)
        self.samples.append(times)
        return sum(times), x.detach()


def _plait_loss(autocast: Any, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with autocast():
        y, aux = layer(x)  # [tokens, hidden]
    (y.float().square().mean() + aux).backward()
    return y.detach()


def _peer_loss(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = layer(x.unsqueeze(0))  # torchtitan takes [batch, seq, hidden]
    y.square().mean().backward()
    return y.detach().squeeze(0)


def _peer_layer(
    config: MoEBenchConfig, gate: torch.Tensor, rank: int, world: int, device: torch.device
) -> Any:
    """torchtitan's MoE with `gate` as its router weight and this rank's slice of experts,
    wired to an ep mesh of all workers (none for one worker: its local dispatcher)."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import (
        GroupedExperts,
        MoE,
        RoutedExperts,
        TokenChoiceTopKRouter,
    )
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    # plain process groups and tensors, as torch.compile'd torchtitan runs; its default
    # backend wants the typed SPMD meshes its trainer sets up
    set_spmd_backend("plain")
    # its router asks CPU autocast for fp32, which CPU autocast declines with a warning
    # each call; the gate runs in fp32 either way
    warnings.filterwarnings("ignore", "In CPU autocast, but the target dtype", UserWarning)
    e, k = config.num_experts, config.top_k
    layer_cfg = MoE.Config(
        num_experts=e,
        load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(
                dim=config.hidden, hidden_dim=config.peer_ffn, num_experts=e
            ),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=e, top_k=k),
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=e,
            top_k=k,
            score_func="softmax",
            route_norm=True,
            gate=Linear.Config(in_features=config.hidden, out_features=e),
        ),
    )
    torch.manual_seed(2)
    layer = layer_cfg.build().to(device)
    with torch.no_grad():
        layer.router.gate.weight.copy_(gate)
    inner = layer.routed_experts.inner_experts
    per_rank = e // world
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
        full = torch.randn(e, *getattr(inner, name).shape[1:], device=device) * 0.02
        setattr(inner, name, nn.Parameter(full[rank * per_rank : (rank + 1) * per_rank]))
    if world > 1:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
        layer.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    return layer


def _routing_agrees(plait: Any, peer: Any, x: torch.Tensor) -> float:
    """The fraction of this rank's tokens that both routers send to the same experts."""
    import torch

    with torch.no_grad():
        mine = plait.router(x).expert.sort(dim=-1).values
        theirs = peer.router(x.unsqueeze(0), None)[1].squeeze(0).sort(dim=-1).values
    return float((mine == theirs).all(dim=-1).float().mean())


def _now(device: torch.device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# ------------------------------------------------------------------ command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = MoEBenchConfig()
    a = parser.add_argument
    a("--workers", default=",".join(map(str, d.workers)),
      help="worker counts, comma-separated (ep = workers; 1: one process)")  # fmt: skip
    a("--tokens", type=int, default=d.tokens, help="tokens per rank per step")
    a("--hidden", type=int, default=d.hidden, help="hidden size (a multiple of 8)")
    a("--ffn", type=int, default=d.ffn, help="plait's expert FFN width (the peer's: 2/3 of it)")
    a("--experts", type=int, default=d.num_experts, help="experts per layer")
    a("--top-k", type=int, default=d.top_k, help="experts per token")
    a("--capacity-factor", type=float, default=d.capacity_factor,
      help="plait's capacity factor (0: dropless, as the peer always is)")  # fmt: skip
    a("--dtype", default=d.dtype, choices=("fp32", "bf16"),
      help="plait's precision (the peer's experts always run in bf16)")  # fmt: skip
    a("--steps", type=int, default=d.num_steps, help="timed steps")
    a("--warmup", type=int, default=d.num_warmup, help="first steps left out of the times")
    a("--no-peer", action="store_true", help=f"time plait only, even if {PEER} is installed")
    a("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    config = MoEBenchConfig(
        workers=tuple(int(w) for w in args.workers.split(",") if w),
        tokens=args.tokens,
        hidden=args.hidden,
        ffn=args.ffn,
        num_experts=args.experts,
        top_k=args.top_k,
        capacity_factor=args.capacity_factor,
        num_steps=args.steps,
        num_warmup=args.warmup,
        dtype=args.dtype,
        peer=not args.no_peer,
    )
    result = run_bench(config)
    if args.json:
        common.print_json(result)
        return 0
    _table(result)
    return 0


def _table(result: dict[str, Any]) -> None:
    peer = result["peer"]

    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.1f}"

    rows = [
        [w, ms(r["plait_step_s"]), ms(r["peer_step_s"]),
         "-" if r["ratio"] is None else f"{r['ratio']:.2f}",
         f"{r['plait_received_copies']:.0f}", f"{r.get('peer_received_copies', '-')}",
         r.get("routing_agrees", "-")]
        for w, r in result["workers"].items()
    ]  # fmt: skip
    c = result["config"]
    common.print_table(
        f"MoE layer forward+backward, {c['tokens']} tokens/rank, hidden {c['hidden']}, "
        f"{c['num_experts']} experts, top-{c['top_k']}, plait in {c['dtype']}",
        [
            "workers (ep)",
            "plait ms",
            f"{PEER} ms",
            "plait/peer",
            "plait copies",
            "peer copies",
            "same routing",
        ],
        rows,
        footer=peer.get("missing", f"peer: {PEER} {peer['version']}"),
    )
