"""Gradient compression: bytes, step time and loss per method; fp16 and PowerSGD vs DDP's hooks.

For each worker count in `--workers`, the workers train one GPT per method (same seed,
same corpus batches: the Python standard library's source) under plait's data parallelism
(`ParallelPlan(dp=workers, pp=1, compress=METHOD)`), and, as peers, torch's
`DistributedDataParallel` with torch's own `fp16_compress_hook` and `powerSGD_hook`
registered. The runs take turns every step (the order rotates) so machine noise hits
all alike. Per method: `bytes_sent_per_step`, counted by wrapping torch.distributed's
collectives in each worker and adding up the bytes of the tensors each rank hands them
(an all-reduce's buffer, an all-gather's input; plait's step also all-reduces each
micro-batch's loss and count, 8 bytes), the median over the steps after `--warmup`, and
`bytes_vs_none` (that over `none`'s; `bytes_vs_none_total` compares the means over every
step instead, PowerSGD's plain first steps and DGC's sparsity warm-up included); `step_s`,
the median step; `loss`, the mean training loss of the last 5 steps, and `loss_vs_none`;
`curve`, every step's loss and end (seconds from the first step, the slowest rank's);
for fp16 and PowerSGD, `ddp_step_s` and `ratio_vs_ddp_hook` (plait's step / DDP's, same
hook; below 1 is faster), and for `none` the same ratio against DDP's own all-reduce, the
control for what plait's step costs besides the hook. `threshold_claim` checks seed 000's claim for
Ström's method (a threshold setting with `bytes_vs_none` <= 0.01 and `loss_vs_none` <=
1.02), `claim` the same for any method (DGC, Lin et al. 2018, claims 270-600×).

Limits: on a CPU the workers share its cores with gloo's collectives, so the time a
method saves on the wire is small next to a fast local link; the bytes carry over to
any machine, the times do not.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import statistics
from collections.abc import Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from plait.bench import _common as common
from plait.bench.compress_config import PEERS, CompressBenchConfig

if TYPE_CHECKING:
    import torch

__all__ = ["add_arguments", "run", "run_bench"]


def run_bench(config: CompressBenchConfig) -> dict[str, Any]:
    from plait.train import launch

    out: dict[str, Any] = {"config": asdict(config), "workers": {}}
    for w in config.workers:
        per_rank = launch(_worker, w, config, w)
        reports = [per_rank[r] for r in sorted(per_rank)]
        out["workers"][str(w)] = _summarise(config, reports)
    out["threshold_claim"] = _claim(out)
    out["claim"] = _any_claim(out)
    return out


def _claim(out: dict[str, Any]) -> dict[str, Any]:
    """Seed 000's claim for Ström's method, checked on each worker count: the threshold
    setting that sends at least 100× fewer bytes than the fp32 all-reduce, and whether its
    loss is within 2% of the uncompressed run's."""
    return _best(out, "threshold:")


def _any_claim(out: dict[str, Any]) -> dict[str, Any]:
    """The same claim for any method (DGC's 270–600× with no loss, Lin et al. 2018): the
    method sending at least 100× fewer bytes with the lowest loss, per worker count."""
    return _best(out, "")


