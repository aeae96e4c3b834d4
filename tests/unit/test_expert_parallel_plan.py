"""Expert parallelism's pieces that need no process group: the regrouping permutation,
written out by hand, and the checks of its inputs."""

from __future__ import annotations

import pytest
import torch

from plait.parallel.experts import _expert_major, check_expert_parallel, expert_grad_scale


def test_received_rows_are_regrouped_by_local_expert_then_source_rank() -> None:
    # rows by (source, local expert): (0,0): 0 | (0,1): 1 2 | (1,0): 3 4 | (1,1): 5
    recv = torch.tensor([[1, 2], [2, 1]])
    assert _expert_major(recv, 6).tolist() == [0, 3, 4, 1, 2, 5]
    # an expert that receives nothing from a rank, and three ranks with one local expert
    assert _expert_major(torch.tensor([[0, 2], [1, 0]]), 3).tolist() == [2, 0, 1]
    assert _expert_major(torch.tensor([[2], [0], [1]]), 3).tolist() == [0, 1, 2]


def test_expert_counts_that_do_not_split_are_refused() -> None:
    check_expert_parallel(8, 4)
    with pytest.raises(ValueError, match=r"num_experts=6 cannot be split over ep=4 .*1, 2, 3, 6"):
        check_expert_parallel(6, 4)
    with pytest.raises(ValueError, match="ep=0"):
        check_expert_parallel(4, 0)
    assert expert_grad_scale(4) == 0.25
    with pytest.raises(ValueError, match="ep=0"):
        expert_grad_scale(0)
