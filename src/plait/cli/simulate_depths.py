"""`plait simulate --plan FILE` on a plan whose pipelines differ in depth: each pipeline
replayed at its own depth on its own consecutive ranks, with the gradient reduction
between pipelines, as the planner prices it (`plait.plan.depths.simulate_pipelines`), so
that the plan file's `predicted.step_time_s` is reproduced; with `--wsp-staleness` (or a
plan file's `wsp_staleness`) the pipelines are also replayed as WSP's virtual workers."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from typing import Any

from plait.config.specs import pipeline_specs
from plait.plan.depths import simulate_pipelines
from plait.presets import load_cluster
from plait.sim import SimPlan

__all__ = ["differ_in_depth", "run_depths"]


def differ_in_depth(pipelines: Any, chunks: int | None) -> bool:
    """Whether a plan file's `pipelines` have different depths."""
    specs = pipeline_specs(pipelines)
    if not specs:
        return False
    return len({len(p.partition) // (chunks or 1) for p in specs}) > 1


def run_depths(args: argparse.Namespace, spec: Any, plan: SimPlan) -> int:
    """Simulate `plan` (the flags' layout) with the plan file's `pipelines`; print the
    step, each pipeline's and (--json) one object."""
    specs = pipeline_specs(args.pipelines)
    with warnings.catch_warnings():  # fewer micro-batches than stages: priced, not warned
        warnings.simplefilter("ignore")
        sim = dataclasses.replace(plan, dp=len(specs), pp=len(specs[0].partition) // plan.chunks,
                                  partition=specs[0].partition, pipelines=specs,
                                  microbatches=specs[0].microbatches)  # fmt: skip
    cluster = load_cluster(args.cluster)
    if cluster.num_devices < sim.world_size:
        raise ValueError(
            f"pipelines of depths {'+'.join(map(str, sim.depths))} need {sim.world_size} "
            f"devices but cluster {cluster.name!r} has {cluster.num_devices}"
        )
    blocks = spec.block_costs(micro_batch_size=sim.micro_batch_size, dtype=sim.dtype, layout=sim)
    het = simulate_pipelines(sim, blocks, cluster)
    pipelines: list[dict[str, Any]] = [
        {"pipeline": r.dp_rank, "devices": list(r.devices), "partition": list(r.sizes),
         "microbatches": r.num_microbatches, "step_time_s": r.run.step_time_s,
         "peak_memory_bytes": [x.memory.total for x in r.run.ranks],
         "fits": all(x.memory.total <= x.capacity_bytes for x in r.run.ranks)}
        for r in het.replicas
    ]  # fmt: skip
    summary: dict[str, Any] = {"step_time_s": het.step_time_s, "depths": list(sim.depths),
               "samples_per_s": sim.global_batch_size / het.step_time_s,
               "fits": het.fits, "pipelines": pipelines}  # fmt: skip
    if args.wsp_staleness is not None:  # the pipelines as WSP's virtual workers
        from plait.cli.simulate_wsp import print_wsp, wsp_of_depths

        summary["wsp"] = wsp_of_depths(
            blocks, cluster, sim, het.replicas, staleness=args.wsp_staleness, wave=args.wsp_wave
        )
    if args.json:
        json.dump(summary, sys.stdout, sort_keys=True)
        print()
        return 0
    print(
        f"pipelines of depths {'+'.join(map(str, sim.depths))}: step "
        f"{het.step_time_s * 1e3:.3f} ms ({summary['samples_per_s']:.1f} samples/s)"
    )
    for p in pipelines:
        print(
            f"  pipeline {p['pipeline']} ({', '.join(p['devices'])}; partition "
            f"{p['partition']}, {p['microbatches']} micro-batches): "
            f"{p['step_time_s'] * 1e3:.3f} ms, peak {max(p['peak_memory_bytes']) / 2**30:.3f} GiB"
            + ("" if p["fits"] else " (over memory)")
        )
    if "wsp" in summary:
        print_wsp(summary["wsp"])
    return 0
