"""PowerSGD's state as checkpoints keep it: every field the next steps read survives the
bytes, and a state saved for other parameter shapes or another rank is not loaded."""

from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from plait.parallel.compress import load_powersgd_state, powersgd_state_bytes

SHAPES = {0: [[8, 4], [4]], 1: [[6, 6]]}


def _state(rank: int = 2) -> PowerSGDState:
    return PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2)


def test_every_field_survives_the_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    saved = _state()
    saved.iter = 7
    saved.error_dict = {0: torch.randn(36, generator=g), 1: torch.randn(36, generator=g)}
    saved.p_memory_dict = {0: torch.randn(16, generator=g), 1: torch.randn(12, generator=g)}
    saved.q_memory_dict = {0: torch.randn(8, generator=g), 1: torch.randn(12, generator=g)}
    saved.rng.randint(1_000_000_000)  # the generator has moved on from its seed
    saved.total_numel_before_compression = 100
    blob = powersgd_state_bytes(saved, SHAPES)
    expected_draw = saved.rng.randint(1_000_000_000)  # what the restored one must draw next

    loaded = _state()
    assert load_powersgd_state(loaded, blob, SHAPES, torch.device("cpu"))
    assert loaded.iter == 7 and loaded.total_numel_before_compression == 100
    for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
        ours, theirs = getattr(loaded, name), getattr(saved, name)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[i], theirs[i]) for i in ours), name
    assert loaded.rng.randint(1_000_000_000) == expected_draw


def test_other_shapes_or_rank_leave_the_state_fresh() -> None:
    saved = _state()
    saved.iter = 3
    blob = powersgd_state_bytes(saved, SHAPES)
    for shapes, rank in (({0: [[4, 8], [4]], 1: [[6, 6]]}, 2), (SHAPES, 4)):
        fresh = _state(rank)
        assert not load_powersgd_state(fresh, blob, shapes, torch.device("cpu"))
        assert fresh.iter == 0 and not fresh.error_dict
