"""Host-memory offload: the bytes the hooks move, the memory model's saving and transfer
time, and the planner turning to offload when nothing else fits."""

from __future__ import annotations

import pytest
import torch

from plait.blocks import StageModule, as_blocks
from plait.cluster import Cluster, Device, Link, NodeGroup
from plait.cost import BlockCost, StageCost, transformer_block_costs
from plait.models import GPT, GPTConfig
from plait.offload import normalize_offload, offloaded_blocks
from plait.plan import SearchSpace, gpt_spec, search
from plait.plan.explain import explain
from plait.sim import SimPlan, build_schedule, simulate
from plait.train.offload import apply_activation_offload, offload_optimizer_state

FREE = Link(latency_s=0.0, bandwidth_Bps=1e30)
H, HEADS, S, B, VOCAB = 32, 4, 16, 2, 50


def _cluster(*, memory: int = 1 << 50, host: float = 2.5e10) -> Cluster:
    device = Device(name="u", peak_flops={"fp32": 1.0, "bf16": 1e14}, memory_bytes=memory,
                    host_bandwidth_Bps=host)  # fmt: skip
    return Cluster(
        name="u", groups=(NodeGroup(device=device, devices_per_node=1, intra_node=FREE),),
        inter_node=FREE,
    )  # fmt: skip


def _saved_outside_params(module: torch.nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes `module`'s forward saves for backward, parameters excluded (the reference)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if t.untyped_storage().data_ptr() not in params:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(x)
    return total, y


def _distinct_saved(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages `module`'s forward saves, parameters excluded: what
    the device frees when they all move (a storage saved twice is moved twice)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(storages.values())


def test_offload_spec_is_parsed_and_bounded() -> None:
    assert normalize_offload(" 2, 1,2 ") == "1,2" and normalize_offload("ALL") == "all"
    assert offloaded_blocks("all", 3) == {0, 1, 2} and offloaded_blocks("none", 3) == set()
    for bad in ("", "1,x", "-1", "some"):
        with pytest.raises(ValueError, match="offload_activations"):
            normalize_offload(bad)
    with pytest.raises(ValueError, match="names block 4, but the model has 4 blocks"):
        offloaded_blocks("1,4", 4)


def test_moved_bytes_equal_the_saved_bytes_and_the_model_predicts_them() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=S, num_layers=2, hidden=H, num_heads=HEADS))
    blocks = as_blocks(model)
    x = torch.randint(0, VOCAB, (B, S))
    # reference: what the two transformer layers save, counted in a plain forward
    h0 = blocks[0](x)
    first, h1 = _saved_outside_params(blocks[1], h0)
    second, _ = _saved_outside_params(blocks[2], h1)
    distinct = _distinct_saved(blocks[1], h0) + _distinct_saved(blocks[2], h1)
    stage = StageModule(list(blocks), first_block=0)
    counter = apply_activation_offload(stage, "1,2", num_blocks=len(blocks))
    logits = stage(x)
    assert counter.bytes == first + second
    GPT.loss(logits, x).backward()  # the saved tensors come back for the backward
    assert all(p.grad is not None for p in stage.parameters())
    # the memory model: the simulated activation peak of m micro-batches in flight (GPipe,
    # one stage) drops by m × what the offloaded blocks save
    costs = transformer_block_costs(num_layers=2, hidden=H, num_heads=HEADS, seq_len=S,
                                    vocab_size=VOCAB, micro_batch_size=B, dtype="fp32")  # fmt: skip
    m, peaks = 3, {}
    for spec in ("none", "1,2"):
        plan = SimPlan(schedule="gpipe", microbatches=m, micro_batch_size=B, dtype="fp32",
                       offload_activations=spec)  # fmt: skip
        result = simulate(build_schedule(plan), [StageCost(tuple(costs))], _cluster(), plan)
        peaks[spec] = result.ranks[0].memory.activations
    predicted = (peaks["none"] - peaks["1,2"]) / m
    assert abs(predicted - distinct) <= 0.15 * distinct, (predicted, distinct)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures CUDA device memory")
