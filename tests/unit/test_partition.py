"""The partitioner is optimal: checked against brute force over every contiguous split."""

from __future__ import annotations

import importlib
import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.cluster import Device
from plait.cost import BlockCost
from plait.plan import Partition, balanced, partition, partition_blocks


def brute_force(
    times: list[float],
    k: int,
    speeds: list[float],
    static: list[float],
    act: list[float],
    inflight: list[int],
    caps: list[float],
) -> float:
    """The best bottleneck over all contiguous splits that fit, or inf."""
    n, best = len(times), math.inf
    for inner in itertools.combinations(range(1, n), k - 1):
        cuts = [0, *inner, n]
        worst = 0.0
        for i, (a, b) in enumerate(itertools.pairwise(cuts)):
            if sum(static[a:b]) + inflight[i] * sum(act[a:b]) > caps[i] * (1 + 1e-12):
                worst = math.inf
                break
            worst = max(worst, sum(times[a:b]) / speeds[i])
        best = min(best, worst)
    return best


def check(part: Partition, times: list[float], k: int, speeds: list[float]) -> None:
    assert part.boundaries[0] == 0 and part.boundaries[-1] == len(times)
    assert len(part.stage_times) == k and all(s >= 1 for s in part.sizes)
    for i, (a, b) in enumerate(itertools.pairwise(part.boundaries)):
        assert part.stage_times[i] == pytest.approx(sum(times[a:b]) / speeds[i])


