"""HetPipe on a machine of unequal workers: equal-share data parallelism against the
planner's heterogeneous plan and Wave Synchronous Parallel, to a target loss.

`--workers` CPU workers train the same GPT on the same stdlib corpus batches; the last
`--slow` of them are marked `--slowdown` times slower in a cluster file (a device's
`slowdown`), which the planner sees as slower devices. The workers act as devices of
those speeds by emulated compute (`plait.emulate.slowdown.EmulatedCompute`): every block
sleeps `--block-ms` per sample after its forward and twice that in its backward, times
the slowdown on a slow worker, on top of its real arithmetic, kept small. Emulation,
because this machine has fewer cores than workers: with real arithmetic all plans do the
same work on the same shared cores, so none can be faster than the cores allow, and
equal shares already keep them busy (the fast workers compute while the slow ones sleep
off their pad); no device would behave so. `--block-ms 0` trains on real arithmetic
alone, each slow worker's step padded by (k − 1) × its forward and backward time
(`plait.emulate.slowdown.pad_step`). Three configurations take turns of `--turn` steps
each (this machine's speed drifts over seconds), each turn from a barrier to the slowest
rank's end of it:

- `equal_dp`: synchronous data parallelism, every worker an equal share of the batch
  (the slow ones set the pace);
- `hetero_sync`: the planner's best heterogeneous plan for that cluster (pipelines with
  their own partitions and batch shares in proportion to their speed), synchronous: the
  same updates as `equal_dp`, each step shorter;
- `wsp`: the same pipelines under WSP with D = `--staleness` (each pipeline updates its
  own weights every step and adds the others' updates D waves late; each pipeline's
  learning rate is scaled by its batch share, so the summed updates of a wave are one
  step's worth).

Every configuration trains with `--optimizer`: AdamW (default) or SGD with momentum 0.9.
Under WSP each pipeline's AdamW normalises its own, noisier gradient, and the summed
updates partly cancel where the pipelines disagree: smaller steps than AdamW on the
averaged gradient, which costs WSP updates. SGD makes WSP with D = 0 exactly synchronous,
momentum included: momentum is linear, so the pipelines' share-weighted momenta sum to the
momentum of the averaged gradient. At D ≥ 1 each pipeline applies its own update at once
and the others' D waves late.

Reported per configuration: `samples_per_s` (steps × batch over the turn's time),
`updates_to_target` (the first step whose loss, averaged over the last `--window` steps,
is at most the target; a WSP step's loss is the share-weighted mean of the pipelines'
own losses) and `seconds_to_target` (when the slowest worker finished that step), apart:
the first is the convergence side (how many updates the configuration's arithmetic needs),
the second adds its speed; `curve` holds every step's loss and end. `speedup_vs_equal_dp`
is equal data parallelism's seconds to the target over the best other configuration's,
`wsp_speedup_vs_equal_dp` the same for WSP alone. The target is `--target-loss`, or by
default 0.1% above the loss `equal_dp` reaches at `--target-at` (1/2) of its steps, so
that the synchronous runs reach it well before the end and WSP has the rest of the steps
to. `hetero_sync` computes the same updates as `equal_dp` (up to rounding), so its
`updates_to_target` equal `equal_dp`'s by construction and its speed-up is its throughput;
what WSP's stale, summed updates cost is in WSP's `updates_to_target` alone.

Limits: the emulated times are the cluster file's ratios, not a measured device's; the
real arithmetic, reductions, updates and messages (on top of the emulated time, about a
seventh of the step at the defaults) still share the cores.
Paper: HetPipe converged up to 49% faster than data parallelism (Park et al., ATC 2020).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import Any

from plait.bench import _common as common
from plait.bench.hetpipe_config import CONFIGS, HetPipeBenchConfig

__all__ = ["Run", "add_arguments", "planned_pipelines", "run", "run_bench"]


def planned_pipelines(config: HetPipeBenchConfig, vocab_size: int) -> dict[str, Any]:
    """The planner's best heterogeneous synchronous plan (tp = 1) for the bench's cluster,
    as a plan-file dict."""
    import dataclasses
    import tomllib

    from plait.plan import SearchSpace, search
    from plait.plan.io import plan_to_dict
    from plait.plan.space import gpt_spec
    from plait.presets import cluster_from_toml

    cluster = cluster_from_toml(tomllib.loads(config.cluster_toml()))
    spec = gpt_spec(num_layers=config.layers, hidden=config.hidden, num_heads=config.heads,
                    seq_len=config.seq_len, vocab_size=vocab_size, dtype="fp32")  # fmt: skip
    space = SearchSpace(schedules=("1f1b", "gpipe"), recompute=("none",), zero_stages=(0,),
                        chunks=(), sequence_parallel=(False,), dtype="fp32",
                        rank_orders=("tp-dp-pp", "tp-pp-dp"))  # fmt: skip
    if config.micro_batch_size:
        space = dataclasses.replace(space, micro_batch_sizes=(config.micro_batch_size,))
    found = search(spec, cluster, global_batch=config.batch_size, space=space, top_k=1000,
                   exact_limit=10**6, memory_margin=0.0)  # fmt: skip
    usable = [r for r in found.ranked if r.plan.tp == 1 and r.hetero is not None]
    if not usable:
        raise ValueError(
            "the planner found no heterogeneous plan with tp=1 for this cluster at "
            f"--micro-batch-size {config.micro_batch_size}: try another size, or 0"
        )
    return plan_to_dict(usable[0])


@dataclass(frozen=True)
class Run:
    """One configuration's turn: per step, its loss and when the slowest worker ended it."""

    losses: list[float]
    ends_s: list[float]

    def samples_per_s(self, batch_size: int) -> float:
        return len(self.ends_s) * batch_size / self.ends_s[-1]

    def to_target(self, target: float, window: int) -> tuple[int | None, float | None]:
        for t in range(len(self.losses)):
            recent = self.losses[max(0, t + 1 - window) : t + 1]
            if t + 1 >= window and sum(recent) / len(recent) <= target:
                return t + 1, self.ends_s[t]
        return None, None