def _best(out: dict[str, Any], prefix: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for w, res in out["workers"].items():
        runs = {m: r for m, r in res["methods"].items() if m.startswith(prefix)}
        sparse = [(m, r) for m, r in runs.items() if r["bytes_vs_none"] <= 0.01]
        if not sparse:
            what = f"{prefix.rstrip(':')} setting" if prefix else "method"
            found[w] = {"method": None, "why": f"no {what} sent 100x fewer bytes"}
            continue
        m, r = min(sparse, key=lambda mr: mr[1]["loss_vs_none"])
        found[w] = {
            "method": m,
            "fewer_bytes": 1 / r["bytes_vs_none"],
            "fewer_bytes_with_warmup": 1 / r["bytes_vs_none_total"],
            "loss_vs_none": r["loss_vs_none"],
            "within_2_percent": r["loss_vs_none"] <= 1.02,
        }
    return found


def _summarise(config: CompressBenchConfig, reports: list[dict[str, Any]]) -> dict[str, Any]:
    names = list(reports[0]["times"])
    # a step lasts as long as its slowest rank
    slowest = {n: [max(times) for times in zip(*(r["times"][n] for r in reports), strict=True)]
               for n in names}  # fmt: skip
    steps = {n: statistics.median(slowest[n]) for n in names}
    loss = {n: statistics.mean(reports[0]["losses"][n][-5:]) for n in config.methods}
    for peer in PEERS:  # DDP's losses are each rank's share's: average the ranks
        if f"ddp:{peer}" in names:
            tails = [statistics.mean(r["losses"][f"ddp:{peer}"][-5:]) for r in reports]
            loss[f"ddp:{peer}"] = statistics.mean(tails)
    # every step's end, from the first, as the slowest rank saw it (for curves in time)
    ends = {n: list(itertools.accumulate(max(t) for t in zip(*(r["steps_s"][n] for r in reports),
                                                               strict=True)))
            for n in names}  # fmt: skip
    sent = {n: max(r["bytes"][n] for r in reports) for n in names}
    total = {n: max(r["bytes_total"][n] for r in reports) for n in names}
    methods: dict[str, Any] = {}
    for m in config.methods:
        row = {
            "bytes_sent_per_step": sent[m],
            "bytes_vs_none": sent[m] / sent["none"],
            "bytes_vs_none_total": total[m] / total["none"],
            "step_s": steps[m],
            "loss": loss[m],
            "loss_vs_none": loss[m] / loss["none"],
            "curve": {"loss": reports[0]["losses"][m], "end_s": ends[m]},
        }
        peer = f"ddp:{m.split(':')[0]}"
        if peer in steps:
            row.update(
                ddp_step_s=steps[peer],
                # DDP's own all-reduce runs in C++, where the count cannot see it
                ddp_bytes_sent_per_step=sent[peer] if m != "none" else None,
                ddp_loss=loss[peer],
                ratio_vs_ddp_hook=steps[m] / steps[peer],
            )
        methods[m] = row
    return {"num_params": reports[0]["num_params"], "methods": methods}


# ------------------------------------------------------------------ in the workers
_SENT = [0]
# the position of the input tensor where it is not the first argument
_INPUT = {"all_gather": 1, "all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}


@contextlib.contextmanager
def _counting() -> Iterator[None]:
    """torch.distributed's collectives add the bytes of what this rank hands them to _SENT
    (torch's and plait's hooks call them through the module, so they are seen)."""
    import torch.distributed as dist

    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
             "broadcast", "all_to_all_single")  # fmt: skip
    saved = {n: getattr(dist, n) for n in names}

    def wrap(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = args[_INPUT.get(name, 0)]  # what this rank hands the collective
            _SENT[0] += tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)

        return counted

    for n, fn in saved.items():
        setattr(dist, n, wrap(n, fn))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def _worker(config: CompressBenchConfig, workers: int) -> dict[str, Any]:
    common.single_thread()
    import torch.distributed as dist

    from plait.mesh import init_worker

    env, device = init_worker(timeout_s=300.0)
    try:
        with _counting():
            return _measure(config, workers, env.rank, device)
    finally:
        dist.destroy_process_group()


def _measure(
    config: CompressBenchConfig, workers: int, rank: int, device: torch.device
) -> dict[str, Any]:
    import torch.distributed as dist

    from plait.data import stdlib_corpus

    corpus = stdlib_corpus()
    runners: dict[str, Any] = {
        m: _Plait(config, workers, m, corpus, device) for m in config.methods
    }
    for m in config.methods:
        if m.split(":")[0] in PEERS:
            runners[f"ddp:{m.split(':')[0]}"] = _DDP(config, workers, m, corpus, rank, device)
    names = list(runners)
    out: dict[str, Any] = {
        "times": {n: [] for n in names},
        "losses": {n: [] for n in names},
        "steps_s": {n: [] for n in names},
        "bytes": {},
        "num_params": sum(p.numel() for p in runners["none"].model.parameters()),
    }
    sent: dict[str, list[int]] = {n: [] for n in names}
    for i in range(config.num_steps):
        x, y = (t.to(device) for t in corpus.batch(i, config.batch_size, config.seq_len,
                                                    seed=config.seed))  # fmt: skip
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            before = _SENT[0]
            t = common.timed(functools.partial(runners[name].step, x, y))
            sent[name].append(_SENT[0] - before)
            out["losses"][name].append(t.value)
            out["steps_s"][name].append(t.wall_s)
            if i >= config.num_warmup:
                out["times"][name].append(t.wall_s)
    # PowerSGD runs plain all-reduces for its first steps, DGC ramps its sparsity up: the
    # steady state, and the whole run's mean beside it
    out["bytes"] = {n: statistics.median(s[config.num_warmup :]) for n, s in sent.items()}
    out["bytes_total"] = {n: statistics.mean(s) for n, s in sent.items()}
    return out


def _optimizer(config: CompressBenchConfig, params: Any) -> torch.optim.Optimizer:
    import torch

    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=config.lr)


