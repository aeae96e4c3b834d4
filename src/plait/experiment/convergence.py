"""`plait experiment convergence`: the seeds' convergence claims measured in one resumable
run, written up as `convergence.md` with PNG plots.

Four sections, each a run of an existing experiment or bench with the settings below:
- `image` and `gpt`, the staleness experiment (`plait.experiment.staleness`) in the
  papers' regime (a VGG-style CNN on the 8×8 digits, SGD with momentum) and in the GPT
  regime (AdamW), every kind updating on the same samples (`equal_updates`), plus the
  papers' remedies (`stale_train.REMEDIES`) for the asynchronous kinds at `remedy_stages`;
- `compress`, `plait bench compress` (`plait.bench.compress`): bytes and loss per method,
  DGC with its remedies one at a time turned off;
- `wsp`, `plait bench hetpipe` (`plait.bench.hetpipe`): equal data parallelism, the
  planner's heterogeneous plan and WSP, to a target loss, in updates and in seconds.

The results are kept in `convergence.json` under the output folder, rewritten after each
section, so a run started again with the same folder and settings skips the sections it
has. The report (`plait.experiment.convergence_report`) sets the seeds' and papers'
figures beside plait's, with the checks the issue names and a hand-written discussion
(`convergence-discussion.md` in the folder, kept across runs) when there is one.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from plait.bench.compress_config import CompressBenchConfig
from plait.bench.hetpipe_config import HetPipeBenchConfig
from plait.experiment.report import Store, plain
from plait.experiment.staleness import StalenessConfig

__all__ = ["SECTIONS", "ConvergenceConfig", "quick_config", "run_convergence"]

SECTIONS = ("image", "gpt", "compress", "wsp")
_ASYNC = ("pipedream", "pipedream-vs", "2bw", "spectrain", "xpipe")
_KINDS = ("1f1b", *_ASYNC)


def _image() -> StalenessConfig:
    # PipeDream's VGG-16 runs: lr 0.01 at minibatch 128, momentum 0.9; linearly scaled to
    # this minibatch of 32, 0.0025
    return StalenessConfig(regime="image", schedules=_KINDS, stages=(1, 4),
                           num_microbatches=2, micro_batch_size=32, width=8, lr=0.0025,
                           budget=600, eval_every=16, equal_updates=True)  # fmt: skip


def _gpt() -> StalenessConfig:
    return StalenessConfig(regime="gpt", schedules=_KINDS, stages=(1, 4),
                           num_microbatches=2, micro_batch_size=16, num_layers=6, hidden=48,
                           seq_len=32, budget=240, eval_every=16, train_sequences=1024,
                           equal_updates=True)  # fmt: skip


def _compress() -> CompressBenchConfig:
    return CompressBenchConfig(methods=(
        "none", "topk:0.01", "threshold:0.05", "dgc:0.001", "dgc:0.001:global-topk",
        "dgc:0.001:no-correction", "dgc:0.001:no-masking", "dgc:0.001:no-warmup",
    ))  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class ConvergenceConfig:
    """The sections to run and each one's settings (defaults: minutes each on 2 cores)."""

    sections: tuple[str, ...] = SECTIONS
    image: StalenessConfig = field(default_factory=_image)
    gpt: StalenessConfig = field(default_factory=_gpt)
    remedies: tuple[str, ...] = ("lr-warmup", "staleness-lr")
    remedy_stages: int = 4
    remedy_schedules: tuple[str, ...] = ("pipedream", "pipedream-vs", "2bw")
    compress: CompressBenchConfig = field(default_factory=_compress)
    # the SGD run again at D = 0, the ablation that parts staleness from per-pipeline momentum
    wsp: tuple[HetPipeBenchConfig, ...] = (
        HetPipeBenchConfig(),
        HetPipeBenchConfig(optimizer="sgd", lr=0.1),
        HetPipeBenchConfig(optimizer="sgd", lr=0.1, staleness=0),
    )

    def __post_init__(self) -> None:
        unknown = [s for s in self.sections if s not in SECTIONS]
        if unknown or not self.sections:
            raise ValueError(f"sections={list(self.sections)}: name some of {list(SECTIONS)}")
        for regime in (self.image, self.gpt):
            if self.remedy_stages not in regime.stages:
                raise ValueError(
                    f"remedy_stages={self.remedy_stages} is not among the {regime.regime} "
                    f"regime's stages {list(regime.stages)}: pick one of them"
                )


