"""How well the simulator predicts real pipeline steps on this machine: predicted vs measured.

For each world size the workers are launched once. As many of them as there are cores
(one thread each, as they run) measure gloo P2P by ping-pong (fitted to latency +
bytes/bandwidth) and the time a thread spends posting a send or receive of an activation
while ranks compute (`plait.profile.message_overheads`). Every plan is then built with
the real runtime (`PipelineExecutor` plus an Adam step), and the plans take turns in
rounds: at its turn a plan runs warm-up steps (the plans before it took its data out of
the caches), then timed steps (from a barrier to the last rank's end); after each turn
those workers profile every block of a small GPT at once (`plait.profile`) and time an
Adam step. A shared machine's speed drifts by ±20% over seconds: rounds spread that
drift over every plan, and each plan is predicted with `plait.sim.simulate` from the
medians of the profiles taken just before and after its turns, cut into the same stages
(a partition of a profile taken in the parent), each stage charged the overheads of
posting the messages of its boundaries that cross ranks (simulated sends do not occupy
the sender), on a local-cpu cluster built from the calibration, and reports the relative
error of each (median of its timed steps).

CPU oversubscription: with more workers than cores (4 on 2), `plait.mesh.init_worker`
pins worker i to core i mod cores, and the simulated node says so
(`NodeGroup.processors`): the simulator then shares each core among the ranks computing
on it at each moment (`plait.schedule.sharing`); idle ranks free their core (gloo waits
block). Processes time-sharing a core lose part of its speed to switching and cache
refills (their CPU time per step rose by 30-50% over the profile here, while two
processes looping over the same blocks lost only 5%), so the simulated node's
`sharing_efficiency` is measured: a reference plan outside the grid (1F1B, 6 micro-batches)
takes its turns with the others, and the efficiency under which the simulator reproduces
it is used for every plan of that world size.

Limits: other load on a shared machine disturbs measurements (the load average is shown);
the executor's own per-action costs are not modelled (tens of microseconds here, against
milliseconds of compute); the kernel's scheduler shares a core in time slices, not
continuously.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from plait.bench import _common as common
from plait.bench.accuracy_model import device, fit_efficiency, predict
from plait.bench.accuracy_plans import AccuracyConfig, PlanRun

__all__ = ["add_arguments", "run", "run_bench"]

_TIMES = ("forward_s", "backward_s", "backward_input_s", "backward_weight_s")


def _batch(config: AccuracyConfig, samples: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(config.seed + 1)
    ids = torch.randint(0, config.vocab_size, (samples, config.seq_len + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _profile(config: AccuracyConfig) -> dict[str, Any]:
    """This process's measurement, one thread: blocks, matmul FLOP/s, Adam bandwidth."""
    import torch

    from plait.models import GPT
    from plait.profile import matmul_flops, optimizer_bandwidth, profile_model, threads

    spec = config.spec()
    torch.manual_seed(config.seed)
    model = spec.build()
    ids, targets = _batch(config, config.micro_batch_size)
    with threads(1):
        profile = profile_model(model, ids, target=targets, loss_fn=GPT.loss, cache=False,
                                names=spec.block_names(), warmup=2,
                                repeats=config.profile_repeats)  # fmt: skip
        bandwidth = optimizer_bandwidth(list(model.parameters()))
    return {"blocks": [b.to_dict() for b in profile.blocks], "memory_bandwidth_Bps": bandwidth,
            "flops": matmul_flops(num_threads=1)}  # fmt: skip


def _plans(config: AccuracyConfig, world: int, cal: dict[str, Any]) -> list[PlanRun]:
    from plait.plan import partition_blocks
    from plait.profile import BlockProfile
    from plait.schedule import schedule_kind

    costs = [BlockProfile.from_dict(b).to_cost(device(cal), "fp32") for b in cal["blocks"]]
    runs = []
    for schedule in config.schedules:
        chunks = schedule_kind(schedule).default_chunks
        cut = partition_blocks(costs, [device(cal)] * (world * chunks), dtype="fp32")
        runs += [PlanRun(schedule, world, m, chunks, cut.sizes) for m in config.microbatches]
    return runs


def _calibration(reports: list[dict[str, Any]], turns: list[int]) -> dict[str, Any]:
    """The calibration of a plan that ran the given turns (indices into each worker's
    turns): medians over the workers that measured, of the profiles taken just before
    and just after each of those turns."""
    from plait.profile import fit_link

    profiles = [p for r in reports for k in turns for p in r["profiles"][k : k + 2] if p]
    blocks = [dict(b) for b in profiles[0]["blocks"]]
    for i, block in enumerate(blocks):
        block.update({k: statistics.median(p["blocks"][i][k] for p in profiles) for k in _TIMES})
    sends, receives = ([r["overheads"][i] for r in reports if r["overheads"][i]] for i in (0, 1))
    return {
        "blocks": blocks,
        "flops": statistics.median(p["flops"] for p in profiles),
        "memory_bandwidth_Bps": statistics.median(p["memory_bandwidth_Bps"] for p in profiles),
        "link": asdict(fit_link(reports[0]["p2p"])),
        "message_overheads": (statistics.median(sends), statistics.median(receives)),
    }


