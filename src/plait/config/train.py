"""One training run's configuration: the model and plan sections and every other setting
(the steps, the optimizer, the data, checkpoints, logging). Its checks live in
`plait.config.train_checks`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from plait.config.model import ModelConfig
from plait.config.plan import ParallelPlan
from plait.config.train_checks import (
    DATA,
    DEVICES,
    OPTIMIZER_IMPLS,
    check_train,
    warn_unused_settings,
)

__all__ = ["TrainConfig"]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run."""

    model: ModelConfig = field(default_factory=ModelConfig, metadata={"group": "model"})
    parallel: ParallelPlan = field(default_factory=ParallelPlan, metadata={"group": "layout"})
    nproc: int | None = field(
        default=None,
        metadata={
            "group": "layout",
            "help": "local worker processes",
            "default_text": "dp × tp × pp",
        },
    )
    device: str = field(
        default="auto",
        metadata={
            "group": "layout",
            "help": "where workers compute: auto (one GPU each when the host has GPUs, else "
            "CPU workers), cpu, or cuda",
            "choices": DEVICES,
        },
    )
    deterministic: bool = field(
        default=False,
        metadata={
            "group": "numerics",
            "help": "repeatable kernels, bit for bit from run to run "
            "(torch.use_deterministic_algorithms; slower on GPUs)",
        },
    )
    cluster: str | None = field(
        default=None,
        metadata={
            "group": "layout",
            "help": "cluster file or preset: rank r runs as slow as its device r's "
            "slowdown (plait.train.slowdown)",
        },
    )
    max_steps: int = field(default=300, metadata={"group": "optimizer", "help": "optimizer steps"})
    batch_size: int = field(
        default=32, metadata={"group": "data", "help": "samples per step (global batch)"}
    )
    lr: float = field(default=3e-3, metadata={"group": "optimizer", "help": "peak learning rate"})
    weight_decay: float = field(
        default=0.01,
        metadata={
            "group": "optimizer",
            "help": "weight decay (not applied to biases and norm weights)",
        },
    )
    optimizer: str = field(
        default="adamw",
        metadata={"group": "optimizer", "help": "optimizer", "choices": ("adamw", "sgd")},
    )
    beta1: float = field(
        default=0.9, metadata={"group": "optimizer", "help": "AdamW's first-moment decay"}
    )
    beta2: float = field(
        default=0.999, metadata={"group": "optimizer", "help": "AdamW's second-moment decay"}
    )
    eps: float = field(default=1e-8, metadata={"group": "optimizer", "help": "AdamW's epsilon"})
    momentum: float = field(default=0.0, metadata={"group": "optimizer", "help": "SGD's momentum"})
    nesterov: bool = field(
        default=False, metadata={"group": "optimizer", "help": "SGD with Nesterov momentum"}
    )
    optimizer_impl: str = field(
        default="auto",
        metadata={
            "group": "numerics",
            "help": "torch's optimizer kernels: fused, foreach or a loop per parameter; auto: "
            "fused where torch has them (CUDA, CPU), else foreach (CUDA) or a loop (CPU)",
            "choices": OPTIMIZER_IMPLS,
        },
    )
    tf32: bool = field(
        default=False,
        metadata={
            "group": "numerics",
            "help": "fp32 matmuls and convolutions in TF32 on CUDA GPUs",
        },
    )
    compile: bool = field(
        default=False,
        metadata={
            "group": "numerics",
            "help": "torch.compile each block of each stage (plait.train.compile)",
        },
    )
    lr_schedule: str = field(
        default="constant",
        metadata={
            "group": "optimizer",
            "help": "after warm-up: constant, or cosine or linear decay to min_lr",
            "choices": ("constant", "cosine", "linear"),
        },
    )
    warmup_steps: int = field(
        default=0,
        metadata={
            "group": "optimizer",
            "help": "steps of linear learning-rate warm-up from lr/(n+1)",
        },
    )
    min_lr: float = field(
        default=0.0,
        metadata={"group": "optimizer", "help": "learning rate at the last step (cosine, linear)"},
    )
    eval_every: int | None = field(
        default=None,
        metadata={
            "group": "evaluation",
            "help": "validation loss every N steps (always at the end)",
        },
    )
    eval_batches: int = field(
        default=4,
        metadata={
            "group": "evaluation",
            "help": "validation batches (of batch_size) per evaluation during the run (the one "
            "after the last step reads the whole split); 0: none",
        },
    )
    grad_clip: float | None = field(
        default=1.0,
        metadata={
            "group": "optimizer",
            "help": "clip the global gradient norm to this value; 0: no clipping",
        },
    )
    plan: str | None = field(
        default=None,
        metadata={
            "group": "layout",
            "help": "'auto': profile, plan and train; or a plan file from `plait plan --out` "
            "(its model and layout are adopted)",
            "metavar": "auto|FILE",
            "default_text": "auto when no layout is given",
        },
    )
    allow_staleness: bool = field(
        default=False,
        metadata={
            "group": "layout",
            "help": "let --plan auto choose an asynchronous schedule (stale weights)",
        },
    )
    replan: bool = field(
        default=False,
        metadata={
            "group": "layout",
            "help": "with --plan auto: measure and decide again, replacing the decision kept "
            "for these flags on this host (which --dry-run shows and a run reuses)",
        },
    )
    seed: int = field(
        default=0, metadata={"group": "data", "help": "seed of the model and the data order"}
    )
    log_every: int = field(
        default=10,
        metadata={"group": "logging", "help": "flush metrics.jsonl every N steps", "metavar": "N"},
    )
    sample_chars: int = field(
        default=200,
        metadata={"group": "evaluation", "help": "characters of text sampled after training"},
    )
    run_dir: str | None = field(
        default=None,
        metadata={
            "group": "logging",
            "help": "output folder",
            "metavar": "DIR",
            "default_text": "a new runs/<time>",
        },
    )
    checkpoint_every: int | None = field(
        default=None,
        metadata={
            "group": "checkpoints",
            "help": "save a checkpoint every N steps (in the background) under RUN_DIR/checkpoints",
            "metavar": "N",
        },
    )
    checkpoint_start: bool = field(
        default=False,
        metadata={
            "group": "checkpoints",
            "help": "also save a checkpoint of step 0, before the first step (the initial "
            "weights; a run resumed from it trains as one that was never stopped)",
        },
    )
    flush_every: int | None = field(
        default=None,
        metadata={
            "group": "pipeline",
            "help": "asynchronous schedules: finish every micro-batch in flight and start a "
            "new stream every N steps; their checkpoints are saved at these flushes, so a run "
            "with --checkpoint-every (a multiple of N) trains exactly as the same run without",
            "metavar": "N",
        },
    )
    keep: int | None = field(
        default=3,
        metadata={
            "group": "checkpoints",
            "help": "keep the newest K published checkpoints, deleting older ones (never the "
            "newest, nor one being written); 0 or unset (API): keep every one",
            "metavar": "K",
        },
    )
    resume: str | None = field(
        default=None,
        metadata={
            "group": "checkpoints",
            "help": "resume from the newest good checkpoint of --run-dir ('auto') or a "
            "checkpoint folder; any layout loads any checkpoint",
            "metavar": "auto|PATH",
        },
    )
    max_restarts: int = field(
        default=0,
        metadata={
            "group": "checkpoints",
            "help": "restart the workers up to R times after one dies, resuming from the "
            "newest good checkpoint (needs --checkpoint-every)",
            "metavar": "R",
        },
    )
    timeout_s: float = field(
        default=300.0,
        metadata={
            "group": "communication",
            "help": "longest wait for another worker before the run fails naming it",
            "flag": "--timeout",
            "metavar": "SECONDS",
        },
    )
    verbosity: int = field(
        default=0,
        metadata={
            "group": "logging",
            "help": "-1 warnings and the final summary only, 0 progress lines, 1 debug details too",
            "choices": (-1, 0, 1),
        },
    )
    log_all_ranks: bool = field(
        default=False,
        metadata={
            "group": "logging",
            "help": "every worker logs (default: rank 0; others warn only)",
        },
    )
    tensorboard: str | None = field(
        default=None,
        metadata={
            "group": "logging",
            "help": "also write TensorBoard scalars to this folder (extra 'tensorboard')",
        },
    )
    trace_steps: int = field(
        default=2,
        metadata={
            "group": "logging",
            "help": "the last N steps drawn into trace.json and timeline.png",
        },
    )
    profile_steps: str | None = field(
        default=None,
        metadata={
            "group": "logging",
            "help": "A:B records a torch.profiler trace of steps A to B-1 per rank (steps "
            "count from 0, as in metrics.jsonl)",
        },
    )
    data: str = field(
        default="stdlib",
        metadata={
            "group": "data",
            "help": "data: " + "; ".join(f"{k} ({v})" for k, v in DATA.items()),
            "metavar": "KIND[:PATH]",
        },
    )
    tokenizer: str | None = field(
        default=None,
        metadata={
            "group": "data",
            "help": "a tokenizer.json (Hugging Face tokenizers), or a folder holding one, for "
            "text data; the vocabulary comes from it",
            "metavar": "PATH",
            "default_text": "--init-from's tokenizer.json if it has one, else characters",
        },
    )
    init_from: str | None = field(
        default=None,
        metadata={
            "group": "model",
            "help": "start from the weights of a local Hugging Face model folder (config.json "
            "+ safetensors; GPT-2 or Llama family); the model and its shape come from it",
            "metavar": "DIR",
        },
    )
    wandb: str | None = field(
        default=None,
        metadata={
            "group": "logging",
            "help": "also log to Weights & Biases under this project (extra 'wandb'; "
            "WANDB_MODE=offline keeps it local)",
            "metavar": "PROJECT",
        },
    )

    repartition: str = field(
        default="off",
        metadata={
            "group": "pipeline",
            "help": "move blocks between pipeline ranks while training when stage times "
            "drift apart (plait.train.repartition)",
            "choices": ("off", "auto"),
        },
    )
    repartition_threshold: float = field(
        default=0.2,
        metadata={
            "group": "pipeline",
            "help": "re-partition when the slowest stage exceeds the fastest by this",
        },
    )
    repartition_patience: int = field(
        default=3,
        metadata={
            "group": "pipeline",
            "help": "steps in a row over the threshold before re-partitioning",
        },
    )

    def __post_init__(self) -> None:
        check_train(self)

    def _warn_unused(self) -> None:
        """Settings accepted but read by nothing in this run warn, naming what would use them.
        Called where a config is made from the user's input (`load_config`), not on every
        copy: workers rebuilding the launcher's config would repeat each warning."""
        warn_unused_settings(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