def run_bench(config: HetPipeBenchConfig) -> dict[str, Any]:
    from plait.train import launch

    plan = planned_pipelines(config, config.vocab_size)
    per_rank = launch(_worker, config.workers, config, plan)
    runs = {name: _combine(name, [per_rank[r] for r in sorted(per_rank)]) for name in CONFIGS}
    target = config.target_loss
    if target is None:  # what equal data parallelism reaches at `target_at` of its steps
        base = runs["equal_dp"].losses
        t = max(config.window, round(config.target_at * config.steps))
        target = 1.001 * sum(base[t - config.window : t]) / config.window
    out: dict[str, Any] = {"config": asdict(config), "target_loss": target,
                           "plan": {k: plan[k] for k in ("dp", "pp", "schedule", "rank_order",
                                                          "pipelines")}}  # fmt: skip
    seconds = {}
    for name, r in runs.items():
        updates, secs = r.to_target(target, config.window)
        seconds[name] = secs
        tail = r.losses[-config.window :]
        out[name] = {"samples_per_s": r.samples_per_s(config.batch_size),
                     "updates_to_target": updates, "seconds_to_target": secs,
                     "final_loss": sum(tail) / len(tail),
                     "curve": {"loss": r.losses, "end_s": r.ends_s}}  # fmt: skip
    base_s = seconds["equal_dp"]

    def speedup(names: tuple[str, ...]) -> float | None:
        reached = [x for n in names if (x := seconds[n]) is not None]
        return base_s / min(reached) if reached and base_s else None

    out["speedup_vs_equal_dp"] = speedup(("hetero_sync", "wsp"))
    out["wsp_speedup_vs_equal_dp"] = speedup(("wsp",))
    return out


