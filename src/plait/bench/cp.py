"""Context parallelism: one long-sequence GPT at cp = 1, 2 (and 4), measured against the simulator.

For each cp, the same GPT (same seed) trains `--steps` steps per repeat on cp ranks of one
gloo (CPU) or NCCL (CUDA) world of `--cp-max` workers, each rank holding two zigzag
chunks of every sequence (`plait.parallel.context`); the configurations take turns,
repeat after repeat, so that a load on the machine falls on all of them alike. Reported
per configuration:

- step time: the median over repeats of rank 0's mean step, with the spread (min, max);
- activation memory per rank: on CUDA the allocator's peak during a step less what it
  held before; on CPU the bytes of the tensors autograd saves for backward in one forward
  (`torch.autograd.graph.saved_tensors_hooks`, each storage counted once, parameters
  left out): `memory_source` says which;
- the simulator's prediction of both (`plait.sim` on the analytic blocks of this GPT, on
  `local-cpu` or, on CUDA, `dgx-h100`), and the relative error of each.

`activation_memory_ratio` is cp=2's measured activation bytes per rank over cp=1's.
torch's `torch.distributed.tensor.experimental.context_parallel` is the peer where it
runs; it replaces only CUDA attention kernels, so on CPU the JSON says it was not run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from plait.bench import _common as common

__all__ = ["CpBenchConfig", "add_arguments", "predict", "run", "run_bench"]

PEER_CPU = (
    "torch context_parallel: not run (CPU: it swaps only the CUDA SDPA kernels, "
    "_scaled_dot_product_flash/efficient/cudnn_attention, while CPU attention runs "
    "_scaled_dot_product_flash_attention_for_cpu)"
)
PEER_CUDA = "torch context_parallel: not run (not wired into this bench yet)"


@dataclass(frozen=True, kw_only=True)
class CpBenchConfig:
    """The GPT, the batch, and how often each configuration is timed."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    seq_len: int = 2048
    vocab_size: int = 96
    batch_size: int = 1
    cp_max: int = 2
    repeats: int = 3
    steps: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq_len", "vocab_size", "batch_size",
                     "repeats", "steps"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if self.cp_max not in (2, 4):
            raise ValueError(f"--cp-max {self.cp_max}: use 2 (cp 1, 2) or 4 (cp 1, 2, 4)")
        if self.seq_len % (2 * self.cp_max):
            raise ValueError(
                f"--seq-len {self.seq_len} must be divisible by 2·cp-max = {2 * self.cp_max} "
                "(zigzag chunks): change it"
            )
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be divisible by --heads {self.heads}")

    @property
    def cps(self) -> tuple[int, ...]:
        return tuple(c for c in (1, 2, 4) if c <= self.cp_max)


def _saved_bytes(model: Any, fn: Any) -> tuple[Any, float]:
    """(fn(), bytes of the storages autograd saved during it, parameters excluded)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, float(sum(seen.values()))


def _step(model: Any, opt: Any, cfg: CpBenchConfig, cp: int, rank: int, group: Any,
          device: Any, step: int, measure: bool) -> float:  # fmt: skip
    """One training step of this rank's shard; returns the activation bytes (measure)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from plait.parallel.context import zigzag_shard

    g = torch.Generator().manual_seed(cfg.seed + step)
    ids = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    if cp > 1:
        x, y = zigzag_shard(x, cp, rank), zigzag_shard(y, cp, rank)
    x, y = x.contiguous().to(device), y.contiguous().to(device)

    def forward() -> Any:
        logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    before = 0.0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = float(torch.cuda.memory_allocated(device))
    loss, saved = _saved_bytes(model, forward) if measure else (forward(), 0.0)
    if device.type == "cuda":
        saved = float(torch.cuda.max_memory_allocated(device)) - before
    loss.backward()
    if cp > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
            p.grad /= cp
    opt.step()
    opt.zero_grad(set_to_none=True)
    return saved


def _worker(rank: int, world: int, store: str, cfg: CpBenchConfig, out: str) -> None:
    import torch
    import torch.distributed as dist

    from plait.models.gpt import GPT, GPTConfig
    from plait.train.context import apply_context_parallel

    common.single_thread()
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            init_method=f"file://{store}")  # fmt: skip
    groups = {cp: dist.new_group(list(range(cp))) for cp in cfg.cps if cp > 1}
    gpt = GPTConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, num_layers=cfg.layers,
                    hidden=cfg.hidden, num_heads=cfg.heads)  # fmt: skip
    models, opts = {}, {}
    for cp in cfg.cps:
        if rank < cp:
            torch.manual_seed(cfg.seed)
            models[cp] = GPT(gpt).to(device)
            opts[cp] = torch.optim.SGD(models[cp].parameters(), lr=1e-3)
            if cp > 1:
                apply_context_parallel({0: models[cp]}, groups[cp])
    times: dict[int, list[float]] = {cp: [] for cp in cfg.cps}
    saved: dict[int, float] = {}
    for cp in cfg.cps:  # a warm-up step each, which also measures the saved bytes
        if rank < cp:
            saved[cp] = _step(models[cp], opts[cp], cfg, cp, rank, groups.get(cp), device, 0, True)
        dist.barrier()
    for repeat in range(cfg.repeats):
        for cp in cfg.cps:
            if rank < cp:
                start = common.now(device)
                for i in range(cfg.steps):
                    _step(models[cp], opts[cp], cfg, cp, rank, groups.get(cp), device,
                          1 + repeat * cfg.steps + i, False)  # fmt: skip
                times[cp].append((common.now(device) - start) / cfg.steps)
            dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps({"device": device.type, "times": times, "saved": saved}))
    dist.destroy_process_group()


