"""plait's single-process emulator (what `plait experiment staleness` trains with) equals
the independent emulator of the papers' rules that the distributed tests hold the
runtime to: same per-micro-batch losses, same final weights, every asynchronous kind."""

from __future__ import annotations

import pytest
import torch
from tests.dist.test_async_pipeline import _microbatch, _model, _optimizer, emulate

from plait.emulate.versions import Emulator, version_plan
from plait.schedule import build, kind_names

TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize("kind", kind_names(synchronous=False))
@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 1), (2, 4), (3, 2), (4, 3)])
@pytest.mark.parametrize(("model_name", "opt_name"), [("skip", "sgd"), ("gpt", "adamw")])
def test_plait_emulator_matches_the_papers_rules(
    kind: str, p: int, m: int, model_name: str, opt_name: str
) -> None:
    torch.use_deterministic_algorithms(True)
    windows = 3 * p
    want_losses, want_weights = emulate(kind, p, m, model_name, opt_name, windows, 2)
    model, loss_fn = _model(model_name)
    emulator = Emulator(model, p, lambda ps: _optimizer(opt_name, list(ps)), loss_fn)
    plan = version_plan(build(kind, p, m), windows)
    losses = emulator.train(plan, lambda x: _microbatch(model_name, x, 2))
    order = [x for group in plan.groups for x in group]
    assert sorted(order) == list(range(windows * m))
    got = [loss for _, loss in sorted(zip(order, losses, strict=True))]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want_losses), **TOL)
    for s, weights in enumerate(want_weights):
        for q, w in zip(emulator.params[s], weights, strict=True):
            torch.testing.assert_close(q.detach(), w, **TOL)


def test_synchronous_plans_are_one_update_per_window() -> None:
    plan = version_plan(build("1f1b", 3, 4), 2)
    assert plan.groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and plan.lag == 0
    assert {v for v, base in plan.versions.values()} == {0, 1}
    assert all(base is None for _, base in plan.versions.values())