def _combine(name: str, reports: list[dict[str, Any]]) -> Run:
    """A configuration's per-step loss and end times over all ranks."""
    ends = [max(step) for step in zip(*(r[name]["ends"] for r in reports), strict=True)]
    if name != "wsp":
        return Run(reports[0][name]["losses"], ends)
    # one rank per pipeline speaks for it: the share-weighted mean of their own losses
    seen: dict[int, tuple[float, list[float]]] = {}
    for r in reports:
        seen.setdefault(r[name]["pipeline"], (r[name]["share"], r[name]["losses"]))
    losses = [sum(share * ls[t] for share, ls in seen.values()) for t in range(len(ends))]
    return Run(losses, ends)


# ------------------------------------------------------------------ in the workers
def _worker(config: HetPipeBenchConfig, plan: dict[str, Any]) -> dict[str, Any]:
    common.single_thread()
    import torch.distributed as dist

    from plait.mesh import init_worker

    _env, device = init_worker(timeout_s=300.0)
    try:
        return _measure(config, plan, device)
    finally:
        dist.destroy_process_group()


def _layouts(config: HetPipeBenchConfig, plan: dict[str, Any], name: str) -> Any:
    import dataclasses

    from plait.config import ParallelPlan
    from plait.plan.io import parallel_plan_of

    if name == "equal_dp":  # micro-batches of the planned size: the same work per sample
        per_worker, size = config.batch_size // config.workers, plan["micro_batch_size"]
        count = per_worker // size if per_worker % size == 0 else 1
        return ParallelPlan(dp=config.workers, pp=1, microbatches=count)
    layout = parallel_plan_of(plan)
    if name == "wsp":
        layout = dataclasses.replace(layout, wsp_staleness=config.staleness, wsp_wave=1)
    return layout


@dataclass
class _Trainer:
    """One configuration on this rank: its engine, and what its steps reported."""

    engine: Any
    slowdown: float  # the pad after each step (1: none; emulated compute paces itself)
    pipeline: int
    share: float
    losses: list[float]
    ends: list[float]  # seconds since the configuration's first step, summed over turns


def _trainer(config: HetPipeBenchConfig, plan: dict[str, Any], name: str, device: Any) -> Any:
    import torch
    import torch.distributed as dist

    from plait.emulate.slowdown import EmulatedCompute
    from plait.models import GPT, GPTConfig
    from plait.train.parallelize import parallelize
    from plait.train.placement import layout_of

    layout = _layouts(config, plan, name)
    rank = dist.get_rank()
    share, pipeline = 1.0, 0
    if layout.wsp_staleness is not None:
        pipes = layout_of(layout, config.layers + 2)
        pipeline = pipes.pipeline_of(rank)
        share = pipes.batch_shares()[pipeline]
    lr = config.lr * (share if config.wsp_lr == "share" else 1.0)

    def optimizer(params: Any) -> torch.optim.Optimizer:
        if config.optimizer == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=0.9)
        return torch.optim.AdamW(params, lr=lr)

    torch.manual_seed(config.seed)
    model = GPT(GPTConfig(vocab_size=config.vocab_size, seq_len=config.seq_len,
                          num_layers=config.layers, hidden=config.hidden,
                          num_heads=config.heads))  # fmt: skip
    slowdown = config.slowdown if rank >= config.workers - config.slow else 1.0
    if config.block_ms > 0:  # the hooks pace the blocks; no pad after the step
        EmulatedCompute(model, config.block_ms / 1000, slowdown, per_sample=True, slow=True)
    engine = parallelize(model, layout, optimizer, GPT.loss, device=device,
                         grad_clip=None)  # fmt: skip
    return _Trainer(engine, slowdown if config.block_ms == 0 else 1.0, pipeline, share, [], [])


