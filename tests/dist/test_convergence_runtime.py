"""Every method of `plait experiment convergence`, one configuration each, rerun through
`plait train`'s real workers (`plait.train.run`: the launcher, the training loop, the
distributed runtime) and compared with the one-process emulator the experiment's curves
come from: the loss of every update equal at 1e-5 in fp32.

- every schedule kind of the staleness experiment, on the image regime's workload (the
  same `Workload`, samples and seed as the experiment's runs), 2 stages;
- one of the GPT regime (PipeDream, 2 stages);
- DGC on 2 data-parallel workers against the rules of Lin et al. (the emulator of
  `test_compress_dgc`), and WSP (D = 1) on 2 workers against the wave rule (the emulator
  of `test_hetpipe`).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.experiment.stale_train import Workload, gpt_workload, image_workload
from plait.models.gpt import GPT, GPTConfig
from plait.models.vgg_small import SmallVGG
from plait.schedule import build
from plait.train import run
from plait.emulate.versions import Emulator, version_plan

pytestmark = pytest.mark.dist

TOL = {"rtol": 1e-5, "atol": 1e-5}
P, M, MICRO, LR, SEED = 2, 2, 4, 0.01, 0
# Adam's eps well above rounding noise (see test_async_pipeline: a gradient that is zero up to
# rounding would otherwise become a full step that differs with the order of summation)
EPS, VOCAB = 1e-4, 19
KINDS = ("1f1b", "pipedream", "pipedream-vs", "2bw", "spectrain", "xpipe")


def _draw(
    data: tuple[torch.Tensor, torch.Tensor], step: int, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch as `plait.train.run` draws it from a pair of tensors (written
    out here: `size` rows drawn by a generator seeded by (seed, step))."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + step)
    picked = torch.randint(0, len(data[1]), (size,), generator=g)
    return data[0][picked], data[1][picked]


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR, momentum=0.9)
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, eps=EPS)


def _emulated(workload: Workload, kind: str, windows: int, micro: int, opt: str) -> list[float]:
    """The experiment's emulator on the run's samples: the mean loss of each update."""
    data = (workload.inputs, workload.targets)
    torch.manual_seed(SEED)
    model = workload.build()
    emulator = Emulator(model, P, functools.partial(_optimizer, opt), workload.loss)

    def microbatch(x: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = _draw(data, x // M, M * micro)
        j = x % M
        return inputs[j * micro : (j + 1) * micro], targets[j * micro : (j + 1) * micro]

    means: list[float] = []
    emulator.train(
        version_plan(build(kind, P, M), windows),
        microbatch,
        after_update=lambda u, losses: means.append(sum(losses) / len(losses)),
    )
    return means


def _trained(model: Any, data: Any, run_dir: Path, loss: Any = None, **config: Any) -> list[float]:
    """`plait.train.run` on 2 workers; the loss of every update it logged."""
    settings = {
        "nproc": 2,
        "seed": SEED,
        "weight_decay": 0.0,
        "grad_clip": 0.0,
        "run_dir": str(run_dir),
        "eval_batches": 0,
        **config,
    }
    if config.get("optimizer") == "adamw":
        settings["eps"] = EPS
    run(model, data, settings, **({"loss": loss} if loss is not None else {}))
    rows = [json.loads(line) for line in (run_dir / "updates.jsonl").read_text().splitlines()]
    return [r["loss"] for r in sorted(rows, key=lambda r: r["update"])]


def _layout(kind: str) -> dict[str, Any]:
    return {"parallel.pp": P, "parallel.microbatches": M, "parallel.schedule": kind}


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_of_the_image_regime_equals_its_emulation(kind: str, tmp_path: Path) -> None:
    workload = image_workload(width=2, samples=64, seed=SEED)
    per_micro = kind in ("pipedream", "pipedream-vs", "spectrain")
    micro = MICRO if per_micro else MICRO // M  # every kind updates on MICRO samples
    windows = 3 if per_micro else 6
    want = _emulated(workload, kind, windows, micro, "sgd")
    model = functools.partial(SmallVGG, width=2, num_classes=10)
    got = _trained(
        model,
        (workload.inputs, workload.targets),
        tmp_path / kind,
        optimizer="sgd",
        momentum=0.9,
        lr=LR,
        max_steps=windows,
        batch_size=M * micro,
        **_layout(kind),
    )
    assert len(got) == len(want) == 6
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)


def test_the_gpt_regime_equals_its_emulation(tmp_path: Path) -> None:
    from plait.data.corpus import stdlib_corpus

    shape = {"num_layers": 2, "hidden": 16, "num_heads": 2}
    workload = gpt_workload(
        shape=shape, seq_len=16, pool=64, val_sequences=8, samples=64, seed=SEED
    )
    want = _emulated(workload, "pipedream", 3, MICRO, "adamw")
    config = GPTConfig(vocab_size=stdlib_corpus().vocab_size, seq_len=16, **shape)
    got = _trained(
        functools.partial(GPT, config),
        (workload.inputs, workload.targets),
        tmp_path / "gpt",
        loss=GPT.loss,
        optimizer="adamw",
        lr=LR,
        max_steps=3,
        batch_size=M * MICRO,
        **_layout("pipedream"),
    )
    assert len(got) == len(want) == 6
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)


# ------------------------------------------------------------------ DGC and WSP
def _tiny_gpt() -> Any:
    return functools.partial(
        GPT, GPTConfig(vocab_size=VOCAB, seq_len=8, num_layers=2, hidden=16, num_heads=4)
    )


def _tokens(count: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (count, 9), generator=torch.Generator().manual_seed(3))
    return ids[:, :-1], ids[:, 1:]


def test_dgc_equals_the_rules_of_lin_et_al(tmp_path: Path) -> None:
    """2 data-parallel workers, `dgc:0.05:warmup=2`: each update's loss (the batch's mean
    over both replicas) against the emulator of test_compress_dgc on the same batches."""
    from .test_compress_dgc import _Stage

    data, steps, batch = _tokens(64), 4, 8
    torch.manual_seed(SEED)
    ref = _tiny_gpt()()
    stage = _Stage(list(ref.parameters()), 2)
    want = []
    for step in range(steps):
        x, y = _draw(data, step, batch)
        grads = []
        for r in range(2):
            ref.zero_grad()
            GPT.loss(ref(x[4 * r : 4 * r + 4]), y[4 * r : 4 * r + 4]).backward()
            grads.append([p.grad.detach().clone() for p in ref.parameters()])  # type: ignore[union-attr]
        with torch.no_grad():
            want.append(float(GPT.loss(ref(x), y)))
            for p, u in zip(ref.parameters(), stage.step(grads, step, None), strict=True):
                p -= 0.1 * u
    got = _trained(
        _tiny_gpt(),
        data,
        tmp_path / "dgc",
        loss=GPT.loss,
        optimizer="sgd",
        momentum=0.9,
        lr=0.1,
        max_steps=steps,
        batch_size=batch,
        **{
            "parallel.dp": 2,
            "parallel.pp": 1,
            "parallel.microbatches": 1,
            "parallel.compress": "dgc:0.05:warmup=2",
        },
    )
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)


def test_wsp_equals_the_wave_rule(tmp_path: Path) -> None:
    """2 workers, one rank each, WSP with D = 1 (stale-synchronous): worker 0's own loss
    per step (what rank 0 logs) against the wave rule on one process: each worker steps
    its own SGD on its half of the batch and adds the other's update one wave late."""
    data, steps, batch = _tokens(64), 5, 8
    torch.manual_seed(SEED)
    w0 = _tiny_gpt()()
    models = [copy.deepcopy(w0) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    deltas: list[list[list[torch.Tensor]]] = [[], []]  # [worker][wave][param]
    want = []
    for step in range(steps):
        x, y = _draw(data, step, batch)
        for i, (model, opt) in enumerate(zip(models, opts, strict=True)):
            if step >= 2:  # before wave c: the other's update of wave c - 2 (D = 1)
                with torch.no_grad():
                    for p, u in zip(model.parameters(), deltas[1 - i][step - 2], strict=True):
                        p.add_(u)
            start = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            loss = GPT.loss(model(x[4 * i : 4 * i + 4]), y[4 * i : 4 * i + 4])
            loss.backward()
            opt.step()
            deltas[i].append(
                [p.detach() - s for p, s in zip(model.parameters(), start, strict=True)]
            )
            if i == 0:
                want.append(float(loss))
    got = _trained(
        _tiny_gpt(),
        data,
        tmp_path / "wsp",
        loss=GPT.loss,
        optimizer="sgd",
        momentum=0.9,
        lr=0.1,
        max_steps=steps,
        batch_size=batch,
        **{
            "parallel.dp": 2,
            "parallel.pp": 1,
            "parallel.microbatches": 1,
            "parallel.wsp_staleness": 1,
        },
    )
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)