def quick_config(sections: tuple[str, ...] = SECTIONS) -> ConvergenceConfig:
    """Every section at a size of seconds (the test suite's and the README's short form)."""
    small: dict[str, Any] = {"stages": (1, 2), "schedules": ("1f1b", "pipedream", "spectrain"),
             "num_microbatches": 2, "budget": 8, "eval_every": 4}  # fmt: skip
    image = dataclasses.replace(_image(), **small, micro_batch_size=8, width=2)
    gpt = dataclasses.replace(_gpt(), **small, micro_batch_size=4, num_layers=2, hidden=16,
                              num_heads=2, seq_len=16, train_sequences=32,
                              eval_batches=2)  # fmt: skip
    tiny: dict[str, Any] = {"layers": 1, "hidden": 32, "seq_len": 16, "batch_size": 8}
    compress = CompressBenchConfig(workers=(2,), methods=("none", "dgc:0.001"), num_steps=5,
                                   num_warmup=0, num_layers=1, hidden=32, seq_len=16,
                                   batch_size=8)  # fmt: skip
    wsp = HetPipeBenchConfig(workers=2, slow=1, steps=4, turn=2, window=1, heads=2, **tiny)
    return ConvergenceConfig(sections=sections, image=image, gpt=gpt, remedy_stages=2,
                             remedy_schedules=("pipedream",), compress=compress,
                             wsp=(wsp,))  # fmt: skip


def run_convergence(config: ConvergenceConfig, out: Path, *, quiet: bool = False) -> dict[str, Any]:
    """Run (or resume) every section of `config` into `out`, then write the report and its
    plots there; returns the results."""
    from plait.experiment.convergence_report import write_report

    store = Store(out / "convergence.json")
    for section in config.sections:
        wanted = plain(_settings(config, section))
        if store.data.get(section, {}).get("settings") == wanted:
            _say(quiet, f"{section}: kept from {store.path}")
            continue
        _say(quiet, f"{section}: running")
        store.put(section, {"settings": wanted, **_run(config, section, quiet=quiet)})
    write_report(store.data, out)
    _say(quiet, f"wrote {out / 'convergence.md'}")
    return store.data


def _settings(config: ConvergenceConfig, section: str) -> dict[str, Any]:
    if section in ("image", "gpt"):
        regime = getattr(config, section)
        return {"staleness": asdict(regime), "remedies": list(config.remedies),
                "remedy_stages": config.remedy_stages,
                "remedy_schedules": list(config.remedy_schedules)}  # fmt: skip
    if section == "compress":
        return {"bench": asdict(config.compress)}
    return {"bench": [asdict(c) for c in config.wsp]}


def _run(config: ConvergenceConfig, section: str, *, quiet: bool) -> dict[str, Any]:
    if section in ("image", "gpt"):
        return _staleness(getattr(config, section), config, quiet=quiet)
    if section == "compress":
        from plait.bench.compress import run_bench

        return {"result": run_bench(config.compress)}
    from plait.bench.hetpipe import run_bench as run_hetpipe

    results = []
    for i, bench in enumerate(config.wsp, 1):
        _say(quiet, f"wsp: {bench.optimizer}, D={bench.staleness} ({i} of {len(config.wsp)})")
        results.append(run_hetpipe(bench))
    return {"results": results}


def _staleness(
    regime: StalenessConfig, config: ConvergenceConfig, *, quiet: bool
) -> dict[str, Any]:
    """The regime's table, then each remedy for its asynchronous kinds at remedy_stages,
    measured against the table's target."""
    from plait.experiment.staleness import run_experiment

    main = run_experiment(regime, quiet=quiet)
    remedied = {}
    kinds = tuple(k for k in regime.schedules if k in config.remedy_schedules)
    for remedy in config.remedies if kinds else ():
        again = dataclasses.replace(regime, schedules=kinds, stages=(config.remedy_stages,),
                                    remedy=remedy, target=main.target)  # fmt: skip
        remedied[remedy] = run_experiment(again, quiet=quiet).to_dict()
    return {"main": main.to_dict(), "remedies": remedied}


def _say(quiet: bool, line: str) -> None:
    if not quiet:
        print(f"experiment convergence: {line}", file=sys.stderr, flush=True)
