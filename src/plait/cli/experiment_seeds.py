"""`plait experiment dp-vs-gpipe | data-movement | all`: seeds 001 and 003's tables, measured
here and predicted at the papers' scale (`plait.experiment.dp_vs_gpipe`, `.data_movement`,
`.report`).

Each prints its Markdown tables (or, with `--json`, one JSON line); `--out DIR` also keeps
`results.json` and `report.md` there, and a run started again with the same folder skips
the cells it already measured. Lists are comma-separated; numbers are checked before any
worker starts.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from plait.cli.lazy import LazyChoices
from plait.cli.options import number

__all__ = ["add_seed_experiments"]


def add_seed_experiments(experiments: LazyChoices) -> None:
    """The seeds' experiments, each filled in when chosen (their configs import torch)."""
    experiments.add_lazy("dp-vs-gpipe", _dp_parser,
                         help="ResNet-18: data parallel vs GPipe (seed 001)")  # fmt: skip
    experiments.add_lazy("data-movement", _dm_parser, help="input and parameter movement "
                         "shares of a data-parallel step (seed 003, Table 2)")  # fmt: skip
    experiments.add_lazy("all", _all_parser,
                         help="every experiment: one Markdown report, PNGs, JSON")  # fmt: skip


def _dp_parser(p: argparse.ArgumentParser) -> None:
    _dp_arguments(p)
    _common(p)
    p.set_defaults(func=_run_dp)


def _dm_parser(p: argparse.ArgumentParser) -> None:
    _dm_arguments(p)
    _common(p)
    p.set_defaults(func=_run_dm)