class _Plait:
    def __init__(self, config: CompressBenchConfig, workers: int, method: str, corpus: Any,
                 device: torch.device) -> None:  # fmt: skip
        import torch

        from plait.config import ParallelPlan
        from plait.models import GPT, GPTConfig
        from plait.train.parallelize import parallelize

        torch.manual_seed(config.seed)
        self.model = GPT(GPTConfig(vocab_size=corpus.vocab_size, seq_len=config.seq_len,
                                   num_layers=config.num_layers, hidden=config.hidden,
                                   num_heads=config.num_heads))  # fmt: skip
        plan = ParallelPlan(dp=workers, pp=1, microbatches=1, compress=method)
        self.engine = parallelize(self.model, plan, functools.partial(_optimizer, config),
                                  GPT.loss, device=device, grad_clip=None)  # fmt: skip

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return float(self.engine.step((x, y)).loss)


class _DDP:
    """DDP with torch's hook for `method` (the same hook and state plait builds)."""

    def __init__(self, config: CompressBenchConfig, workers: int, method: str, corpus: Any,
                 rank: int, device: torch.device) -> None:  # fmt: skip
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from plait.models import GPT, GPTConfig
        from plait.parallel.compress import hook_for

        torch.manual_seed(config.seed)
        self.model = GPT(GPTConfig(vocab_size=corpus.vocab_size, seq_len=config.seq_len,
                                   num_layers=config.num_layers, hidden=config.hidden,
                                   num_heads=config.num_heads)).to(device)  # fmt: skip
        from plait.device import device_ids

        # plait's bucket size, given explicitly so DDP's first bucket is no smaller
        self.ddp = DistributedDataParallel(self.model, device_ids=device_ids(device),
                                           bucket_cap_mb=25)  # fmt: skip
        group = dist.group.WORLD
        assert group is not None
        if method != "none":
            hook, state = hook_for(method, group)  # type: ignore[misc]
            self.ddp.register_comm_hook(state, hook)
        self.optimizer = _optimizer(config, self.ddp.parameters())
        self.workers, self.rank = workers, rank

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        import torch.distributed as dist

        from plait.models import GPT

        self.optimizer.zero_grad(set_to_none=True)
        share = (x.chunk(self.workers)[self.rank], y.chunk(self.workers)[self.rank])
        loss = GPT.loss(self.ddp(share[0]), share[1])
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        # the step's loss over all replicas, as plait's step reports it (and as a training
        # loop that logs its loss computes it): one small all-reduce, in both runtimes
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return float(mean) / self.workers


# ------------------------------------------------------------------ command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = CompressBenchConfig()
    a = parser.add_argument
    a("--workers", default=",".join(map(str, d.workers)), help="worker counts, comma-separated")
    a("--methods", default=",".join(d.methods), help="--compress values, comma-separated")
    a("--steps", type=int, default=d.num_steps, help="training steps per method")
    a("--warmup", type=int, default=d.num_warmup, help="first steps left out of the times")
    a("--layers", type=int, default=d.num_layers, help="GPT transformer layers")
    a("--hidden", type=int, default=d.hidden, help="GPT hidden size")
    a("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    a("--batch-size", type=int, default=d.batch_size, help="sequences per step (all workers)")
    a("--optimizer", default=d.optimizer, choices=("adamw", "sgd"), help="sgd: momentum 0.9")
    a("--lr", type=float, default=d.lr, help="learning rate")
    a("--json", action="store_true", help="print one JSON object instead of tables")


def run(args: argparse.Namespace) -> int:
    config = CompressBenchConfig(
        workers=tuple(int(w) for w in args.workers.split(",") if w),
        methods=tuple(m for m in args.methods.split(",") if m),
        num_steps=args.steps,
        num_warmup=args.warmup,
        num_layers=args.layers,
        hidden=args.hidden,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        optimizer=args.optimizer,
        lr=args.lr,
    )
    result = run_bench(config)
    if args.json:
        common.print_json(result)
        return 0
    for w, res in result["workers"].items():
        rows = [
            [m, f"{r['bytes_sent_per_step']:,.0f}", f"{1 / r['bytes_vs_none']:.1f}×",
             f"{r['step_s'] * 1e3:.1f}", f"{r['loss']:.3f}", f"{r['loss_vs_none']:.3f}",
             f"{r['ratio_vs_ddp_hook']:.2f}" if "ratio_vs_ddp_hook" in r else "-"]
            for m, r in res["methods"].items()
        ]  # fmt: skip
        claim = result["claim"][w]
        said = (
            claim["why"]
            if not claim["method"]
            else (
                f"{claim['method']}: {claim['fewer_bytes']:.0f}× fewer bytes "
                f"({claim['fewer_bytes_with_warmup']:.0f}× over the whole run), loss "
                f"{claim['loss_vs_none']:.3f}× none's"
            )
        )
        common.print_table(
            f"gradient compression, {w} workers, {res['num_params']:,} parameters",
            ["method", "bytes/step", "fewer bytes", "step ms", "loss", "vs none", "vs DDP hook"],
            rows,
            footer=f"100× fewer bytes, best loss: {said}",
        )
    return 0