@settings(max_examples=150, deadline=None)
@given(
    times=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=9),
    data=st.data(),
)
def test_optimal_against_brute_force(times: list[float], data: st.DataObject) -> None:
    n = len(times)
    k = data.draw(st.integers(1, n))
    speeds = data.draw(st.lists(st.floats(0.25, 4.0), min_size=k, max_size=k))
    static = data.draw(st.lists(st.floats(0.0, 5.0), min_size=n, max_size=n))
    act = data.draw(st.lists(st.floats(0.0, 2.0), min_size=n, max_size=n))
    inflight = [k - i for i in range(k)]
    caps = data.draw(st.lists(st.floats(1.0, 30.0), min_size=k, max_size=k))
    expected = brute_force(times, k, speeds, static, act, inflight, caps)
    if math.isinf(expected):
        with pytest.raises(ValueError, match="fits the memory caps"):
            partition(
                times, k, speeds=speeds, static_bytes=static, activation_bytes=act, memory_caps=caps
            )
        return
    part = partition(
        times, k, speeds=speeds, static_bytes=static, activation_bytes=act, memory_caps=caps
    )
    check(part, times, k, speeds)
    assert part.bottleneck_s == pytest.approx(expected, rel=1e-9, abs=1e-12)
    for i, memory in enumerate(part.stage_memory):
        assert memory <= caps[i] * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_equal_speeds_random_cases(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(2, 12)
    k = rng.randint(1, min(n, 6))
    times = [rng.choice([1.0, 2.0, 3.0, rng.random()]) for _ in range(n)]
    part = partition(times, k)
    ones = [1.0] * k
    expected = brute_force(times, k, ones, [0.0] * n, [0.0] * n, [1] * k, [math.inf] * k)
    check(part, times, k, ones)
    assert part.bottleneck_s == pytest.approx(expected)


def test_balances_a_uniform_model_and_reports_imbalance() -> None:
    part = partition([1.0] * 12, 4)
    assert part.sizes == (3, 3, 3, 3) and part.imbalance == pytest.approx(1.0)
    skewed = partition([1.0] * 10, 4)
    assert skewed.bottleneck_s == 3.0 and skewed.imbalance == pytest.approx(3.0 / 2.5)
    assert skewed.split(list("abcdefghij"))[0][0] == "a"


def test_faster_device_gets_more_blocks() -> None:
    part = partition([1.0] * 9, 2, speeds=[2.0, 1.0])
    assert part.sizes == (6, 3) and part.bottleneck_s == pytest.approx(3.0)


def test_memory_caps_move_blocks() -> None:
    # without caps the split is (2, 2); stage 0 holds 2 micro-batches of activations
    part = partition([1.0] * 4, 2, activation_bytes=[1.0] * 4, memory_caps=[2.0, 10.0])
    assert part.sizes == (1, 3)
    assert part.stage_memory == (2.0, 3.0)


def test_infeasible_cases_say_why() -> None:
    with pytest.raises(ValueError, match="num_stages=5 but only 3 blocks"):
        partition([1.0] * 3, 5)
    with pytest.raises(ValueError, match=r"3 bytes on stage 1 .* 1 bytes over"):
        partition([1.0] * 4, 2, static_bytes=[3.0] * 4, memory_caps=[100.0, 2.0], inflight=[1, 1])
    with pytest.raises(ValueError, match="give one per stage"):
        partition([1.0] * 4, 2, speeds=[1.0])
    with pytest.raises(ValueError, match="must all be > 0"):
        partition([1.0] * 4, 2, speeds=[1.0, 0.0])


def test_partition_blocks_uses_devices_and_memory() -> None:
    big = Device(name="big", peak_flops={"bf16": 2e12}, memory_bytes=10**12)
    small = Device(name="small", peak_flops={"bf16": 1e12}, memory_bytes=10**12)
    block = BlockCost(
        name="b",
        forward_flops=1e12,
        backward_input_flops=1e12,
        backward_weight_flops=1e12,
        saved_bytes=1e9,
        num_params=10**6,
    )
    part = partition_blocks([block] * 9, [big, small])
    assert part.sizes == (6, 3) and part.bottleneck_s == pytest.approx(9.0)
    # 16 bytes per parameter and 2 (1F1B) in-flight micro-batches on the first stage
    assert part.stage_memory[0] == pytest.approx(6 * (16e6 + 2 * 1e9))
    tight = Device(name="tight", peak_flops={"bf16": 1e12}, memory_bytes=3 * 10**9)
    with pytest.raises(ValueError, match=r"on stage 1 \(blocks 1\.\.3\).*bytes over"):
        partition_blocks([block] * 4, [tight, tight])


def test_large_partition_is_quick() -> None:
    rng = random.Random(0)
    times = [rng.random() for _ in range(300)]
    part = partition(times, 64)
    assert part.imbalance < 1.5


@pytest.mark.parametrize("seed", range(64))
def test_inlined_search_cuts_as_the_generic_one(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`partition`'s inlined minimax gives the generic `minimax`'s cuts (ties included) on
    uneven times, speeds, memory and caps, and the same refusals; past 40 blocks, its rows
    of many more blocks than stages are priced over arrays, and from seed 52 memory binds
    (a stage holds a few blocks: the rows look only that far back; some blocks weigh 0)."""
    part = importlib.import_module("plait.plan.partition")  # plait.plan.partition is a function
    rng = random.Random(seed)
    n = rng.randint(1, 40) if seed < 40 else rng.randint(41, 130)
    tight = seed >= 52
    k = rng.randint(2, 12) if tight else rng.randint(1, n)
    times = [rng.choice([1.0, 2.0, rng.random() * 3]) for _ in range(n)]  # ties on purpose
    static = [rng.random() * 10 for _ in range(n)]
    caps = [rng.uniform(20, 400) for _ in range(k)]
    if tight:  # blocks of 4 to 10 bytes (some of 0 from seed 60), caps near an even cut's
        light = 0.0 if seed >= 60 else 4.0
        static = [rng.choice([light, rng.uniform(4, 10)]) for _ in range(n)]
        caps = [rng.uniform(0.9, 2.0) * 8 * n / k for _ in range(k)]
    kwargs = {
        "speeds": [rng.choice([1.0, 0.5, 2.0]) for _ in range(k)],
        "static_bytes": static,
        "activation_bytes": [rng.random() * 5 for _ in range(n)],
        "inflight": [rng.randint(1, 3 if tight else k) for _ in range(k)],
        "memory_caps": caps,
    }

    def cut() -> object:
        try:
            return part.partition(times, k, **kwargs)
        except part.MemoryShortfall as err:
            return str(err)

    fast = cut()
    monkeypatch.setattr(part, "REFERENCE", True)
    assert cut() == fast


@pytest.mark.parametrize("seed", range(30))
def test_balanced_sizes_feasibility_is_packings(seed: int) -> None:
    """The bisection asks `_greedy_stages` whether a bottleneck packs into k stages, where
    it asked `_pack` for the sizes: the same answer at every limit (ties, zero-work
    blocks and fewer blocks than stages included), so the same cut."""
    rng = random.Random(seed)
    n = rng.randint(1, 60)
    work = [rng.choice([0.0, 1.0, 2.0, rng.random() * 3]) for _ in range(n)]
    prefix = [0.0, *itertools.accumulate(work)]
    for k in {1, rng.randint(1, n), n, n + 1}:
        for limit in (*work, *(rng.random() * prefix[-1] for _ in range(20)), prefix[-1]):
            assert (balanced._greedy_stages(prefix, k, limit) <= k) == (
                balanced._pack(prefix, k, limit) is not None
            )
