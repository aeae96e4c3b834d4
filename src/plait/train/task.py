"""What a run trains: the model (built from the seed), the batch of each step, the loss,
evaluation metrics and, for a language model, a text sample.

A `Task` is what `train_worker` needs beyond the layout. `task_from_config` builds the
named ones (`model.name` × `data`); `custom_task` wraps a user's module and dataset
(`plait.train.run`). Batches are pure functions of (seed, step), so every rank computes
the same global batch and a resumed run continues bit for bit. Metrics follow one
convention: `fn(output, target)` returns the number of correct samples of a batch (a
sum), so they add up over batches and ranks; the mean is that sum over the samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.blocks import as_blocks, equal_split, stage_modules
from plait.config import TrainConfig

__all__ = [
    "CustomTask",
    "Task",
    "accuracy",
    "custom_task",
    "gathered_model",
    "task_from_config",
]

Batch = tuple[Any, Any]
MetricFn = Callable[[torch.Tensor, torch.Tensor], float]


def accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    """Samples whose largest logit (last dim) is the target class: a count, not a mean."""
    return float((output.argmax(dim=-1) == target).sum())


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task:
    """Everything a run trains on but the layout.

    `build()` returns a fresh model (called after `torch.manual_seed(seed)`, so every rank
    builds the same weights); `batch(step)` the global (inputs, targets) of a step;
    `validation()` the validation batches, in order (None: no validation split);
    `sample(model)` a text sample of the whole trained model (language models only).
    `num_heads` and `seq_len` describe the model to the planner (1 for non-transformers).
    """

    build: Callable[[], nn.Module]
    batch: Callable[[int], Batch]
    loss: Callable[..., torch.Tensor]
    seed: int = 0
    metrics: dict[str, MetricFn] = dataclasses.field(default_factory=dict)
    validation: Callable[[], Iterable[Batch]] | None = None
    sample: Callable[[nn.Module], str] | None = None
    num_heads: int = 1
    seq_len: int = 1

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return self.build()


def task_from_config(cfg: TrainConfig) -> Task:
    """The task `cfg.model.name` on `cfg.data` (validated together by `TrainConfig`)."""
    if cfg.model.is_language_model:
        return _language_task(cfg)
    return _image_task(cfg)


def _language_task(cfg: TrainConfig) -> Task:
    from plait.train.language import language_data

    m = cfg.model
    found = language_data(cfg)
    data = found.data
    loss: Callable[..., torch.Tensor] = _moe_loss if m.name == "moe-gpt" else _lm_loss
    if m.is_user_model:
        user = _UserModel(m.name, found.vocab_size, m.seq_len)
        build, loss = user.build, user.loss
    else:
        build = _language_model(cfg, found.vocab_size)

    def batch(step: int) -> Batch:
        if cfg.data == "synthetic":
            return data.batch(step, cfg.batch_size)
        return data.batch(step, cfg.batch_size, m.seq_len, seed=cfg.seed)

    def validation() -> Iterator[Batch]:  # the data's held-out tail, by index
        for index in range(cfg.eval_batches):
            yield data.batch(index, cfg.batch_size, m.seq_len, seed=cfg.seed, split="validation")

    sample = None
    if found.characters and cfg.sample_chars > 0 and m.known_blocks:
        sample = _text_sample(cfg, data if cfg.data == "stdlib" else _corpus_codec())
    return Task(build=build, batch=batch, loss=loss, seed=cfg.seed, sample=sample,
                num_heads=m.heads, seq_len=m.seq_len,
                validation=validation if found.has_validation else None)  # fmt: skip


def _corpus_codec() -> Any:
    """The character corpus's encode/decode (a sample of a model trained on characters)."""
    from plait.data import CharCorpus
    from plait.data.corpus import _ALPHABET

    return CharCorpus(torch.empty(0, dtype=torch.long), _ALPHABET)


