"""What the HetPipe bench runs: the workers, how many are slow and by how much, the model and
the turns; and the cluster file that describes them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CONFIGS", "HetPipeBenchConfig"]

CONFIGS = ("equal_dp", "hetero_sync", "wsp")


@dataclass(frozen=True, kw_only=True)
class HetPipeBenchConfig:
    workers: int = 4
    slow: int = 2  # the last `slow` workers are marked slower
    slowdown: float = 2.0
    staleness: int = 1
    steps: int = 60
    window: int = 5  # steps averaged for the loss that must reach the target
    turn: int = 10  # steps of one configuration before the next one's turn
    target_loss: float | None = None
    target_at: float = 0.5  # the default target: equal dp's loss at this share of its steps
    layers: int = 2
    hidden: int = 64
    heads: int = 2
    seq_len: int = 32
    batch_size: int = 24
    # emulated milliseconds per block and sample on a fast worker (0: real arithmetic)
    block_ms: float = 4.0
    # every configuration's micro-batch size (0: the planner's choice); fixed, so that the
    # configurations differ in their shares, not in how many micro-batches each runs
    micro_batch_size: int = 2
    optimizer: str = "adamw"  # or "sgd" (momentum 0.9)
    lr: float = 3e-3  # AdamW's (see the module docstring); SGD wants about 0.3 here
    # WSP's per-pipeline learning rate: lr × its batch share ("share": a wave's summed
    # updates are one step's worth) or lr ("same": the sum is dp steps' worth)
    wsp_lr: str = "share"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("workers", "steps", "window", "turn", "layers", "hidden", "heads", "seq_len",
                     "batch_size"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if not 0 < self.slow < self.workers:
            raise ValueError(
                f"--slow {self.slow} must mark some but not all of the {self.workers} workers"
            )
        if self.micro_batch_size < 0 or (
            self.micro_batch_size and self.batch_size % self.micro_batch_size
        ):
            raise ValueError(
                f"--micro-batch-size {self.micro_batch_size} must divide "
                f"--batch-size {self.batch_size} (0: the planner's choice)"
            )
        if not self.block_ms >= 0:
            raise ValueError(f"--block-ms {self.block_ms} must be >= 0 (0: real arithmetic)")
        if self.slowdown < 1:
            raise ValueError(f"--slowdown {self.slowdown} must be >= 1 (times slower)")
        if self.window > self.steps:
            raise ValueError(f"--window {self.window} must be at most --steps {self.steps}")
        if not 0 < self.target_at <= 1:
            raise ValueError(f"--target-at {self.target_at} must lie in (0, 1], a share of steps")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"--optimizer {self.optimizer!r} must be adamw or sgd")
        if self.wsp_lr not in ("share", "same"):
            raise ValueError(f"--wsp-lr {self.wsp_lr!r} must be 'share' or 'same'")
        if self.staleness < 0:
            raise ValueError(f"--staleness {self.staleness} must be >= 0 waves")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be a multiple of --heads {self.heads}")
        if self.batch_size % self.workers:
            raise ValueError(
                f"--batch-size {self.batch_size} must be a multiple of --workers {self.workers}"
            )

    @property
    def vocab_size(self) -> int:
        from plait.data.corpus import stdlib_corpus

        return stdlib_corpus(max_chars=1).vocab_size

    def cluster_toml(self) -> str:
        """The cluster file: `workers - slow` plain CPU workers, then the slow ones."""
        device = 'peak_flops = {{ fp32 = 2e10 }}, memory_gib = 4, slowdown = {s}, name = "{n}"'
        link = "intra_node = { latency_s = 2e-5, bandwidth_Bps = 4e9 }"
        out = ['name = "hetpipe-bench"', "inter_node = { latency_s = 2e-5, bandwidth_Bps = 4e9 }"]
        for count, slowdown, name in ((self.workers - self.slow, 1.0, "cpu"),
                                      (self.slow, self.slowdown, "cpu-slow")):  # fmt: skip
            out += ["", "[[nodes]]", "count = 1", f"devices_per_node = {count}", link]
            out += [f"device = {{ {device.format(s=slowdown, n=name)} }}"]
        return "\n".join(out) + "\n"
