"""The `--compress` setting and what the cost model charges for each method."""

from __future__ import annotations

import math

import pytest

from plait.cluster import Device, Link
from plait.compression import Compression, DGCOptions, parse_compression
from plait.cost import AxisLinks
from plait.cost.compress import compressed_sync_time, wire_bytes

VALID = {
    "none": Compression(),
    "fp16": Compression("fp16"),
    "powersgd:4": Compression("powersgd", 4.0),
    "threshold:0.01": Compression("threshold", 0.01),
    "topk:0.5": Compression("topk", 0.5),
    "sign": Compression("sign"),
    "dgc:0.001": Compression("dgc", 0.001, DGCOptions()),
    "dgc:0.001:global-topk": Compression("dgc", 0.001, DGCOptions(global_topk=True)),
    "dgc:0.01:no-masking:warmup=40": Compression(
        "dgc", 0.01, DGCOptions(masking=False, warmup_steps=40)
    ),
    "dgc:0.5:no-correction:no-clipping:no-warmup:clip=2:dense-vectors": Compression(
        "dgc",
        0.5,
        DGCOptions(correction=False, clipping=False, warmup_steps=0, clip=2.0, dense_vectors=True),
    ),
}


@pytest.mark.parametrize("text, parsed", VALID.items())
def test_valid_settings_parse_and_print_back(text: str, parsed: Compression) -> None:
    assert parse_compression(text) == parsed
    assert parse_compression(str(parsed)) == parsed


@pytest.mark.parametrize(
    "text, says",
    [("gzip", "unknown method"), ("powersgd", "powersgd:RANK"), ("powersgd:0", "RANK"),
     ("powersgd:1.5", "whole number"), ("threshold:-1", "positive"), ("threshold:inf", "positive"),
     ("topk:2", "(0, 1]"), ("topk:x", "must be a number"), ("fp16:3", "takes no parameter"),
     ("dgc", "dgc:RATIO"), ("dgc:0", "(0, 1]"), ("dgc:0.5x", "factor >= 1"),
     ("dgc:x", "a number (0.001) or a factor (1000x)"), ("dgc:0.1:fast", "unknown dgc option"),
     ("dgc:0.1:warmup=2.5", "whole number"), ("dgc:0.1:clip=-1", "positive")],
)  # fmt: skip
def test_bad_settings_say_what_and_how(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=r"compress=") as err:
        parse_compression(text)
    assert says in str(err.value)


def test_dgc_takes_a_factor_as_well_as_a_share() -> None:
    assert parse_compression("dgc:1000x") == parse_compression("dgc:0.001")
    assert parse_compression("dgc:4x").value == 0.25


def test_dgc_s_sparsity_warm_up_is_the_paper_s_exponential_ramp() -> None:
    """Lin et al. 2018 §3.3: sparsity 75%, 93.75%, 98.4375%, 99.6% over the warm-up's four
    parts, then 99.9% (ratio 0.001: four stages before 0.25^5 < 0.001)."""
    from plait.parallel.dgc import dgc_share

    shares = [dgc_share(0.001, 20, step) for step in range(25)]
    ramp = [1 - 0.75, 1 - 0.9375, 1 - 0.984375, 1 - 0.99609375]
    assert shares == [x for x in ramp for _ in range(5)] + [0.001] * 5
    assert [dgc_share(0.01, 6, s) for s in range(7)] == [0.25] * 2 + [0.0625] * 2 + [
        0.015625
    ] * 2 + [0.01]  # three stages before 0.25^4 < 0.01, two steps each
    assert dgc_share(0.3, 10, 0) == 0.3  # nothing to ramp: 0.25 < 0.3
    assert dgc_share(0.001, 0, 0) == 0.001  # no warm-up


N = 10_000_000  # gradient entries


def test_wire_bytes_follow_each_method_s_encoding() -> None:
    assert wire_bytes("none", N, dp=4) == 4 * N
    assert wire_bytes("bf16", N, dp=4) == 2 * N
    assert wire_bytes("sign", N, dp=4) == math.ceil(N / 8) + 4
    assert wire_bytes("topk:0.01", N, dp=4) == math.ceil(0.01 * N) * 8
    # DGC: the top 0.1% as index and value; with dense-vectors the matrices' top 0.1%, the
    # other entries all-reduced whole
    shapes = [(1000, 9000)]
    assert wire_bytes("dgc:0.001", N, dp=4, matrices=shapes) == math.ceil(0.001 * N) * 8
    dense = wire_bytes("dgc:0.001:dense-vectors", N, dp=4, matrices=shapes)
    assert dense == 9000 * 8 + 1_000_000 * 4
    assert wire_bytes("threshold:0.1", N, dp=4, density=0.001) == 8 + math.ceil(0.001 * N) * 4
    # PowerSGD rank 2 on one 1000 x 10000 matrix: P (1000·2) and Q (10000·2) in fp32
    assert wire_bytes("powersgd:2", N, dp=4, matrices=[(1000, 10_000)]) == (2000 + 20_000) * 4


