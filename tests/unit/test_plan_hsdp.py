"""The planner searches hybrid sharding where a data-parallel group spans nodes: a shard
group per node, replicas across nodes, with ZeRO-2/3 only."""

from __future__ import annotations

from plait.plan import SearchSpace, gpt_spec
from plait.plan.space import candidates, hybrid_axes

MODEL = gpt_spec(num_layers=4, hidden=256, num_heads=8, seq_len=128, vocab_size=1000)


def test_the_shard_group_is_the_data_parallel_ranks_of_one_node() -> None:
    # tp-dp-pp, 8 devices a node: dp=16 → 8 per node; dp=8 × tp=2 → 4 per node
    assert hybrid_axes(16, 1, 1, "tp-dp-pp", 8) == (2, 8)
    assert hybrid_axes(8, 2, 1, "tp-dp-pp", 8) == (2, 4)
    # tp-pp-dp with pp=2: rank = pp + 2·dp, so node 0 holds dp indices 0..3
    assert hybrid_axes(8, 1, 2, "tp-pp-dp", 8) == (2, 4)
    # tp-dp-pp with pp=2: rank = dp + 8·pp, node 0 holds all of a dp group: nothing to split
    assert hybrid_axes(8, 1, 2, "tp-dp-pp", 8) is None
    assert hybrid_axes(4, 1, 1, "tp-dp-pp", 8) is None  # one node
    assert hybrid_axes(16, 8, 1, "tp-dp-pp", 8) is None  # one dp rank a node


def test_hybrid_candidates_span_nodes_with_zero_two_or_three() -> None:
    space = SearchSpace(micro_batch_sizes=(1,), recompute=("none",), sequence_parallel=(False,))
    plans = list(candidates(MODEL, space, num_devices=16, devices_per_node=8, global_batch=32))
    hybrid = [p for p in plans if p.dp_replicate is not None]
    assert hybrid and {p.zero for p in hybrid} == {2, 3}
    assert {(p.dp, p.layout.dp_replicate, p.layout.dp_shard, p.tp) for p in hybrid} == {
        (16, 2, 8, 1),
        (8, 2, 4, 2),
        (4, 2, 2, 4),
    }
    plain = list(
        candidates(MODEL, SearchSpace(micro_batch_sizes=(1,), recompute=("none",),
                                      sequence_parallel=(False,), hybrid=False),
                   num_devices=16, devices_per_node=8, global_batch=32)
    )  # fmt: skip
    assert len(plain) == len(plans) - len(hybrid)
    one_node = candidates(MODEL, space, num_devices=8, devices_per_node=8, global_batch=32)
    assert all(p.dp_replicate is None for p in one_node)
