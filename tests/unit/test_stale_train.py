"""The pieces of the staleness experiment's runs: the CNN of the image regime, each stage's
staleness read off a schedule, the papers' remedies as learning-rate factors, and the
emulated time of each update against the closed form of a flushed pipeline."""

from __future__ import annotations

import pytest
import torch

from plait.blocks import as_blocks
from plait.emulate.versions import version_plan
from plait.experiment.stale_train import _remedy, update_times
from plait.models.vgg_small import SmallVGG
from plait.schedule import build


def test_small_vgg_is_eight_blocks_from_digits_to_logits() -> None:
    model = SmallVGG(width=4, num_classes=10)
    blocks = as_blocks(model)
    assert len(blocks) == 8
    x = torch.randn(3, 1, 8, 8)
    for block in blocks:
        x = block(x)
    assert x.shape == (3, 10)
    with pytest.raises(ValueError, match="image_size=12"):
        SmallVGG(image_size=12)


LAGS = [("pipedream", (3, 2, 1, 0)), ("pipedream-vs", (3, 3, 3, 3)), ("1f1b", (0, 0, 0, 0)),
        ("2bw", (1, 1, 1, 1))]  # fmt: skip


@pytest.mark.parametrize(("kind", "lags"), LAGS)
def test_each_stage_lags_as_its_paper_says(kind: str, lags: tuple[int, ...]) -> None:
    """PipeDream: stage s of p computes on weights p-1-s updates old; vertical sync: p-1
    at every stage; 2BW: one update (W(t+1) = W(t) - lr grad(W(t-1))); 1F1B: none."""
    assert version_plan(build(kind, 4, 4), 6).stage_lags == lags


def test_remedies_scale_the_learning_rate_as_their_papers_do() -> None:
    plan = version_plan(build("pipedream", 4, 4), 6)
    warmup = _remedy("lr-warmup", plan, warmup_updates=4)
    assert warmup is not None
    assert [warmup(0, u) for u in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]  # PipeDream's
    stale = _remedy("staleness-lr", plan, warmup_updates=4)
    assert stale is not None  # Zhang et al. 2016: lr / (1 + staleness)
    assert [stale(s, 0) for s in range(4)] == [1 / 4, 1 / 3, 1 / 2, 1.0]
    assert _remedy("none", plan, warmup_updates=4) is None


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 2), (3, 4)])
def test_a_flushed_pipeline_updates_every_m_plus_p_minus_1_slots(p: int, m: int) -> None:
    """1F1B with a flush: a window takes (m + p - 1)(t_f + t_b); here a stage's forward is
    1/p of the model's on a micro-batch of 1/m of an update's samples, its backward twice."""
    t_f, t_b = 1 / (p * m), 2 / (p * m)
    times = update_times(build("1f1b", p, m), 3, 1 / m)
    window = (m + p - 1) * (t_f + t_b)
    assert times == pytest.approx([window, 2 * window, 3 * window])
