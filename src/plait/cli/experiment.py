"""`plait experiment`: the seeds' experiments, reproduced; one subcommand each.

`plait experiment staleness` trains every schedule kind at every pipeline depth and says
how many epochs each needs to a target validation loss (seed 003 §4: 16 GPUs needed 52
epochs where 1 needed 30). Limits: those of `plait.experiment.staleness` (a character-level
GPT, a budget of a few epochs); `--pp ... --json` prints exactly one JSON line.
`plait experiment convergence --out DIR` measures the seeds' convergence claims (stale
pipelines in two regimes, gradient compression, WSP) and writes `DIR/convergence.md` with
its plots (`plait.experiment.convergence`). `dp-vs-gpipe`, `data-movement` and `all` live in
`plait.cli.experiment_seeds`.
"""

from __future__ import annotations

import argparse
from typing import Any

from plait.cli.lazy import lazy_subparsers
from plait.cli.options import deprecated_flag, number

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("experiment", help="the seeds' experiments, reproduced (slow)")
    experiments = lazy_subparsers(p, dest="experiment", metavar="EXPERIMENT", required=True)
    experiments.add_lazy(
        "staleness",
        _staleness_arguments,
        help="epochs to a target validation loss per schedule kind and stage count",
    )
    cp = experiments.add_parser(
        "convergence", help="the seeds' convergence claims measured: convergence.md with plots"
    )
    cp.add_argument("--out", required=True, help="folder of convergence.md, its PNGs and JSON")
    cp.add_argument("--sections", default="image,gpt,compress,wsp",
                    help="which to run, comma-separated: image, gpt, compress, wsp")  # fmt: skip
    cp.add_argument("--quick", action="store_true", help="every section at a size of seconds")
    cp.add_argument("--json", action="store_true", help="print the results as one JSON line")
    cp.add_argument("--quiet", action="store_true", help="no progress lines")
    cp.set_defaults(func=_run_convergence)
    from plait.cli.experiment_seeds import add_seed_experiments

    add_seed_experiments(experiments)


def _run_convergence(args: argparse.Namespace) -> int:
    from pathlib import Path

    from plait.experiment import convergence as cv

    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    config = cv.quick_config(sections) if args.quick else cv.ConvergenceConfig(sections=sections)
    result = cv.run_convergence(config, Path(args.out), quiet=args.quiet)
    if args.json:
        from plait.bench._common import print_json

        print_json(result)
    return 0


def _staleness_arguments(p: argparse.ArgumentParser) -> None:
    from plait.experiment.stale_train import REMEDIES
    from plait.experiment.staleness import StalenessConfig

    d = StalenessConfig()  # the help states the config's own defaults
    sgd = StalenessConfig(optimizer="sgd").learning_rate
    a = p.add_argument
    # lists and numbers are parsed in _run_staleness: a bad value is a one-line error, exit 2
    a(
        "--pp",
        default=",".join(map(str, d.stages)),
        dest="stages",
        help="pipeline depths, comma-separated",
    )
    deprecated_flag(p, "--stages", "--pp", "stages")
    a("--schedules", default=",".join(d.schedules), help="schedule kinds, comma-separated")
    a("--microbatches", help=f"micro-batches per window ({d.num_microbatches})")
    a("--budget", help=f"micro-batches per run, a multiple of --microbatches ({d.budget})")
    a("--target", help="target validation loss (default: 1.05 × the first run's best)")
    a("--regime", default=d.regime, choices=("gpt", "image"),
      help="gpt: a character GPT, AdamW, validation loss; image: a VGG-style CNN on the "
           "8×8 digits, SGD, top-1 accuracy (needs plait[data])")  # fmt: skip
    a("--optimizer", help="the regime's by default (gpt: adamw; image: sgd, momentum 0.9)")
    a("--lr", help=f"learning rate (gpt: {d.learning_rate:g} for adamw, {sgd:g} for sgd; "
      "image: 0.02)")  # fmt: skip
    a("--equal-updates", action="store_true",
      help="every kind updates on --micro-batch-size samples (per-window kinds split them "
           "into --microbatches); --budget counts updates")  # fmt: skip
    a("--micro-batch-size", help=f"samples per micro-batch ({d.micro_batch_size})")
    a("--remedy", default="none", choices=REMEDIES,
      help="a paper's remedy for staleness: lr-warmup (PipeDream), staleness-lr "
           "(Zhang et al. 2016)")  # fmt: skip
    a("--seed", help=f"seed of the model, the data order and the validation set ({d.seed})")
    a("--json", action="store_true", help="print the result as one JSON line")
    a("--plot", metavar="PATH", help="draw validation loss against epochs as a PNG")
    p.set_defaults(func=_run_staleness)


def _config_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {
        # any order on the command line; the config wants them increasing
        "stages": tuple(sorted(number("pp", s, int) for s in args.stages.split(",") if s.strip())),
        "schedules": tuple(s.strip() for s in args.schedules.split(",") if s.strip()),
        "regime": args.regime,
        "equal_updates": args.equal_updates,
        "remedy": args.remedy,
    }
    numbers = {"microbatches": ("num_microbatches", int), "budget": ("budget", int),
               "target": ("target", float), "lr": ("lr", float), "seed": ("seed", int),
               "micro_batch_size": ("micro_batch_size", int)}  # fmt: skip
    for flag, (field, kind) in numbers.items():
        if getattr(args, flag) is not None:
            fields[field] = number(flag, getattr(args, flag), kind)
    if args.optimizer is not None:
        fields["optimizer"] = args.optimizer
    return fields


def _run_staleness(args: argparse.Namespace) -> int:
    from plait.experiment import staleness, staleness_plot

    config = staleness.StalenessConfig(**_config_fields(args))
    if args.plot:  # fail before a long run, not after it
        from plait.cli.plan import check_out

        check_out(args.plot, "--plot")
        try:
            staleness_plot.require_matplotlib()
        except RuntimeError as err:
            raise ValueError(f"--plot: {err}") from None
    result = staleness.run_experiment(config)
    if args.plot:
        staleness_plot.plot(result, args.plot)
    if args.json:
        from plait.bench._common import print_json

        print_json(result.to_dict())
    else:
        _print_table(result)
    return 0


def _print_table(result: Any) -> None:
    from plait.bench._common import print_table

    stages = result.config.stages
    rows = []
    for kind in result.config.schedules:
        epochs = [result.epochs_to_target(kind, p) for p in stages]
        rows.append([kind, *("-" if e is None else f"{e:.2f}" for e in epochs)])
    what = "top-1 accuracy" if result.config.metric == "val_accuracy" else "loss"
    lines = [f"target: validation {what} {result.target:.4f}; '-': not reached in the budget"]
    footer = "\n".join(lines + [f"- {line}" for line in result.findings()])
    print_table("epochs to the target", ["schedule", *(f"p={p}" for p in stages)], rows,
                footer=footer)  # fmt: skip