def measure(cfg: CpBenchConfig) -> dict[str, Any]:
    """Run the workers (spawned processes, one per rank of the largest ring); rank 0's
    step times and activation bytes per cp."""
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        # a file in the run's own folder meets the workers: a free TCP port found first may
        # be taken by another process before they bind it, and then they wait forever
        store = os.path.join(tmp, "store")
        workers = [
            context.Process(target=_worker, args=(r, cfg.cp_max, store, cfg, out))
            for r in range(cfg.cp_max)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        failed = [r for r, w in enumerate(workers) if w.exitcode]
        if failed:
            code = workers[failed[0]].exitcode
            raise RuntimeError(
                f"plait bench cp: rank {failed[0]} exited with {code} (its error is above)"
            )
        data: dict[str, Any] = json.loads(Path(out).read_text())
    return data


def predict(cfg: CpBenchConfig, cp: int, device_type: str) -> dict[str, float]:
    """The simulator's step time and activation bytes per rank for this GPT at `cp`."""
    from plait.cost import transformer_block_costs
    from plait.plan.predict import predict as predict_step
    from plait.plan.predict import scaled_cluster
    from plait.presets import load_cluster
    from plait.sim import SimPlan

    plan = SimPlan(cp=cp, pp=1, dtype="fp32", seq_len=cfg.seq_len,
                   micro_batch_size=cfg.batch_size, optimizer="sgd")  # fmt: skip
    blocks = transformer_block_costs(
        num_layers=cfg.layers, hidden=cfg.hidden, num_heads=cfg.heads, seq_len=cfg.seq_len,
        vocab_size=cfg.vocab_size, micro_batch_size=cfg.batch_size, dtype="fp32",
        layout=plan, device_type=device_type,
    )  # fmt: skip
    preset = "dgx-h100" if device_type == "cuda" else "local-cpu"
    result = predict_step(blocks, scaled_cluster(load_cluster(preset), cp), plan).result
    return {"step_s": result.step_time_s, "activation_bytes": result.ranks[0].memory.activations}


def _error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else float("inf")


def run_bench(cfg: CpBenchConfig) -> dict[str, Any]:
    started = time.perf_counter()
    data = measure(cfg)
    device = data["device"]
    configs = []
    for cp in cfg.cps:
        times = data["times"][str(cp)]
        saved = data["saved"][str(cp)]
        guess = predict(cfg, cp, device)
        step = statistics.median(times)
        configs.append({
            "cp": cp,
            "measured_step_s": step,
            "measured_step_spread_s": [min(times), max(times)],
            "measured_step_all_s": times,
            "predicted_step_s": guess["step_s"],
            "step_relative_error": _error(guess["step_s"], step),
            "measured_activation_bytes": saved,
            "predicted_activation_bytes": guess["activation_bytes"],
            "memory_relative_error": _error(guess["activation_bytes"], saved),
        })  # fmt: skip
    by_cp = {c["cp"]: c for c in configs}
    return {
        "config": asdict(cfg),
        "device": device,
        "memory_source": "cuda allocator peak" if device == "cuda" else "autograd saved tensors",
        "configs": configs,
        "activation_memory_ratio": by_cp[2]["measured_activation_bytes"]
        / by_cp[1]["measured_activation_bytes"],
        "speedup_cp2": by_cp[1]["measured_step_s"] / by_cp[2]["measured_step_s"],
        "peer": PEER_CUDA if device == "cuda" else PEER_CPU,
        "wall_s": time.perf_counter() - started,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    defaults = CpBenchConfig()
    for name in ("layers", "hidden", "heads", "seq_len", "vocab_size", "batch_size", "repeats",
                 "steps", "seed"):  # fmt: skip
        a(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name),
          dest=name, help=f"default {getattr(defaults, name)}")  # fmt: skip
    a("--cp-max", type=int, default=2, dest="cp_max", help="2: cp 1 and 2; 4: cp 1, 2 and 4")
    a("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    names = ("layers", "hidden", "heads", "seq_len", "vocab_size", "batch_size", "repeats",
             "steps", "seed", "cp_max")  # fmt: skip
    cfg = CpBenchConfig(**{n: getattr(args, n) for n in names})
    result = run_bench(cfg)
    if args.json:
        common.print_json(result)
        return 0
    rows = [
        [f"cp={c['cp']}", c["measured_step_s"], c["predicted_step_s"],
         c["measured_activation_bytes"] / 2**20, c["predicted_activation_bytes"] / 2**20,
         f"{100 * c['memory_relative_error']:+.1f}%"]
        for c in result["configs"]
    ]  # fmt: skip
    common.print_table(
        f"context parallelism, {cfg.layers}x{cfg.hidden} GPT, {cfg.seq_len} tokens "
        f"({result['device']}; memory: {result['memory_source']})",
        ["config", "step s", "predicted s", "activations MiB", "predicted MiB", "memory error"],
        rows,
        footer=f"activation_memory_ratio (cp=2 / cp=1): {result['activation_memory_ratio']:.3f}"
        f"\n{result['peer']}",
    )
    return 0