def test_compression_pays_on_a_slow_link_and_not_on_a_fast_one() -> None:
    device = Device(
        name="d", peak_flops={"fp32": 1e13}, memory_bytes=2**34, memory_bandwidth_Bps=1e12
    )
    slow = Link(latency_s=1e-4, bandwidth_Bps=1e9 / 8)  # 1 Gbit/s
    fast = Link(latency_s=1e-6, bandwidth_Bps=1e14)
    for link, pays in ((slow, True), (fast, False)):
        links = AxisLinks({"dp": 8}, {"dp": link})
        plain = compressed_sync_time("none", N, links=links, device=device)
        for method in ("threshold:0.1", "sign", "topk:0.001"):
            t = compressed_sync_time(method, N, links=links, device=device)
            assert (t < plain) is pays, (method, link, t, plain)
    one = AxisLinks({"dp": 1}, {"dp": slow})
    assert compressed_sync_time("sign", N, links=one, device=device) == 0.0


def test_zero_2_and_3_take_only_a_lower_reduce_dtype() -> None:
    from plait.sim import SimPlan

    SimPlan(dp=2, zero=3, compress="bf16")
    with pytest.raises(ValueError, match=r"compress=topk:0.1 with zero=2: .*fp16 or bf16"):
        SimPlan(dp=2, zero=2, compress="topk:0.1")


def _planned(inter_node_Bps: float, memory_Bps: float = 2e12) -> tuple[object, str]:
    from plait.cluster import Cluster, NodeGroup
    from plait.plan import SearchSpace, gpt_spec, search
    from plait.plan.explain import explain

    gpu = Device(name="gpu", peak_flops={"bf16": 1e14, "fp32": 2e13}, efficiency=0.5,
                 memory_bytes=80 * 2**30, memory_bandwidth_Bps=memory_Bps)  # fmt: skip
    cluster = Cluster(
        name="two nodes",
        groups=(NodeGroup(device=gpu, devices_per_node=1, num_nodes=2,
                          intra_node=Link(latency_s=5e-6, bandwidth_Bps=1e11)),),
        inter_node=Link(latency_s=1e-5, bandwidth_Bps=inter_node_Bps),
    )  # fmt: skip
    model = gpt_spec(num_layers=6, hidden=1024, num_heads=8, seq_len=512, vocab_size=8000)
    space = SearchSpace(micro_batch_sizes=(2,), recompute=("none",), zero_stages=(0,),
                        schedules=("1f1b",), compress=("none", "bf16", "powersgd:4"))  # fmt: skip
    found = search(model, cluster, global_batch=8, space=space)
    dp2 = [r for r in found.ranked if r.plan.dp == 2]
    return found, dp2, explain(found)  # type: ignore[return-value]


def test_the_planner_compresses_only_where_it_pays() -> None:
    found, dp2, text = _planned(125e6)  # 1 Gbit/s between the nodes
    fastest = dp2[0]  # ranked: fastest first, exact gradients first among equals
    assert fastest.plan.compress != "none"
    plain = next(r for r in dp2 if r.plan.compress == "none" and r.plan.pp == fastest.plan.pp)
    assert fastest.step_time_s < plain.step_time_s
    if found.best.plan.compress != "none":
        assert "compresses the data-parallel gradients" in text and "slow enough" in text
    # a fast link and slow memory: encoding costs more than the bytes it saves
    _, dp2, _ = _planned(1e11, memory_Bps=2e10)
    assert dp2[0].plan.compress == "none"


def test_simulate_and_plan_take_compress(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    import json
    from pathlib import Path

    from plait.cli.main import main

    assert main(["simulate", "--cluster", "local-cpu", "--dp", "2", "--zero", "2",
                 "--compress", "sign"]) == 2  # fmt: skip
    assert "ZeRO-2/3 reduce by FSDP2" in capsys.readouterr().err
    out = Path(str(tmp_path)) / "plan.json"
    assert main(["plan", "--cluster", "local-cpu", "--batch-size", "32",
                 "--compress", "none,powersgd:4", "--out", str(out)]) == 0  # fmt: skip
    assert json.loads(out.read_text())["communication"]["compress"] in ("none", "powersgd:4")