def _measured(plan: PlanRun, runs: list[dict[str, Any]]) -> PlanRun:
    """`plan` with its step times (first start to last end) and last step's timeline."""
    from plait.trace import spans_from_records

    starts = list(zip(*(r["starts"] for r in runs), strict=True))
    ends = list(zip(*(r["ends"] for r in runs), strict=True))
    steps = tuple(max(e) - min(s) for s, e in zip(starts, ends, strict=True))
    offsets = [s - min(starts[-1]) for s in starts[-1]]
    spans = spans_from_records([r["records"] for r in runs], offsets=offsets)
    return replace(plan, measured_s=statistics.median(steps), step_times_s=steps,
                   measured=tuple(spans))  # fmt: skip


def run_bench(config: AccuracyConfig) -> tuple[list[PlanRun], dict[str, Any]]:
    """Run every plan on real workers and predict each; the plans and, per plan, the
    calibration its prediction used."""
    from plait.train import launch

    cores = len(os.sched_getaffinity(0))
    first = _profile(config)  # only to cut the model into stages
    done, calibrations = [], {}
    for world in config.worlds:
        plans = _plans(config, world, first)
        if world > cores:  # first a reference plan outside the grid, to measure sharing
            m = max(config.microbatches) + 2 if 6 in config.microbatches else 6
            plans.insert(0, PlanRun("1f1b", world, m, 1, plans[0].sizes))
        reports = [r for _, r in sorted(launch(_worker, world, config, plans, cores).items())]
        efficiency = 1.0
        for i, plan in enumerate(plans):
            turns = [k * len(plans) + i for k in range(config.rounds)]
            cal = _calibration(reports, turns) | {"sharing_efficiency": efficiency}
            measured = _measured(plan, [r["runs"][i] for r in reports])
            if world > cores and i == 0:
                efficiency = fit_efficiency(config, measured, cal, cores)
                calibrations[f"reference {plan.name}"] = cal | {"sharing_efficiency": efficiency}
                continue
            calibrations[plan.name] = cal
            done.append(predict(config, measured, cal, cores))
    return done, calibrations


def _worker(config: AccuracyConfig, plans: list[PlanRun], cores: int) -> dict[str, Any]:
    common.single_thread()
    import torch.distributed as dist

    from plait.mesh import init_worker
    from plait.profile import message_overheads, pingpong

    env, _ = init_worker(timeout_s=300.0, device="cpu")  # this host's cores, gloo
    try:
        p2p, size = pingpong(env.rank), config.micro_batch_size * config.seq_len * config.hidden * 4
        overheads = message_overheads(env.rank, min(cores, env.world_size), num_bytes=size)
        runners = [_Runner(config, plan, env.rank) for plan in plans]
        for runner in runners:  # the first step negotiates shapes and allocates
            runner.step(timed=False)
        # the other plans' objects would make every garbage collection slower than a
        # process training one plan sees
        gc.freeze()
        profiles = [_profile(config) if env.rank < cores else None]
        # rounds over the plans: the machine's drifting speed (±20% over seconds here)
        # falls on every plan alike. Each plan's turn starts with warm-up steps, as the
        # plans before it took its data out of the caches; one worker per core profiles
        # after each turn, so that each turn has a calibration just before and after it
        for _ in range(config.rounds):
            for runner in runners:
                for i in range(config.num_warmup + config.num_steps):
                    runner.step(timed=i >= config.num_warmup)
                dist.barrier()
                profiles.append(_profile(config) if env.rank < cores else None)
        runs = [runner.timings for runner in runners]
        return {"p2p": p2p, "overheads": overheads, "profiles": profiles, "runs": runs}
    finally:
        dist.destroy_process_group()


class _Runner:
    """One plan on this rank, with the real runtime; its timed steps' start and end times
    (perf_counter: one clock for all local processes) and the last one's records."""

    def __init__(self, config: AccuracyConfig, plan: PlanRun, rank: int) -> None:
        import torch

        from plait.models import GPT
        from plait.runtime import PipelineExecutor, local_stages, split_microbatches
        from plait.schedule import build

        schedule = build(plan.schedule, plan.pp, plan.num_microbatches, plan.num_chunks)
        torch.manual_seed(config.seed)
        stages = local_stages(config.spec().build(), schedule, rank, sizes=plan.sizes)
        self.rank = rank
        # one optimizer per stage, stepped by the program's UPDATE actions (as the engine does)
        self.optimizers = {s: torch.optim.Adam(m.parameters(), lr=1e-4) for s, m in stages.items()}
        self.executor = PipelineExecutor(
            schedule,
            dict(stages),
            rank=rank,
            loss_fn=GPT.loss,
            updater=lambda stage, version: self.optimizers[stage].step(),
        )
        m = plan.num_microbatches
        x, y = _batch(config, m * config.micro_batch_size)
        self.inputs = split_microbatches(x, m) if 0 in stages else None
        self.targets = split_microbatches(y, m) if schedule.num_stages - 1 in stages else None
        self.timings: dict[str, list[Any]] = {"starts": [], "ends": [], "records": []}

    def step(self, *, timed: bool) -> None:
        import torch.distributed as dist

        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=False)
        dist.barrier()
        start = time.perf_counter()
        result = self.executor.step(self.inputs, self.targets)  # its UPDATEs step the optimizers
        end = time.perf_counter()
        if timed:
            self.timings["starts"].append(start)
            self.timings["ends"].append(end)
            self.timings["records"] = list(result.records)


