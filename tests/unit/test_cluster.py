"""Cluster presets, topology queries, the TOML form and its errors."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest

from plait.cluster import (
    GIB,
    Cluster,
    Device,
    Link,
    NodeGroup,
    calibrate_local_cpu,
    dtype_bytes,
    local_cpu,
    measured_cluster,
    normalize_dtype,
)
from plait.presets import cluster_from_toml, cluster_to_toml, load_cluster, preset_names

MIXED = """
name = "mixed"
inter_node = { latency_s = 1e-5, bandwidth_Bps = 12.5e9 }

[[nodes]]
preset = "dgx-a100-80gb"
count = 2

[[nodes]]
count = 2
devices_per_node = 4
intra_node = { latency_s = 1e-5, bandwidth_Bps = 150e9 }

[nodes.device]
name = "V100-32GB"
memory_gib = 32
efficiency = 0.6
peak_flops = { fp16 = 125e12, fp32 = 15.7e12 }
"""


def test_presets_load_without_measuring() -> None:
    assert set(preset_names()) >= {"local-cpu", "dgx-a100-80gb", "dgx-h100"}
    a100 = load_cluster("dgx-a100-80gb")
    assert a100.num_devices == 8 and a100.num_nodes == 1
    device = a100.device(0)
    assert device.peak("bf16") == 312e12 and device.peak("tf32") == 156e12
    assert device.peak("float32") == 19.5e12
    assert device.memory_bytes == 80 * GIB
    assert a100.link(0, 7).bandwidth_Bps == 300e9
    h100 = load_cluster("dgx-h100", num_nodes=4)
    assert h100.num_devices == 32
    assert h100.device(31).peak("bf16") == 989e12
    assert h100.link(0, 1).bandwidth_Bps == 450e9
    assert h100.link(0, 8).bandwidth_Bps == 50e9
    cpu = load_cluster("local-cpu")
    assert cpu.num_devices >= 1 and cpu.device(0).peak("fp32") > 0


def test_links_between_ranks() -> None:
    cluster = load_cluster("dgx-a100-80gb", num_nodes=2)
    assert cluster.node_of(7) == 0 and cluster.node_of(8) == 1
    assert cluster.link(3, 3).time(1e9) == 0.0
    assert cluster.link(0, 7) == cluster.groups[0].intra_node
    assert cluster.link(7, 8) == cluster.inter_node
    assert cluster.group_link([0, 1, 2]).bandwidth_Bps == 300e9
    assert cluster.group_link([0, 9]).bandwidth_Bps == 25e9
    assert Link(latency_s=1e-6, bandwidth_Bps=1e9).time(1e9) == pytest.approx(1.000001)
    with pytest.raises(ValueError, match="rank 16 is outside"):
        cluster.device(16)


def test_mixed_cluster_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "mixed.toml"
    path.write_text(MIXED)
    cluster = load_cluster(path)
    assert cluster.num_devices == 2 * 8 + 2 * 4 and cluster.num_nodes == 4
    assert cluster.device(15).name == "A100-SXM-80GB"
    assert cluster.device(16).name == "V100-32GB"
    assert cluster.device(16).memory_bytes == 32 * GIB
    assert cluster.link(16, 19).bandwidth_Bps == 150e9  # same V100 node
    assert cluster.link(19, 20).bandwidth_Bps == 12.5e9  # next V100 node
    assert cluster.group_link([0, 16]).bandwidth_Bps == 12.5e9
    assert not cluster.is_homogeneous
    with pytest.raises(ValueError, match="mixes 2 node kinds"):
        cluster.with_nodes(3)


@pytest.mark.parametrize("name", ["dgx-a100-80gb", "dgx-h100", "local-cpu"])
def test_toml_round_trip(name: str, tmp_path: Path) -> None:
    cluster = load_cluster(name, num_nodes=2)
    text = cluster_to_toml(cluster)
    assert cluster_from_toml(tomllib.loads(text)) == cluster
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert load_cluster(path) == cluster


def test_round_trip_of_mixed_cluster() -> None:
    cluster = cluster_from_toml(tomllib.loads(MIXED))
    assert cluster_from_toml(tomllib.loads(cluster_to_toml(cluster))) == cluster


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name = 'x'\nnodes = []", "add at least one"),
        ("colour = 'red'\n[[nodes]]\npreset = 'dgx-h100'", "unknown key 'colour'"),
        ("[[nodes]]\npreset = 'dgx-a42'", "preset = 'dgx-a42' is unknown"),
        ("[[nodes]]\npreset = 'dgx-h100'\ndevices_per_node = 4", "cannot be combined"),
        ("[[nodes]]\npreset = 'dgx-h100'\ncount = 0", "count = 0"),
        ("[[nodes]]\npreset = 'dgx-h100'\ncount = 2", "no inter_node link"),
        (
            "[[nodes]]\ndevices_per_node = 2\nintra_node = { latency_s = 0, bandwidth_Bps = -1 }"
            "\ndevice = { name = 'x', memory_gib = 1, peak_flops = { fp32 = 1e9 } }",
            "bandwidth_Bps=-1",
        ),
        (
            "[[nodes]]\ndevices_per_node = 'two'\nintra_node = { latency_s = 0, bandwidth_Bps = 1 }"
            "\ndevice = { name = 'x', memory_gib = 1, peak_flops = { fp32 = 1e9 } }",
            "devices_per_node = 'two' must be a number",
        ),
        (
            "[[nodes]]\ndevices_per_node = 2\nintra_node = { latency_s = 0, bandwidth_Bps = 1 }"
            "\ndevice = { name = 'x', memory_gib = 1, speed = 3, peak_flops = { fp32 = 1e9 } }",
            "unknown key 'speed'",
        ),
        (
            "[[nodes]]\ndevices_per_node = 2\nintra_node = { latency_s = 0, bandwidth_Bps = 1 }"
            "\ndevice = { name = 'x', memory_gib = 1, peak_flops = { fp64 = 1e9 } }",
            "dtype 'fp64' is unknown",
        ),
        (
            "[[nodes]]\ndevices_per_node = 2\nintra_node = { latency_s = 0, bandwidth_Bps = 1 }"
            "\ndevice = { name = 'x', peak_flops = { fp32 = 1e9 } }",
            "exactly one of memory_bytes or memory_gib",
        ),
        ("[[nodes]]\ncount = 1", "missing key"),
    ],
)
def test_bad_toml_names_key_and_value(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cluster_from_toml(tomllib.loads(text))


def test_bad_paths_and_values(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a preset"):
        load_cluster("no-such-cluster")
    broken = tmp_path / "broken.toml"
    broken.write_text("name = ")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_cluster(broken)
    with pytest.raises(ValueError, match=r"efficiency=1\.5"):
        Device(name="d", peak_flops={"fp32": 1.0}, efficiency=1.5, memory_bytes=1)
    with pytest.raises(ValueError, match="no peak_flops for 'bf16'"):
        Device(name="d", peak_flops={"fp32": 1.0}, memory_bytes=1).peak("bf16")
    with pytest.raises(ValueError, match="latency_s"):
        Link(latency_s=-1.0, bandwidth_Bps=1.0)


def test_dtypes() -> None:
    assert normalize_dtype("bfloat16") == "bf16" and normalize_dtype("FP16") == "fp16"
    assert dtype_bytes("bf16") == 2 and dtype_bytes("fp32") == 4 and dtype_bytes("tf32") == 4


def test_measured_cluster_hook() -> None:
    flops = calibrate_local_cpu(size=64, repeats=1)
    assert flops > 0 and math.isfinite(flops)
    cluster = local_cpu(flops=flops, devices=4)
    assert cluster.num_devices == 4 and cluster.device(0).achievable_flops("fp32") == flops
    link = Link(latency_s=1e-5, bandwidth_Bps=2e9)
    measured = measured_cluster(
        name="lab", flops={"fp32": 1e11}, memory_bytes=GIB, devices_per_node=2, intra_node=link
    )
    assert measured.with_nodes(3).num_devices == 6
    assert measured.with_nodes(3).link(0, 2) == link  # no inter-node link given: the same


def test_cluster_needs_groups() -> None:
    with pytest.raises(ValueError, match="no node groups"):
        Cluster(name="empty", groups=(), inter_node=Link(latency_s=0.0, bandwidth_Bps=1.0))
    device = Device(name="d", peak_flops={"fp32": 1.0}, memory_bytes=1)
    with pytest.raises(ValueError, match="devices_per_node=0"):
        NodeGroup(device=device, devices_per_node=0, intra_node=Link(latency_s=0, bandwidth_Bps=1))