def _all_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="folder of report.md, results.json and PNGs")
    _dp_arguments(p)
    _dm_arguments(p, prefix="movement-")
    a = p.add_argument
    a("--staleness-stages", default="1,2,4", help="staleness: pipeline depths (1,2,4)")
    a("--staleness-schedules", default="1f1b,pipedream,2bw", help="staleness: schedule kinds")
    a("--staleness-budget", default="160", help="staleness: micro-batches per run (160)")
    a("--staleness-layers", default="6", help="staleness: the GPT's layers (6)")
    a("--no-staleness", action="store_true", help="leave the staleness experiment out")
    _predict_only(p)
    a("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_run_all)


def _predict_only(p: argparse.ArgumentParser) -> None:
    help = "only the simulator's prediction at the paper's scale: train nothing"
    p.add_argument("--predict-only", action="store_true", help=help)


def _common(p: argparse.ArgumentParser) -> None:
    _predict_only(p)
    p.add_argument("--out", help="folder for results.json and report.md (resumable)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _dp_arguments(p: argparse.ArgumentParser) -> None:
    from plait.experiment.dp_vs_gpipe import DpGpipeConfig, PaperSetup

    d, s, a = DpGpipeConfig(), PaperSetup(), p.add_argument
    a("--workers", default=",".join(map(str, d.workers)), help="worker counts measured here")
    a("--epochs", default=str(d.epochs), help=f"epochs measured here ({d.epochs})")
    a("--data", default=d.data, help="synthetic (default) or cifar100:PATH")
    a("--dtype", default=",".join(d.dtypes), help="dtypes measured here: fp32, fp16, bf16")
    a("--images", default=str(d.train_images), help=f"training images here ({d.train_images})")
    a("--width", default=str(d.width), help=f"ResNet-18 width here ({d.width}; paper 64)")
    a("--paper-cluster", default=s.cluster, help=f"cluster of the prediction ({s.cluster})")
    a("--paper-chunks", default=str(s.chunks), help=f"GPipe micro-batches assumed ({s.chunks})")
    a("--loader-rate", default=str(s.loader_samples_per_s),
      help="input pipeline samples/s per process assumed for the paper")  # fmt: skip


def _dm_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    from plait.experiment.data_movement import DataMovementConfig, PaperSetup

    d, s, a = DataMovementConfig(), PaperSetup(), p.add_argument
    a(f"--{prefix}models", default=",".join(d.models), help="models (resnet34, resnet50, "
      "vgg19, mobilenet_v2)")  # fmt: skip
    a(f"--{prefix}workers", default=",".join(map(str, d.workers)), help="worker counts here")
    a(f"--{prefix}batch-size", default=str(d.batch_size), help=f"batch here ({d.batch_size})")
    a(f"--{prefix}image-size", default=str(d.image_size), help=f"image side ({d.image_size})")
    a(f"--{prefix}steps", default=str(d.steps), help=f"timed steps per cell ({d.steps})")
    a(f"--{prefix}cluster", default=s.cluster, help=f"cluster of the prediction ({s.cluster})")


def _ints(flag: str, text: str) -> tuple[int, ...]:
    return tuple(number(flag, t.strip(), int) for t in text.split(",") if t.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _dp_configs(args: argparse.Namespace) -> tuple[Any, Any]:
    from plait.experiment.dp_vs_gpipe import DpGpipeConfig, PaperSetup

    config = DpGpipeConfig(
        workers=_ints("workers", args.workers), epochs=number("epochs", args.epochs, int),
        data=args.data, dtypes=_names(args.dtype),
        train_images=number("images", args.images, int), width=number("width", args.width, int),
    )  # fmt: skip
    rate = number("loader-rate", args.loader_rate, float)
    chunks = number("paper-chunks", args.paper_chunks, int)
    setup = PaperSetup(cluster=args.paper_cluster, chunks=chunks, loader_samples_per_s=rate)
    _check_data(config.data)
    return config, setup


def _check_data(data: str) -> None:
    if data.startswith("cifar100:") and not Path(data.split(":", 1)[1]).is_dir():
        raise ValueError(f"--data {data}: folder {data.split(':', 1)[1]} does not exist; "
                         "extract CIFAR-100's python release there")  # fmt: skip


def _dm_configs(args: argparse.Namespace, prefix: str = "") -> tuple[Any, Any]:
    from plait.experiment.data_movement import DataMovementConfig, PaperSetup

    attr = prefix.replace("-", "_")

    def get(name: str) -> str:
        return str(getattr(args, attr + name))

    config = DataMovementConfig(
        models=_names(get("models")), workers=_ints(f"{prefix}workers", get("workers")),
        batch_size=number(f"{prefix}batch-size", get("batch_size"), int),
        image_size=number(f"{prefix}image-size", get("image_size"), int),
        steps=number(f"{prefix}steps", get("steps"), int),
    )  # fmt: skip
    return config, PaperSetup(cluster=get("cluster"))


def _check_cluster(name: str, flag: str) -> None:
    from plait.presets import load_cluster

    try:
        load_cluster(name)
    except (ValueError, FileNotFoundError, OSError) as err:
        raise ValueError(f"--{flag} {name!r}: {err}") from None


def _finish(args: argparse.Namespace, section: str, result: dict[str, Any]) -> int:
    from plait.experiment.report import Store, render_markdown

    if args.out:
        store = Store(Path(args.out) / "results.json")
        store.put(section, result)
        note = "No plots here: `plait experiment all` draws them."
        (Path(args.out) / "report.md").write_text(render_markdown(store.data, note))
    if args.json:
        from plait.bench._common import print_json

        print_json(result)
    else:
        print(render_markdown({section: result}, "(plots: `plait experiment all`)"))
    return 0


def _done(args: argparse.Namespace, section: str, config: Any) -> tuple[dict[str, Any], Any]:
    """Cells measured by an earlier run into the same --out with the same configuration."""
    if not args.out:
        return {}, None
    from plait.experiment.report import Store

    return Store(Path(args.out) / "results.json").resume(section, config)


def _run_dp(args: argparse.Namespace) -> int:
    from plait.experiment import dp_vs_gpipe

    config, setup = _dp_configs(args)
    _check_cluster(setup.cluster, "paper-cluster")
    done, save = _done(args, "dp_vs_gpipe", config)
    root = Path(args.out or ".") / "runs"
    result = dp_vs_gpipe.run_experiment(config, setup, run_root=root, done=done, save=save,
                                        quiet=args.quiet, train=not args.predict_only)  # fmt: skip
    return _finish(args, "dp_vs_gpipe", result)


def _run_dm(args: argparse.Namespace) -> int:
    from plait.experiment import data_movement

    config, setup = _dm_configs(args)
    _check_cluster(setup.cluster, "cluster")
    done, save = _done(args, "data_movement", config)
    result = data_movement.run_experiment(config, setup, done=done, save=save, quiet=args.quiet,
                                          train=not args.predict_only)  # fmt: skip
    return _finish(args, "data_movement", result)


def _run_all(args: argparse.Namespace) -> int:
    from plait.experiment.report import run_all
    from plait.experiment.staleness import StalenessConfig

    dp, dp_setup = _dp_configs(args)
    dm, dm_setup = _dm_configs(args, "movement-")
    _check_cluster(dp_setup.cluster, "paper-cluster")
    _check_cluster(dm_setup.cluster, "movement-cluster")
    staleness = None
    if not (args.no_staleness or args.predict_only):
        staleness = StalenessConfig(
            stages=tuple(sorted(_ints("staleness-stages", args.staleness_stages))),
            schedules=_names(args.staleness_schedules),
            budget=number("staleness-budget", args.staleness_budget, int),
            num_layers=number("staleness-layers", args.staleness_layers, int),
        )  # fmt: skip
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {args.out} is a file: name a folder")
    run_all(out, dp=dp, dp_setup=dp_setup, movement=dm, movement_setup=dm_setup,
            staleness=staleness, quiet=args.quiet, measure=not args.predict_only)  # fmt: skip
    print(f"wrote {out / 'report.md'}, {out / 'results.json'} and the PNGs beside them")
    return 0
