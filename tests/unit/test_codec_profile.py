"""Measured encode/decode time of each gradient compression: measured by running the
reducer's hooks, stored in the profile, and charged by the cost model, simulator and
planner in place of the estimate from memory bandwidth."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pytest

from plait.cli.main import main
from plait.cluster import Device, Link, local_cpu
from plait.cost.comm import AxisLinks, Collective, collective_time
from plait.cost.compress import codec_figure, compressed_sync_time
from plait.presets import cluster_from_toml, cluster_to_toml
from plait.profile.codec import measure_codec, read_codec_profile, with_codec

N = 1_000_000  # gradient entries
LINK = Link(latency_s=1e-5, bandwidth_Bps=1e9)
SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32", "--vocab", "96"]


def _device(**codec: float) -> Device:
    return Device(name="d", peak_flops={"fp32": 1e12}, memory_bytes=2**34,
                  memory_bandwidth_Bps=1e11, codec_s_per_entry=codec)  # fmt: skip


def test_every_method_measures_a_positive_finite_time_per_entry() -> None:
    methods = ("fp16", "bf16", "powersgd:2", "threshold:0.01", "topk:0.01", "sign")
    figures = measure_codec(methods, warmup=0, repeats=1, matrices=(1, 2))
    assert sorted(figures) == sorted(methods)
    for method, seconds in figures.items():
        assert math.isfinite(seconds) and seconds > 0, (method, seconds)


def test_a_measured_figure_replaces_the_estimate_by_exactly_its_term() -> None:
    dp, per_entry = 4, 2e-6
    # sign: every rank's N/8 bytes of signs and a 4-byte scale, all-gathered
    wire = collective_time(
        Collective(kind="all_gather", num_bytes=dp * (N // 8 + 4), axis="dp"), dp, LINK
    )
    measured = compressed_sync_time(
        "sign", N, links=AxisLinks({"dp": dp}, {"dp": LINK}), device=_device(sign=per_entry)
    )
    assert measured == pytest.approx(wire + per_entry * N, rel=1e-12)
    # no figure: 8 passes over N fp32 entries at the device's memory bandwidth
    estimated = compressed_sync_time(
        "sign", N, links=AxisLinks({"dp": dp}, {"dp": LINK}), device=_device()
    )
    assert estimated == pytest.approx(wire + 8 * N * 4 / 1e11, rel=1e-12)
    # a figure for another method changes nothing
    other = compressed_sync_time(
        "sign", N, links=AxisLinks({"dp": dp}, {"dp": LINK}), device=_device(fp16=1.0)
    )
    assert other == estimated


def test_figures_are_found_by_value_method_or_neighbours() -> None:
    figures = {"powersgd:1": 3e-9, "powersgd:4": 9e-9, "topk:0.01": 5e-9, "fp16": 1e-9}
    assert codec_figure("powersgd:4", figures) == (9e-9, "measured at powersgd:4")
    # PowerSGD's matmuls grow with the rank: rank 2 on the line through ranks 1 and 4
    seconds, source = codec_figure("powersgd:2", figures)  # type: ignore[misc]
    assert seconds == pytest.approx(3e-9 + (9e-9 - 3e-9) * (2 - 1) / (4 - 1))
    assert "powersgd:1" in source and "powersgd:4" in source
    assert codec_figure("topk:0.05", figures) == (5e-9, "measured at topk:0.01")
    assert codec_figure("sign", figures) is None
    assert codec_figure("threshold:0.1", {"threshold": 7e-9}) == (7e-9, "measured at threshold")


def test_the_simulated_step_grows_by_the_codec_term() -> None:
    from plait.plan.predict import predict
    from plait.profile import GPTSpec
    from plait.sim import SimPlan

    spec = GPTSpec(num_layers=2, hidden=64, num_heads=4, seq_len=32, vocab_size=96)
    blocks = spec.block_costs(micro_batch_size=1, dtype="fp32")
    plan = SimPlan(dp=2, pp=1, dtype="fp32", compress="topk:0.01", seq_len=32)
    cluster = local_cpu(devices=2)
    fast, slow = 1e-9, 1e-6  # seconds per entry
    a = predict(blocks, with_codec(cluster, {"topk:0.01": fast}), plan).result
    b = predict(blocks, with_codec(cluster, {"topk:0.01": slow}), plan).result
    # one stage: its reduction of every parameter is exposed after the backward
    num_params = sum(block.num_params for block in blocks)
    assert b.step_time_s - a.step_time_s == pytest.approx((slow - fast) * num_params, rel=1e-9)


def test_device_figures_survive_the_cluster_toml() -> None:
    cluster = with_codec(local_cpu(devices=2), {"powersgd:4": 1.5e-8, "sign": 2e-8})
    back = cluster_from_toml(tomllib.loads(cluster_to_toml(cluster)))
    assert back == cluster and back.device(0).codec_s_per_entry["powersgd:4"] == 1.5e-8
    with pytest.raises(ValueError, match=r"codec_s_per_entry\[sign\]"):
        _device(sign=-1.0)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_profile_writes_the_figures_and_simulate_and_plan_use_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    measure = ["profile", *SMALL, "--repeats", "1", "--warmup", "0", "--cache-dir", str(tmp_path)]
    code, out, _ = _run(capsys, *measure, "--codec", "sign,powersgd:2", "--json")
    assert code == 0
    profile = tmp_path / "profile.json"
    profile.write_text(out)
    written = json.loads(out)["device"]["codec_s_per_entry"]
    assert sorted(written) == ["powersgd:2", "sign"]
    assert read_codec_profile(profile) == written  # the round trip keeps them
    code, out, _ = _run(capsys, *measure, "--codec", "sign,powersgd:2", "--json")
    assert code == 0 and json.loads(out)["device"]["codec_s_per_entry"] == written  # cached

    simulate = ["simulate", *SMALL, "--cluster", "local-cpu", "--dp", "2", "--dtype", "fp32",
                "--compress", "sign", "--json"]  # fmt: skip
    code, out, _ = _run(capsys, *simulate, "--profile", str(profile))
    codec = json.loads(out)["codec"]
    assert code == 0 and codec["source"] == "measured"
    assert codec["s_per_entry"] == written["sign"]

    # a profile from before codec figures (or analytic) loads: the estimate, and says so
    old = json.loads(profile.read_text())
    del old["device"]["codec_s_per_entry"]
    profile.write_text(json.dumps(old))
    assert read_codec_profile(profile) == {}
    code, out, _ = _run(capsys, *simulate, "--profile", str(profile))
    assert code == 0 and json.loads(out)["codec"]["source"] == "analytic"
    assert "memory bandwidth" in json.loads(out)["codec"]["text"]

    plan = ["plan", *SMALL, "--cluster", "local-cpu", "--devices", "2", "--batch-size", "4",
            "--compress", "powersgd:2", "--dtype", "fp32", "--json"]  # fmt: skip
    profile.write_text(json.dumps({"device": {"codec_s_per_entry": written}}))
    code, out, _ = _run(capsys, *plan, "--profile", str(profile))
    assert code == 0
    data = json.loads(out)
    if data["best"]["compress"] != "none":
        assert "measured at powersgd:2" in data["explanation"]


def test_a_bad_profile_is_refused_by_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    code, _, err = _run(capsys, "simulate", "--cluster", "local-cpu", "--dp", "2",
                        "--compress", "sign", "--profile", str(bad))  # fmt: skip
    assert code == 2 and f"--profile {bad} is not JSON" in err
    code, _, err = _run(capsys, "profile", *SMALL, "--codec", "gzip")
    assert code == 2 and "compress='gzip'" in err