def _measure(config: HetPipeBenchConfig, plan: dict[str, Any], device: Any) -> dict[str, Any]:
    """The configurations take turns of `turn` steps (this machine's speed drifts over
    seconds; turns spread the drift over all of them); a turn starts at a barrier and
    lasts until the slowest rank ends it."""
    import torch
    import torch.distributed as dist

    from plait.data.corpus import stdlib_corpus
    from plait.train.slowdown import padded_step

    corpus = stdlib_corpus()
    trainers = {name: _trainer(config, plan, name, device) for name in CONFIGS}
    elapsed = dict.fromkeys(CONFIGS, 0.0)
    for first in range(0, config.steps, config.turn):
        for name, tr in trainers.items():
            dist.barrier()
            start = time.perf_counter()
            for step in range(first, min(config.steps, first + config.turn)):
                batch = corpus.batch(step, config.batch_size, config.seq_len, seed=config.seed)
                report = padded_step(tr.engine, batch, tr.slowdown)
                tr.losses.append(report.loss)
                tr.ends.append(elapsed[name] + time.perf_counter() - start)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            elapsed[name] += float(took)
    for tr in trainers.values():
        tr.engine.drain()
    return {name: {"ends": tr.ends, "losses": tr.losses, "pipeline": tr.pipeline,
                   "share": tr.share} for name, tr in trainers.items()}  # fmt: skip


# ------------------------------------------------------------------ command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = HetPipeBenchConfig()
    a = parser.add_argument
    a("--workers", type=int, default=d.workers, help="local workers")
    a("--slow", type=int, default=d.slow, help="how many of them (the last) are slower")
    a("--slowdown", type=float, default=d.slowdown, help="how many times slower they are")
    a("--staleness", type=int, default=d.staleness, help="WSP's D (waves ahead)")
    a("--steps", type=int, default=d.steps, help="optimizer steps per configuration")
    a("--window", type=int, default=d.window, help="steps averaged for the target test")
    a("--turn", type=int, default=d.turn, help="steps per turn (configurations alternate)")
    a("--target-loss", type=float, default=None,
      help="default: equal dp's at --target-at of its steps")  # fmt: skip
    a("--target-at", type=float, default=d.target_at,
      help="share of its steps at which equal dp's loss sets the default target")  # fmt: skip
    a("--layers", type=int, default=d.layers, help="GPT transformer layers")
    a("--hidden", type=int, default=d.hidden, help="GPT hidden size")
    a("--heads", type=int, default=d.heads, help="attention heads")
    a("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    a("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    a("--optimizer", default=d.optimizer, choices=("adamw", "sgd"),
      help="every configuration's (sgd: momentum 0.9)")  # fmt: skip
    a("--lr", type=float, default=d.lr, help="learning rate")
    a("--micro-batch-size", type=int, default=d.micro_batch_size,
      help="every configuration's micro-batch size (0: the planner's choice)")  # fmt: skip
    a("--block-ms", type=float, default=d.block_ms,
      help="emulated ms per block and sample on a fast worker (0: real arithmetic, "
           "padded)")  # fmt: skip
    a("--wsp-lr", default=d.wsp_lr, choices=("share", "same"),
      help="WSP pipeline i's learning rate: lr × its batch share, or lr")  # fmt: skip
    a("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    config = HetPipeBenchConfig(
        workers=args.workers, slow=args.slow, slowdown=args.slowdown, staleness=args.staleness,
        steps=args.steps, window=args.window, turn=args.turn, target_loss=args.target_loss,
        target_at=args.target_at, optimizer=args.optimizer,
        layers=args.layers, hidden=args.hidden, heads=args.heads, seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=args.lr, wsp_lr=args.wsp_lr, block_ms=args.block_ms,
        micro_batch_size=args.micro_batch_size,
    )  # fmt: skip
    result = run_bench(config)
    if args.json:
        common.print_json(result)
        return 0
    rows = [[name, f"{result[name]['samples_per_s']:.1f}",
             str(result[name]["updates_to_target"]),
             _seconds(result[name]["seconds_to_target"])] for name in CONFIGS]  # fmt: skip
    speedup = result["speedup_vs_equal_dp"]
    common.print_table(
        f"HetPipe: {config.workers} workers, {config.slow} of them {config.slowdown:g}× slower; "
        f"target loss {result['target_loss']:.3f}; speed-up vs equal dp: "
        + (f"{speedup:.2f}×" if speedup is not None else "none reached the target"),
        ["configuration", "samples/s", "updates to target", "seconds to target"],
        rows,
    )
    return 0


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
