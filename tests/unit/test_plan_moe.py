"""The planner searches expert parallelism: ep > 1 when the experts do not fit at ep=1,
ep = 1 when they fit and the link makes the token all-to-all dear; plan files carry ep and
`plait simulate --plan` honours it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from plait.cli.main import main
from plait.cluster import Cluster, Device, Link, NodeGroup
from plait.config.sections import flat_plan_file
from plait.cost import MoEShape
from plait.plan import SearchSpace, candidates, describe, moe_spec, search
from plait.plan.explain import explain

H, HEADS, SEQ, VOCAB, E, K = 1024, 8, 512, 1000, 4, 2
MODEL = moe_spec(num_layers=1, hidden=H, num_heads=HEADS, seq_len=SEQ, vocab_size=VOCAB,
                 moe=MoEShape(num_experts=E, top_k=K, moe_every=1))  # fmt: skip
SPACE = SearchSpace(micro_batch_sizes=(1,), recompute=("none",), zero_stages=(0,))
GLOBAL_BATCH = 64

# by hand: one MoE layer between the embedding and the head (bf16 + Adam: 16 bytes each)
F = 4 * H
EXPERT_PARAMS = E * (2 * H * F + F + H)
TOTAL_PARAMS = (
    VOCAB * H + SEQ * H  # token and position embeddings
    + 4 * H * H + 8 * H + H * E + EXPERT_PARAMS  # attention, norms, router, experts
    + VOCAB * H + 2 * H  # head and its norm
)  # fmt: skip


def _cluster(*, memory_bytes: int, link: Link) -> Cluster:
    device = Device(name="toy", peak_flops={"bf16": 100e12}, efficiency=0.5,
                    memory_bytes=memory_bytes, memory_bandwidth_Bps=2e12)  # fmt: skip
    group = NodeGroup(device=device, devices_per_node=2, intra_node=link, num_nodes=1)
    return Cluster(name="toy", groups=(group,), inter_node=link)


def test_ep_is_searched_over_divisors_of_dp_times_tp_and_experts() -> None:
    space = dataclasses.replace(SPACE, sequence_parallel=(False, True))
    plans = list(candidates(MODEL, space, num_devices=2, devices_per_node=2, global_batch=8))
    assert {(p.dp, p.ep, p.tp, p.pp) for p in plans} == {
        (2, 1, 1, 1), (2, 2, 1, 1), (1, 1, 1, 2), (1, 1, 2, 1), (1, 2, 2, 1)
    }  # fmt: skip
    assert not any(p.sequence_parallel for p in plans)  # MoE layers take whole sequences


def test_planner_spreads_experts_that_do_not_fit_at_ep1() -> None:
    """The cap leaves room for all the state but a quarter of the experts': ep=1 (and a
    pipeline split, whose first stage holds the whole MoE layer) cannot fit, ep=2 can."""
    margin = 0.05  # the search's default memory margin
    cap = int(16 * (TOTAL_PARAMS - EXPERT_PARAMS / 4) / (1 - margin))
    cluster = _cluster(memory_bytes=cap, link=Link(latency_s=5e-6, bandwidth_Bps=100e9))
    found = search(MODEL, cluster, global_batch=GLOBAL_BATCH, space=SPACE)
    assert found.best.plan.ep == 2, describe(found.best.plan)
    assert all(r.plan.ep == 2 for r in found.ranked)
    assert any(r.plan.ep == 1 and r.plan.dp == 2 for r in found.rejected)
    text = explain(found)
    assert "spreads the experts over ep=2" in text and "does not fit" in text


def test_planner_keeps_experts_whole_when_they_fit_and_the_link_is_slow() -> None:
    """Plenty of memory, a slow link: per step ep=2 would move 2·m·T·k·h·2 bytes of tokens
    (m = 32 micro-batches) to save one all-reduce of E·2hf·2 bytes of expert gradients,
    and m·T·k > E·f here."""
    assert (GLOBAL_BATCH // 2) * SEQ * K > E * F
    cluster = _cluster(memory_bytes=80 * 2**30, link=Link(latency_s=1e-4, bandwidth_Bps=1e9))
    found = search(MODEL, cluster, global_batch=GLOBAL_BATCH, space=SPACE)
    assert found.best.plan.ep == 1, describe(found.best.plan)
    spread = [r for r in found.ranked if r.plan.ep == 2]
    assert spread, "ep=2 fits, so it must have been simulated and ranked"
    assert min(r.step_time_s for r in spread) > found.best.step_time_s
    assert "keeps every expert on every rank (ep=1)" in explain(found)


def test_plan_files_carry_ep_and_simulate_honours_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    moe = ["--model", "moe-gpt", "--experts", "4", "--top-k", "2", "--layers", "2",
           "--hidden", "64", "--heads", "4", "--seq-len", "32"]  # fmt: skip
    assert main(["plan", "--cluster", "dgx-h100", "--batch-size", "16", *moe,
                 "--out", str(out), "--json"]) == 0  # fmt: skip
    capsys.readouterr()
    data = json.loads(out.read_text())
    assert data["model"]["name"] == "moe-gpt" and data["model"]["experts"] == 4
    assert "ep" in data["layout"]
    data = flat_plan_file(data)
    assert main(["simulate", "--plan", str(out), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["plan"]["ep"] == data["ep"]
    assert again["step_time_s"] == pytest.approx(data["predicted"]["step_time_s"], rel=1e-9)
    # a layout with ep=2, by hand
    data.update(ep=2, dp=2, tp=1, pp=1, chunks=1, schedule="1f1b")
    data["microbatches"] = data["global_batch"] // (2 * data["micro_batch_size"])
    data.pop("partition")
    out.write_text(json.dumps(data))
    assert main(["simulate", "--plan", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["plan"]["ep"] == 2 and got["model"]["num_experts"] == 4
    assert got["ep_comm_s"][0] > 0 and 0 < got["all_to_all_share"] < 1
    # the same flags give the same prediction
    flags = ["simulate", "--cluster", "dgx-h100", *moe, "--dp", "2", "--ep", "2",
             "--microbatches", str(data["microbatches"]), "--micro-batch-size",
             str(data["micro_batch_size"]), "--dtype", data["dtype"], "--json"]  # fmt: skip
    assert main(flags) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] == got["step_time_s"]


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--ep", "2", "--dp", "2"], "--model moe-gpt"),
        (["--model", "moe-gpt", "--ep", "3", "--dp", "3"], "--experts 4"),
        (["--model", "moe-gpt", "--ep", "2", "--dp", "3"], "--dp 3"),
        (["--model", "moe-gpt", "--ep", "4", "--dp", "1", "--tp", "2"], "--tp 2"),
        (["--model", "moe-gpt", "--tp", "2", "--sequence-parallel"], "--sequence-parallel"),
        (["--experts", "8"], "--experts applies to --model moe-gpt"),
        (["--model", "moe-gpt", "--top-k", "5"], "--top-k 5"),
        (["--model", "moe-gpt", "--imbalance", "0.5"], "--imbalance 0.5"),
    ],
)
def test_simulate_refuses_bad_expert_flags(
    argv: list[str], names: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--cluster", "dgx-h100", "--layers", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert names in err and len(err.strip().splitlines()) == 1, err