def test_device_memory_saving_on_cuda_is_the_predicted_one() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=S, num_layers=2, hidden=H, num_heads=HEADS)
    x = torch.randint(0, VOCAB, (B, S), device="cuda")
    held = {}
    for spec in ("none", "1,2"):
        model = GPT(cfg).cuda()
        stage = StageModule(list(as_blocks(model)), first_block=0)
        apply_activation_offload(stage, spec, num_blocks=4)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        logits = stage(x)
        torch.cuda.synchronize()
        held[spec] = torch.cuda.memory_allocated() - before
        del logits
    costs = transformer_block_costs(num_layers=2, hidden=H, num_heads=HEADS, seq_len=S,
                                    vocab_size=VOCAB, micro_batch_size=B, dtype="fp32")  # fmt: skip
    predicted = costs[1].saved_bytes + costs[2].saved_bytes
    measured = held["none"] - held["1,2"]
    assert abs(predicted - measured) <= 0.15 * measured, (predicted, measured)


def test_simulator_charges_host_transfers_and_the_swapped_optimizer() -> None:
    """Closed forms on unit costs: each offloaded byte crosses the host link once in forward
    and once in backward; swapped optimizer state twice per step."""
    block = BlockCost(name="b", forward_flops=1, backward_input_flops=1, backward_weight_flops=1,
                      saved_bytes=8.0, num_params=4)  # fmt: skip
    host, m = 4.0, 2
    runs = {}
    for acts, opt in (("none", False), ("all", False), ("none", True)):
        plan = SimPlan(schedule="gpipe", microbatches=m, dtype="fp32", optimizer="sgd",
                       offload_activations=acts, offload_optimizer=opt)  # fmt: skip
        stages = [StageCost((block, block))]
        runs[acts, opt] = simulate(build_schedule(plan), stages, _cluster(host=host), plan)
    base, acts, opt = runs["none", False], runs["all", False], runs["none", True]
    # two blocks of 8 bytes, out in F and in for B of each micro-batch
    assert acts.step_time_s - base.step_time_s == pytest.approx(2 * m * 16 / host)
    mem, off = base.ranks[0].memory, acts.ranks[0].memory
    assert off.activations == 0 and off.transient == pytest.approx(mem.transient + 8)
    # SGD's fp32 state: 4 bytes a parameter; in and out: 2 × 32 / host
    assert opt.step_time_s - base.step_time_s == pytest.approx(2 * 32 / host)
    working = mem.activations + mem.transient  # m × 16 = 32 bytes: the state hides in it
    assert opt.ranks[0].memory.optimizer == max(0.0, mem.optimizer - working)


def test_planner_offloads_when_nothing_fits_and_says_why() -> None:
    model = gpt_spec(num_layers=2, hidden=256, num_heads=4, seq_len=128, vocab_size=1000)
    space = SearchSpace(micro_batch_sizes=(1,), recompute=("full",))
    need = {}
    for opt in (False, True):
        plan = SimPlan(micro_batch_size=1, seq_len=128, recompute="full", offload_optimizer=opt,
                       offload_activations="all" if opt else "none")  # fmt: skip
        stages = [StageCost(tuple(model.blocks_for(plan)))]
        result = simulate(build_schedule(plan), stages, _cluster(), plan)
        need[opt] = result.ranks[0].memory.total
    roomy = search(model, _cluster(memory=int(2 * need[False])), global_batch=1, space=space)
    assert roomy.offload_reason == ""
    assert not roomy.best.plan.offload_optimizer
    capacity = int((need[False] + need[True]) / 2 / 0.95)  # fits only with offload
    tight = search(model, _cluster(memory=capacity), global_batch=1, space=space)
    best = tight.best.plan
    assert best.offload_optimizer or best.offload_activations != "none"
    assert "no plan fits in device memory without offload" in explain(tight)


def test_swapped_optimizer_steps_as_the_plain_one_and_keeps_state_on_the_host() -> None:
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    opts = [torch.optim.Adam([p], lr=0.1) for p in params]
    offload_optimizer_state(opts[1])
    for step in range(3):
        for p, opt in zip(params, opts, strict=True):
            p.grad = torch.arange(3.0) * (step + 1)
            opt.step()
    torch.testing.assert_close(params[1], params[0], rtol=0, atol=0)
    state = opts[1].state[params[1]]
    assert state["exp_avg"].device.type == "cpu" and state["exp_avg_sq"].device.type == "cpu"
