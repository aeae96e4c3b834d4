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

The all-to-all share (rows with W > 1), measured and predicted: `plait.bench.moe_share`.

Install the peer (its imports, without the training stack it declares, so that torch
stays at the pinned version):
`pip install --no-deps -c constraints.txt torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17
docstring_parser==0.18.0 triton==3.9.0`. Without it the bench prints plait's rows only.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from plait.bench import _common as common
from plait.bench.moe_config import MoEBenchConfig
from plait.bench.moe_peer import INSTALL, PEER, peer_layer, peer_loss, peer_version, routing_agrees
from plait.bench.moe_share import Probe, all_to_all_share

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["add_arguments", "run", "run_bench"]


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
        out["workers"][str(w)] = _summarise([per_rank[r] for r in sorted(per_rank)], config)
    return out


def _summarise(reports: list[dict[str, Any]], config: MoEBenchConfig) -> dict[str, Any]:
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
        row.update(all_to_all_share(reports, config, row["ep"]))
    if "peer" in reports[0]["times"]:
        row.update(
            peer_step_s=step("peer"),
            ratio=row["plait_step_s"] / step("peer"),
            peer_received_copies=sum(r["received"]["peer"] for r in reports),
            routing_agrees=min(r["routing_agrees"] for r in reports),
            same_output_shape=all(r["same_output_shape"] for r in reports),
        )
    return row


# ------------------------------------------------------------------ in the workers
def _worker(config: MoEBenchConfig, with_peer: bool) -> dict[str, Any]:
    common.single_thread()
    import torch.distributed as dist

    from plait.mesh import init_worker

    env, device = init_worker(timeout_s=300.0)
    try:
        return _measure(config, with_peer, env.rank, env.world_size, device)
    finally:
        dist.destroy_process_group()


def _measure(
    config: MoEBenchConfig, with_peer: bool, rank: int, world: int, device: torch.device
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from plait.device import autocast_context
    from plait.models.moe import MoEConfig, MoELayer
    from plait.parallel.experts import ExpertExchange, shard_experts

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
        runners["link"] = Probe(group)
        exchange = plait.exchange
        assert isinstance(exchange, ExpertExchange)
        exchange.timings = []
        runners["plait"].timings = timings, exchange.timings
    if with_peer:
        peer = peer_layer(config, plait.router.gate.weight, rank, world, device)
        inner = peer.routed_experts.inner_experts
        runners["peer"] = _Turn(peer, inner, peer_loss)
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
        out["routing_agrees"] = routing_agrees(plait, runners["peer"].layer, x)
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
        t0 = common.now(device)
        y = self.loss(self.layer, x)
        t1 = common.now(device)
        if self.timings is not None:
            steps, calls = self.timings
            steps.append(list(calls))
            calls.clear()
        return t1 - t0, y


def _plait_loss(autocast: Any, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with autocast():
        y, aux = layer(x)  # [tokens, hidden]
    (y.float().square().mean() + aux).backward()
    return y.detach()


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