def _ints(text: str) -> tuple[int, ...]:  # argparse reports a ValueError as a bad value
    return tuple(int(x) for x in text.split(",") if x)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = AccuracyConfig()
    a = parser.add_argument
    a("--schedules", default=",".join(d.schedules), help="comma-separated schedule kinds")
    a("--microbatches", type=_ints, default=d.microbatches, help="micro-batch counts, e.g. 4,8")
    a("--worlds", type=_ints, default=d.worlds, help="worker counts (pipeline ranks), e.g. 2,4")
    a("--steps", type=int, default=d.num_steps, help="timed steps per plan and round")
    a("--rounds", type=int, default=d.rounds, help="turns of every plan (median of all steps)")
    a("--warmup", type=int, default=d.num_warmup, help="untimed steps at each plan's turn")
    a("--profile-repeats", type=int, default=d.profile_repeats, help="timed runs per block")
    a("--layers", type=int, default=d.num_layers, help="GPT layers")
    a("--hidden", type=int, default=d.hidden, help="GPT hidden size")
    a("--seq-len", type=int, default=d.seq_len, help="tokens per sample")
    a("--micro-batch-size", type=int, default=d.micro_batch_size, help="samples per micro-batch")
    a("--plot", help="PNG: predicted over measured timelines of the plan with the largest error")
    a("--trace-dir", help="folder for a Chrome trace (predicted and measured) of every plan")
    a("--check", action="store_true", help="exit 1 unless median <= 10%% and max <= 25%%")
    a("--json", action="store_true", help="print one JSON object instead of a table")


def _check_outputs(args: argparse.Namespace) -> None:
    """`--plot FILE` and `--trace-dir DIR` can be written where they point."""
    if args.plot and (Path(args.plot).is_dir() or not Path(args.plot).parent.is_dir()):
        raise ValueError(f"--plot {args.plot}: name a PNG file in an existing folder")
    if args.trace_dir and Path(args.trace_dir).is_file():
        raise ValueError(f"--trace-dir {args.trace_dir} is a file: name a folder")


def run(args: argparse.Namespace) -> int:
    config = AccuracyConfig(schedules=tuple(s for s in args.schedules.split(",") if s),
                            microbatches=args.microbatches, worlds=args.worlds,
                            num_steps=args.steps, num_warmup=args.warmup, rounds=args.rounds,
                            profile_repeats=args.profile_repeats, num_layers=args.layers,
                            hidden=args.hidden, seq_len=args.seq_len,
                            micro_batch_size=args.micro_batch_size)  # fmt: skip
    _check_outputs(args)  # before the measuring, not after it
    load_before, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    runs, calibration = run_bench(config)
    median, worst = statistics.median(e := [abs(r.error) for r in runs]), max(e)
    _outputs(args, runs)
    load = [load_before, os.getloadavg()[0]]
    if args.json:
        common.print_json({"median_abs_error": median, "max_abs_error": worst, "cores": cores,
                           "plans": [r.row() for r in runs], "calibration": calibration,
                           "config": asdict(config), "load_average": load})  # fmt: skip
    else:
        rows = [[r.name, f"{r.predicted_s * 1e3:.1f}", f"{r.measured_s * 1e3:.1f}",
                 f"{r.error:+.1%}", f"{r.predicted_bubble:.0%}"] for r in runs]  # fmt: skip
        common.print_table(
            f"simulator vs runtime on this machine ({cores} cores)",
            ["plan", "predicted ms", "measured ms", "error", "predicted bubble"],
            rows,
            footer=f"median |error| {median:.1%}, max |error| {worst:.1%}; load average "
            f"{load[0]:.1f} before, {load[1]:.1f} after",
        )
    return 1 if args.check and not (median <= 0.10 and worst <= 0.25) else 0


def _outputs(args: argparse.Namespace, runs: list[PlanRun]) -> None:
    """Chrome traces of every plan, and the PNG of the worst one, predicted over measured."""
    from plait.trace import plot_comparison, write_chrome_trace

    worst = max(runs, key=lambda r: abs(r.error))
    for run in runs:
        spans = {"predicted": list(run.predicted), "measured": list(run.measured)}
        if args.trace_dir:
            name = run.name.replace(" ", "_").replace("=", "")
            write_chrome_trace(Path(args.trace_dir) / f"{name}.json", spans)
        if args.plot and run is worst:
            plot_comparison(spans["predicted"], spans["measured"], args.plot, title=run.name)
