"""The checks of a training run's settings (`plait.config.train.TrainConfig`): each
setting alone, the layout against the model and the batch, the data, the optimizer,
checkpoints and logging, and the settings that would have no effect. They take the config
as it is being made (its fields set, `__post_init__` running).
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from pathlib import Path
from typing import Any

from plait.config.fields import check_types, positive, warn_unused
from plait.config.model import MODEL_UNUSED, adopt_pretrained
from plait.dataspec import DATA_FORMS, parse_data
from plait.offload import check_offload_blocks
from plait.pretrained import read_pretrained
from plait.schedule.registry import schedule_kind

__all__ = [
    "DATA",
    "DEVICES",
    "IMAGE_DATA",
    "OPTIMIZER_IMPLS",
    "check_train",
    "warn_unused_settings",
]

DATA = DATA_FORMS
#: `--device` values (`plait.device.DEVICE_KINDS`, which checks them against the host)
DEVICES = ("auto", "cpu", "cuda")
#: `--optimizer-impl` values (`plait.train.optim.implementation` chooses for `auto`)
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "loop")
IMAGE_DATA = ("digits", "cifar100", "synthetic")


def check_train(cfg: Any) -> None:
    """Every check of a `TrainConfig` (`cfg`), run as it is made: what its sections cannot
    say alone (the layout against the model, the batch, the data), then each setting."""
    check_types(cfg)
    if cfg.init_from is not None:
        object.__setattr__(cfg, "model", adopt_pretrained(cfg.model, cfg.init_from))
    par = cfg.parallel
    _check_repartition(cfg)
    if cfg.nproc is None:
        object.__setattr__(cfg, "nproc", par.world_size)
    positive(cfg, "nproc", "max_steps", "batch_size", "log_every", "trace_steps")
    if cfg.device not in DEVICES:
        raise ValueError(f"device={cfg.device!r} is unknown: use one of {list(DEVICES)}")
    _check_fault_tolerance(cfg)
    _check_logging(cfg)
    _check_data(cfg)
    if cfg.nproc != par.world_size:
        raise ValueError(
            f"nproc={cfg.nproc} workers but dp × tp × pp = {par.dp} × {par.tp} × {par.pp} = "
            f"{par.world_size}: make them equal"
        )
    blocks = cfg.model.num_blocks
    if cfg.model.known_blocks and par.num_stages > blocks:
        what = (
            f"(embedding, {cfg.model.layers} layers, head): use more layers or fewer stages"
            if cfg.model.is_language_model
            else "(stem, 8 residual blocks, head): use fewer stages"
        )
        raise ValueError(
            f"pp × chunks = {par.num_stages} stages exceed the model's {blocks} blocks {what}"
        )
    if cfg.model.known_blocks:
        check_offload_blocks(par.offload_activations, blocks)
    if cfg.model.known_blocks and par.partition and sum(par.partition) != blocks:
        raise ValueError(f"partition={list(par.partition)} must add up to {blocks} blocks")
    every, wave = cfg.checkpoint_every, par.wsp_wave
    if par.wsp_staleness is not None and every is not None and every % wave:
        raise ValueError(
            f"checkpoint_every={every} is not a multiple of wsp_wave={wave}: a WSP "
            f"checkpoint is saved at a wave's end; use --checkpoint-every "
            f"{every - every % wave or wave}"
        )
    if par.pipelines is not None:
        sizes = [list(p.partition) for p in par.pipelines]
        if cfg.model.known_blocks and sum(sizes[0]) != blocks:
            raise ValueError(f"pipelines: partitions {sizes} must add up to {blocks} blocks")
    if cfg.batch_size % par.step_microbatches:
        raise ValueError(
            f"batch_size={cfg.batch_size} is not divisible by dp × microbatches = "
            f"{par.step_microbatches}: use a multiple"
        )
    if par.ep > 1 and cfg.model.name != "moe-gpt":
        raise ValueError(
            f"ep={par.ep} with model {cfg.model.name!r}: expert parallelism spreads the "
            "experts of a mixture-of-experts model; use --model moe-gpt or ep=1"
        )
    if par.tp > 1 and cfg.model.name == "resnet18":
        raise ValueError(
            f"tp={par.tp} with model {cfg.model.name!r}: its layers have no "
            "tensor-parallel plan in plait yet; use tp=1 (dp and pp work)"
        )
    if par.sequence_parallel and cfg.model.name in ("hf-gpt2", "hf-llama", "moe-gpt"):
        raise ValueError(
            f"sequence_parallel with model {cfg.model.name!r}: its tensor-parallel plan "
            "keeps whole sequences on every rank; drop sequence_parallel"
        )
    kv_heads = cfg.model.heads // 2 if cfg.model.heads % 2 == 0 else cfg.model.heads
    if cfg.init_from is not None:
        kv_heads = read_pretrained(cfg.init_from).kv_heads
    if cfg.model.name == "hf-llama" and kv_heads % par.tp:
        raise ValueError(
            f"tp={par.tp} must divide hf-llama's {kv_heads} key-value heads: use a tp "
            "that divides them"
        )
    if cfg.model.heads % par.tp or cfg.model.hidden % par.tp:
        raise ValueError(
            f"tp={par.tp} must divide heads={cfg.model.heads} and hidden={cfg.model.hidden}"
        )
    if cfg.grad_clip is not None and not cfg.grad_clip >= 0:
        raise ValueError(
            f"grad_clip={cfg.grad_clip} must be positive, or 0 (or None) for no clipping"
        )
    if cfg.grad_clip == 0:  # the flag's and TOML's way to say "none"
        object.__setattr__(cfg, "grad_clip", None)
    _check_optimizer(cfg)
    if cfg.sample_chars < 0:
        raise ValueError(f"sample_chars={cfg.sample_chars} must be 0 or more (0: no sample)")
    _check_paths(cfg)


def _check_repartition(cfg: Any) -> None:
    if cfg.repartition not in ("off", "auto"):
        raise ValueError(f"repartition={cfg.repartition!r} must be 'off' or 'auto'")
    if not cfg.repartition_threshold > 0 or not math.isfinite(cfg.repartition_threshold):
        raise ValueError(
            f"repartition_threshold={cfg.repartition_threshold} must be a positive number "
            "(0.2: the slowest stage 20% slower than the fastest)"
        )
    positive(cfg, "repartition_patience")
    par = cfg.parallel
    if cfg.repartition == "auto" and (
        par.pp == 1 or par.dp > 1 or par.tp > 1 or not schedule_kind(par.schedule).synchronous
    ):
        raise ValueError(
            f"repartition='auto' needs a synchronous pipeline (pp > 1) without data or "
            f"tensor parallelism; got pp={par.pp}, dp={par.dp}, tp={par.tp}, schedule="
            f"{par.schedule!r}: use repartition='off' or such a layout"
        )


def _check_optimizer(cfg: Any) -> None:
    for name in ("lr", "weight_decay", "beta1", "beta2", "eps", "momentum", "min_lr"):
        value = getattr(cfg, name)
        if not math.isfinite(value):
            raise ValueError(f"{name}={value} must be a finite number")
    if not cfg.lr > 0:
        raise ValueError(f"lr={cfg.lr} must be positive")
    if cfg.weight_decay < 0 or cfg.momentum < 0 or not cfg.eps > 0:
        raise ValueError(
            f"weight_decay={cfg.weight_decay}, momentum={cfg.momentum} must be >= 0 and "
            f"eps={cfg.eps} positive"
        )
    if not (0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1):
        raise ValueError(f"beta1={cfg.beta1}, beta2={cfg.beta2} must lie in [0, 1)")
    if cfg.optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer={cfg.optimizer!r} is unknown: use 'adamw' or 'sgd'")
    if cfg.optimizer_impl not in OPTIMIZER_IMPLS:
        raise ValueError(
            f"optimizer_impl={cfg.optimizer_impl!r} is unknown: use one of {list(OPTIMIZER_IMPLS)}"
        )
    if cfg.nesterov and (cfg.optimizer != "sgd" or not cfg.momentum > 0):
        raise ValueError("nesterov=true needs optimizer='sgd' and momentum > 0")
    if cfg.lr_schedule not in ("constant", "cosine", "linear"):
        raise ValueError(
            f"lr_schedule={cfg.lr_schedule!r} is unknown: use constant, cosine or linear"
        )
    if not 0 <= cfg.min_lr <= cfg.lr:
        raise ValueError(f"min_lr={cfg.min_lr} must lie in [0, lr={cfg.lr}]")
    if not isinstance(cfg.warmup_steps, int) or cfg.warmup_steps < 0:
        raise ValueError(f"warmup_steps={cfg.warmup_steps!r} must be 0 or more")
    if cfg.eval_every is not None and (not isinstance(cfg.eval_every, int) or cfg.eval_every < 1):
        raise ValueError(f"eval_every={cfg.eval_every!r} must be a positive integer, or unset")
    if not isinstance(cfg.eval_batches, int) or cfg.eval_batches < 0:
        raise ValueError(f"eval_batches={cfg.eval_batches!r} must be 0 or more")


def _check_data(cfg: Any) -> None:
    """The data exists in kind, and fits the model (tokens for language models, labelled
    images for ResNet); the packages its reading needs are installed."""
    if cfg.model.name == "custom":  # the data came with the model (plait.train.run)
        return
    if cfg.data == "cifar100":
        raise ValueError(
            "data='cifar100' needs the folder of the extracted python release: data='cifar100:PATH'"
        )
    spec = parse_data(cfg.data)
    language = cfg.model.is_language_model
    if not (spec.is_language if language else spec.kind in IMAGE_DATA):
        what = "token sequences" if language else "labelled images"
        fits = [k for k in DATA if k == "synthetic" or (k.split(":")[0] in IMAGE_DATA) != language]
        raise ValueError(
            f"model {cfg.model.name!r} cannot train on data={cfg.data!r}: it needs "
            f"{what}; use data= one of {fits}"
        )
    needs = [("digits", spec.kind == "digits", "sklearn", "data"),
             ("hf-disk", spec.kind == "hf-disk", "datasets", "datasets"),
             ("tokenizer", cfg.tokenizer is not None, "tokenizers", "hf"),
             (cfg.model.name, cfg.model.name.startswith("hf-"), "transformers", "hf"),
             ("wandb", cfg.wandb is not None, "wandb", "wandb")]  # fmt: skip
    for what, needed, package, extra in needs:
        if needed and importlib.util.find_spec(package) is None:
            raise ValueError(
                f"{what} needs the {package} package, which is not installed: "
                f"pip install 'plait[{extra}]'"
            )
    if cfg.tokenizer is not None and not Path(cfg.tokenizer).exists():
        raise ValueError(
            f"tokenizer={cfg.tokenizer!r} does not exist: give a tokenizer.json or a "
            "folder holding one"
        )


def _check_fault_tolerance(cfg: Any) -> None:
    every, keep = cfg.checkpoint_every, cfg.keep
    if every is not None and (not isinstance(every, int) or every < 1):
        raise ValueError(f"checkpoint_every={every!r} must be a positive integer, or unset")
    if keep is not None and (not isinstance(keep, int) or keep < 0):
        raise ValueError(f"keep={keep!r} must be a positive integer, or 0 to keep every one")
    flush = cfg.flush_every
    if flush is not None and (not isinstance(flush, int) or flush < 1):
        raise ValueError(f"flush_every={flush!r} must be a positive integer, or unset")
    _check_flushes(cfg)
    if not isinstance(cfg.max_restarts, int) or cfg.max_restarts < 0:
        raise ValueError(f"max_restarts={cfg.max_restarts!r} must be 0 or more")
    if cfg.max_restarts and cfg.checkpoint_every is None:
        raise ValueError(
            f"max_restarts={cfg.max_restarts} without checkpoint_every: a restarted run "
            "would start again from step 0; set checkpoint_every (--checkpoint-every N)"
        )
    if not cfg.timeout_s > 0:
        raise ValueError(f"timeout_s={cfg.timeout_s} must be positive (seconds)")


def _check_logging(cfg: Any) -> None:
    if cfg.verbosity not in (-1, 0, 1):
        raise ValueError(f"verbosity={cfg.verbosity!r} must be -1 (quiet), 0 or 1 (verbose)")
    if cfg.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(
            f"tensorboard={cfg.tensorboard!r} needs the tensorboard package, which is not "
            "installed: pip install 'plait[tensorboard]', or drop the option"
        )
    if cfg.profile_steps is not None:
        first, sep, last = cfg.profile_steps.partition(":")
        if not (sep and first.isdigit() and last.isdigit() and int(first) < int(last)):
            raise ValueError(
                f"profile_steps={cfg.profile_steps!r} must read A:B with A < B (steps A "
                "to B-1), e.g. '5:7'"
            )
        if int(last) > cfg.max_steps:
            raise ValueError(
                f"profile_steps={cfg.profile_steps!r} ends after max_steps="
                f"{cfg.max_steps}: profile steps below {cfg.max_steps}"
            )


def _check_paths(cfg: Any) -> None:
    """A checkpoint to resume from exists; a TensorBoard folder is not a file."""
    if cfg.resume not in (None, "auto") and not Path(cfg.resume).is_dir():
        raise ValueError(
            f"resume={cfg.resume!r}: no such checkpoint folder; give a checkpoint "
            "(RUN_DIR/checkpoints/step-NNNNNNNN) or 'auto' with run_dir"
        )
    if cfg.tensorboard is not None and Path(cfg.tensorboard).is_file():
        raise ValueError(f"tensorboard={cfg.tensorboard!r} is a file: give a folder")


def _check_flushes(cfg: Any) -> None:
    """An asynchronous stream is saved where it flushes (nothing in flight): saves fall
    on flushes, and the flushes do not depend on whether the run saves."""
    every, flush = cfg.checkpoint_every, cfg.flush_every
    stale = not schedule_kind(cfg.parallel.schedule).synchronous or (
        cfg.plan == "auto" and cfg.allow_staleness
    )
    if not stale or every is None:
        return
    kind = "plan='auto' with allow_staleness" if cfg.plan == "auto" else (
        f"schedule={cfg.parallel.schedule!r}"
    )  # fmt: skip
    if flush is None:
        raise ValueError(
            f"checkpoint_every={every} with {kind}: an asynchronous stream is saved where it "
            f"flushes, so the flushes must not depend on the saves; add flush_every "
            f"(--flush-every {every}, or a divisor of {every}) and give the same to a run "
            "without checkpoints that should train the same"
        )
    if every % flush:
        raise ValueError(
            f"checkpoint_every={every} is not a multiple of flush_every={flush}: an "
            f"asynchronous stream is saved where it flushes; use --checkpoint-every "
            f"{every - every % flush or flush} or a flush_every dividing {every}"
        )


def warn_unused_settings(cfg: Any) -> None:
    """Settings accepted but read by nothing in this run warn, naming what would use them.
    Called where a config is made from the user's input (`load_config`), not on every
    copy: workers rebuilding the launcher's config would repeat each warning."""
    model = cfg.model.name
    warn_unused(cfg.model, MODEL_UNUSED.get(model, ()), f"with model {model!r}")
    samples = (  # see train.task: a sample of the character-level model
        cfg.model.known_blocks
        and cfg.model.is_language_model
        and cfg.data == "stdlib"
        and cfg.tokenizer is None
    )
    for names, idle, why in (
        (("momentum",), cfg.optimizer == "adamw", "with optimizer='adamw' (SGD's)"),
        (("beta1", "beta2", "eps"), cfg.optimizer == "sgd", "with optimizer='sgd' (AdamW's)"),
        (("min_lr",), cfg.lr_schedule == "constant", "with lr_schedule='constant'"),
        (("keep",), cfg.checkpoint_every is None, "without checkpoint_every (no saves)"),
        (
            ("flush_every",),
            cfg.plan != "auto" and schedule_kind(cfg.parallel.schedule).synchronous,
            "with a synchronous schedule (nothing is in flight between steps)",
        ),
        (("eval_every",), cfg.eval_batches == 0, "with eval_batches=0 (no validation)"),
        (("allow_staleness",), cfg.plan != "auto", "unless plan='auto' (the planner's)"),
        (("replan",), cfg.plan != "auto", "unless plan='auto' (nothing is decided)"),
        (("sample_chars",), not samples, "unless a language model trains on data='stdlib'"),
        (
            ("repartition_threshold", "repartition_patience"),
            cfg.repartition == "off",
            "with repartition='off'",
        ),
    ):
        if idle:
            warn_unused(cfg, names, why)
    if cfg.resume == "auto" and cfg.run_dir is None:
        warnings.warn(
            "resume='auto' without run_dir: a new run folder holds no checkpoint to resume; "
            "set run_dir to the run to continue",
            stacklevel=3,
        )