class _UserModel:
    """A MODULE:FACTORY model (`plait.models.user`): `build` makes it, `loss` is the loss the
    factory gave with the last model built (next-token cross-entropy when none)."""

    def __init__(self, spec: str, vocab_size: int, seq_len: int) -> None:
        self.spec, self.vocab_size, self.seq_len = spec, vocab_size, seq_len
        self.own_loss: Callable[..., torch.Tensor] | None = None

    def build(self) -> nn.Module:
        from plait.models.user import build_user_model

        model, self.own_loss = build_user_model(
            self.spec, vocab_size=self.vocab_size, seq_len=self.seq_len
        )
        return model

    def loss(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        return (self.own_loss or _lm_loss)(output, targets)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; `targets` [batch, seq] are the shifted ids."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="mean")


def _moe_loss(out: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy plus the router losses the MoE layers carried to the head."""
    from plait.models import MoEGPT

    return MoEGPT.loss(out, targets)


def _language_model(cfg: TrainConfig, vocab: int) -> Callable[[], nn.Module]:
    m = cfg.model
    if cfg.init_from is not None:  # the folder's model and weights, whole before any cut
        from plait.models.hf_io import load_pretrained

        path = cfg.init_from
        return lambda: load_pretrained(path)
    if m.name == "gpt":
        from plait.models import GPT

        return lambda: GPT(_gpt_config(cfg, vocab))
    if m.name == "moe-gpt":
        from plait.models import MoEGPT

        return lambda: MoEGPT(_moe_config(cfg, vocab))
    from plait.models import hf

    if m.name == "hf-gpt2":
        config = hf.tiny_gpt2_config(vocab_size=vocab, seq_len=m.seq_len, num_layers=m.layers,
                                     hidden=m.hidden, num_heads=m.heads)  # fmt: skip
        return lambda: hf.gpt2_blocks_model(config)
    kv_heads = m.heads // 2 if m.heads % 2 == 0 else m.heads  # grouped-query attention
    config = hf.tiny_llama_config(
        vocab_size=vocab,
        seq_len=m.seq_len,
        num_layers=m.layers,
        hidden=m.hidden,
        num_heads=m.heads,
        num_kv_heads=kv_heads,
    )
    return lambda: hf.llama_blocks_model(config)


def _gpt_config(cfg: TrainConfig, vocab_size: int) -> Any:
    from plait.models import GPTConfig

    m = cfg.model
    return GPTConfig(vocab_size=vocab_size, seq_len=m.seq_len, num_layers=m.layers,
                     hidden=m.hidden, num_heads=m.heads, ffn_hidden=m.ffn_hidden,
                     dropout=m.dropout)  # fmt: skip


def _moe_config(cfg: TrainConfig, vocab_size: int) -> Any:
    from plait.models import MoEConfig

    m = cfg.model
    return MoEConfig(vocab_size=vocab_size, seq_len=m.seq_len, num_layers=m.layers,
                     hidden=m.hidden, num_heads=m.heads, ffn_hidden=m.ffn_hidden,
                     dropout=m.dropout, num_experts=m.experts, top_k=m.top_k,
                     capacity_factor=m.capacity_factor, moe_every=m.moe_every,
                     shared_expert=m.shared_expert, aux_loss_coef=m.aux_loss_coef,
                     z_loss_coef=m.z_loss_coef)  # fmt: skip


def _text_sample(cfg: TrainConfig, corpus: Any) -> Callable[[nn.Module], str]:
    def sample(model: nn.Module) -> str:
        from plait.models.gpt import generate

        device = next(model.parameters()).device
        g = torch.Generator(device=device).manual_seed(cfg.seed)
        if cfg.model.name == "moe-gpt":  # `generate` wants logits, not (logits, aux)
            from plait.models.moe import LogitsOnly

            model = LogitsOnly(model)  # type: ignore[arg-type]
        if not hasattr(model, "cfg"):  # `generate` reads the window from a GPT's config
            model.cfg = dataclasses.make_dataclass("Window", [("seq_len", int)])(cfg.model.seq_len)
        prompt = corpus.encode("def ").to(device)
        ids = generate(model, prompt, cfg.sample_chars, generator=g)  # type: ignore[arg-type]
        return str(corpus.decode(ids.cpu()))

    return sample


def _image_task(cfg: TrainConfig) -> Task:
    from plait.data import ImageClassification, SyntheticClassification, cifar100, digits
    from plait.models import ResNet18

    kind, _, path = cfg.data.partition(":")
    data: ImageClassification
    if kind == "digits":
        data = digits()
    elif kind == "cifar100":
        data = cifar100(path)
    else:  # a learnable rule on random 3×16×16 images; the samples after 1024 validate
        synthetic = SyntheticClassification((3, 16, 16), num_classes=10, size=1280, seed=cfg.seed)
        images, labels = synthetic.sample(torch.arange(1280))
        data = ImageClassification(images[:1024], labels[:1024], images[1024:], labels[1024:], 10)
    channels, classes = data.image_shape[0], data.num_classes
    width = cfg.model.width
    return Task(
        build=lambda: ResNet18(
            num_classes=classes, width=width, norm="group", in_channels=channels
        ),
        batch=lambda step: data.batch(step, cfg.batch_size, seed=cfg.seed),
        loss=F.cross_entropy,
        seed=cfg.seed,
        metrics={"accuracy": accuracy},
        validation=lambda: data.validation(cfg.batch_size),
    )


@dataclasses.dataclass(frozen=True)
class CustomTask:
    """A user's model and data as the workers receive them (pickled: every part must be
    importable or plain data; see `plait.train.run`)."""

    model: Any
    dataset: Any
    loss: Callable[..., torch.Tensor] = F.cross_entropy
    metrics: dict[str, MetricFn] | None = None
    validation: Any = None

    def task(self, cfg: TrainConfig) -> Task:
        return custom_task(self.model, self.dataset, cfg, loss=self.loss, metrics=self.metrics,
                           validation=self.validation)  # fmt: skip


def custom_task(
    model: nn.Module | Callable[[], nn.Module],
    dataset: Any,
    cfg: TrainConfig,
    *,
    loss: Callable[..., torch.Tensor] = F.cross_entropy,
    metrics: dict[str, MetricFn] | None = None,
    validation: Any = None,
) -> Task:
    """A task of a user's model and data (see `plait.train.run` for what each may be)."""
    build = (lambda: _copy(model)) if isinstance(model, nn.Module) else model
    return Task(
        build=build,
        batch=lambda step: _draw(dataset, step, cfg.batch_size, cfg.seed),
        loss=loss,
        seed=cfg.seed,
        metrics=dict(metrics or {}),
        validation=(lambda: _in_order(validation, cfg.batch_size))
        if validation is not None
        else None,
    )


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def _draw(dataset: Any, step: int, batch_size: int, seed: int) -> Batch:
    """The batch of `step`: `batch_size` samples drawn with a generator seeded by
    (seed, step) from a map-style dataset or an (inputs, targets) pair of tensors."""
    if hasattr(dataset, "batch"):
        return dataset.batch(step, batch_size)
    size = len(dataset[0]) if isinstance(dataset, tuple) else len(dataset)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    picked = torch.randint(0, size, (batch_size,), generator=g)
    if isinstance(dataset, tuple):
        inputs, targets = dataset
        return inputs[picked], targets[picked]
    from torch.utils.data import default_collate

    inputs, targets = default_collate([dataset[i] for i in picked.tolist()])
    return inputs, targets


def _in_order(dataset: Any, batch_size: int) -> Iterator[Batch]:
    if isinstance(dataset, tuple):
        inputs, targets = dataset
        for start in range(0, len(targets), batch_size):
            yield inputs[start : start + batch_size], targets[start : start + batch_size]
        return
    from torch.utils.data import DataLoader

    for inputs, targets in DataLoader(dataset, batch_size=batch_size, shuffle=False):
        yield inputs, targets


def gathered_model(
    engine: Any, task: Task, partition: Any, rank: int, *, device: torch.device | None = None
) -> nn.Module | None:
    """The whole trained model on rank 0, on `device` (default the CPU); None elsewhere:
    every rank's stages (whole tensors of tp- or FSDP-sharded ones) gathered to rank 0 and
    loaded into a model built there. A collective.

    Under expert parallelism each rank of an ep group holds a slice of every expert
    tensor, under the same name: the whole tensor is their slices in ep-rank order, so
    that rank 0 alone can run the model (generate a sample) with every expert."""
    import torch.distributed as dist

    from plait.parallel.experts import expert_param_names

    parts = engine.schedule.parts  # replicas of a part (Chimera) hold the same weights
    states = {parts[s]: _full_state(m) for s, m in engine.stages.items()}
    groups = getattr(engine, "groups", None)  # heterogeneous pipelines cut the model apart:
    if groups is not None and groups.pipeline != 0:  # pipeline 0's stages (rank 0's) count
        states = {}
    expert = getattr(getattr(engine, "meshes", None), "expert", None)
    ep_index = expert.get_local_rank("ep") if expert is not None else 0
    sliced = {parts[s]: expert_param_names(m) for s, m in engine.stages.items()} if expert else {}
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object((ep_index, states, sliced), gathered, dst=0)
    if gathered is None:
        return None
    torch.manual_seed(task.seed)
    with torch.device(device or "cpu"):  # initialised where it runs: the weights follow
        full = task.build()
    blocks = as_blocks(full)
    sizes = partition or equal_split(len(blocks), _num_stages([g[1] for g in gathered]))
    stages = stage_modules(blocks, sizes)
    # each stage's state from one rank of each ep index (data-parallel replicas agree)
    by_stage: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    names: dict[int, set[str]] = {}
    for index, per_rank, experts in gathered:
        for s, state in per_rank.items():
            by_stage.setdefault(s, {}).setdefault(index, state)
            names.setdefault(s, set()).update(experts.get(s, ()))
    for s, held in by_stage.items():
        state = dict(held[0])
        for name in names.get(s, ()):
            state[name] = torch.cat([held[i][name] for i in sorted(held)])
        stages[s].load_state_dict(state)
    return full


def _num_stages(gathered: list[dict[int, Any]]) -> int:
    return 1 + max(s for per_rank in gathered for s in per_rank)


def _full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Whole tensors of a (possibly tp- or FSDP-sharded) stage; a collective."""
    state = {}
    for name, t in module.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        state[name.replace("_checkpoint_wrapped_module.", "")] = full.detach().cpu()
    return state
