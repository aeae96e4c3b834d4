"""The cluster TOML form: reading and writing it, the presets shipped in it, and
`load_cluster`, which finds a cluster by preset name or file.

A file has a `name`, an `inter_node` link, and one `[[nodes]]` table per node kind, in
rank order: either `preset` (a shipped node) and `count`, or `count`, `devices_per_node`,
`intra_node = { latency_s, bandwidth_Bps }` and `device = { name, peak_flops = { bf16 =
... }, efficiency, memory_bytes or memory_gib, memory_bandwidth_Bps, host_bandwidth_Bps,
slowdown, dispatch_s }` (a device `slowdown` times slower than its numbers, which plait's
CPU runtime enforces; `dispatch_s` host seconds to issue one block's forward or backward).
The `*.toml` files beside this module are the presets (one node each); `local-cpu` is
built in code because it reads this machine. Unknown keys and bad values
raise `ValueError` naming key and value.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, TypeVar

from plait.cluster import GIB, Cluster, Device, Link, NodeGroup, local_cpu

__all__ = [
    "cluster_from_toml",
    "cluster_to_toml",
    "load_cluster",
    "preset_names",
    "read_cluster",
]

_T = TypeVar("_T")

_PRESET_DIR = Path(__file__).parent


def preset_names() -> list[str]:
    """Names `load_cluster` accepts besides file paths: `local-cpu` and presets/*.toml."""
    return ["local-cpu", *sorted(p.stem for p in _PRESET_DIR.glob("*.toml"))]


def load_cluster(name_or_path: str | Path, num_nodes: int | None = None) -> Cluster:
    """A preset by name (`preset_names()`), or a cluster TOML file; `num_nodes` rescales a
    one-kind cluster."""
    cluster = read_cluster(name_or_path)
    return cluster if num_nodes is None else cluster.with_nodes(num_nodes)


def _read_toml(path: Path) -> dict[str, Any]:
    with path.open("rb") as handle:
        try:
            return tomllib.load(handle)
        except tomllib.TOMLDecodeError as error:
            raise ValueError(f"cluster file {path}: not valid TOML: {error}") from None


def _preset(name: str) -> Cluster:
    if name == "local-cpu":
        return local_cpu()
    path = _PRESET_DIR / f"{name}.toml"
    if not path.is_file():
        raise ValueError(f"cluster preset {name!r} is unknown; use one of {preset_names()}")
    return cluster_from_toml(_read_toml(path), default_name=name)


def read_cluster(name_or_path: str | Path) -> Cluster:
    """A preset by name, or the cluster a TOML file describes."""
    key = str(name_or_path)
    path = Path(name_or_path)
    if key in preset_names():
        return _preset(key)
    if path.is_file():
        return cluster_from_toml(_read_toml(path), default_name=path.stem)
    raise ValueError(
        f"cluster {key!r} is neither a preset ({', '.join(preset_names())}) "
        "nor an existing TOML file; give one of those"
    )


_DEVICE_KEYS = {"name", "peak_flops", "efficiency", "memory_bytes", "memory_gib"}
_KEYS = {
    "cluster": {"name", "inter_node", "nodes"},
    "link": {"latency_s", "bandwidth_Bps"},
    "device": _DEVICE_KEYS | {"memory_bandwidth_Bps", "host_bandwidth_Bps", "codec_s_per_entry",
               "slowdown", "dispatch_s", "message_s"},
    "node": {"preset", "count", "devices_per_node", "device", "intra_node", "processors",
             "sharing_efficiency"},
}  # fmt: skip
_REQUIRED = {
    "link": _KEYS["link"],
    "device": {"name", "peak_flops"},
    "node": _KEYS["node"] - {"preset", "processors", "sharing_efficiency"},
}


def _table(where: str, value: Any, kind: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} = {value!r} must be a table")
    unknown = sorted(set(value) - _KEYS[kind])
    if unknown:
        raise ValueError(
            f"{where}: unknown key {unknown[0]!r} (value {value[unknown[0]]!r}); "
            f"allowed keys are {sorted(_KEYS[kind])}"
        )
    missing = sorted(_REQUIRED.get(kind, set()) - set(value) - {"count"})
    if missing and "preset" not in value:
        raise ValueError(f"{where}: missing key {missing[0]!r}; add it")
    for key, item in value.items():
        if key in ("name", "preset", "nodes") or isinstance(item, dict):
            continue
        if isinstance(item, bool) or not isinstance(item, int | float):
            raise ValueError(f"{where}.{key} = {item!r} must be a number")
    return value


def _build(where: str, make: Callable[[], _T]) -> _T:
    try:
        return make()
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None


def _link(where: str, data: Any) -> Link:
    table = _table(where, data, "link")
    return _build(where, lambda: Link(**table))


def _device(where: str, data: Any) -> Device:
    table = dict(_table(where, data, "device"))
    if ("memory_bytes" in table) == ("memory_gib" in table):
        raise ValueError(f"{where}: give exactly one of memory_bytes or memory_gib")
    if "memory_gib" in table:
        gib = table.pop("memory_gib")
        table["memory_bytes"] = _build(f"{where}.memory_gib", lambda: int(float(gib) * GIB))
    if not isinstance(table["peak_flops"], dict):
        raise ValueError(f"{where}.peak_flops = {table['peak_flops']!r}: use {{ bf16 = 3e14 }}")
    return _build(where, lambda: Device(**table))


def _node_group(where: str, data: Any) -> NodeGroup:
    table = _table(where, data, "node")
    count = table.get("count", 1)
    if not isinstance(count, int) or count < 1:  # NodeGroup would call it num_nodes
        raise ValueError(f"{where}.count = {count!r} must be a whole number of nodes >= 1")
    if "preset" in table:
        preset, extra = table["preset"], sorted(set(table) - {"preset", "count"})
        if preset not in preset_names():
            raise ValueError(f"{where}.preset = {preset!r} is unknown; use one of {preset_names()}")
        if extra:
            raise ValueError(
                f"{where}: key {extra[0]!r} (value {table[extra[0]]!r}) cannot be combined with "
                "a preset; drop it, or describe the node in full without 'preset'"
            )
        return _build(where, lambda: replace(_preset(preset).groups[0], num_nodes=count))
    device = _device(f"{where}.device", table["device"])
    intra = _link(f"{where}.intra_node", table["intra_node"])
    per_node = table["devices_per_node"]
    return _build(
        where,
        lambda: NodeGroup(
            device=device, devices_per_node=per_node, intra_node=intra, num_nodes=count,
            processors=table.get("processors"),
            sharing_efficiency=table.get("sharing_efficiency", 1.0),
        ),
    )  # fmt: skip


def cluster_from_toml(data: Mapping[str, Any], *, default_name: str = "cluster") -> Cluster:
    """A cluster from parsed TOML: `name`, `inter_node`, and one `[[nodes]]` per node kind
    (either `preset` and `count`, or `count`, `devices_per_node`, `device`, `intra_node`)."""
    table = _table("cluster", dict(data), "cluster")
    nodes = table.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise ValueError(f"cluster: nodes = {nodes!r}: add at least one [[nodes]] table")
    groups = tuple(_node_group(f"nodes[{i}]", entry) for i, entry in enumerate(nodes))
    if "inter_node" in table:
        inter = _link("inter_node", table["inter_node"])
    elif sum(g.num_nodes for g in groups) == 1:
        inter = groups[0].intra_node
    else:
        raise ValueError("cluster: several nodes but no inter_node link; add one")
    return Cluster(name=str(table.get("name", default_name)), groups=groups, inter_node=inter)


def _toml(value: object) -> str:
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{_key(k)} = {_toml(v)}" for k, v in value.items()) + " }"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, float):
        short = next(f"{value:.{p}e}" for p in range(17) if float(f"{value:.{p}e}") == value)
        return min(repr(value), short, key=len)
    return repr(value)


def _key(name: str) -> str:
    """A TOML key: bare when it can be (`bf16`), quoted otherwise (`"powersgd:4"`)."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else _toml(name)


def cluster_to_toml(cluster: Cluster) -> str:
    """The TOML text `load_cluster` reads back into an equal cluster."""
    lines = [f"name = {_toml(cluster.name)}", f"inter_node = {_toml(_fields(cluster.inter_node))}"]
    for group in cluster.groups:
        lines += ["", "[[nodes]]", f"count = {group.num_nodes}"]
        lines += [f"devices_per_node = {group.devices_per_node}"]
        if group.processors is not None:
            lines += [f"processors = {group.processors}"]
            lines += [f"sharing_efficiency = {_toml(group.sharing_efficiency)}"]
        lines += [f"intra_node = {_toml(_fields(group.intra_node))}", "", "[nodes.device]"]
        # host times only when known, so files written before they existed read back equal
        lines += [f"{k} = {_toml(v)}" for k, v in _fields(group.device).items()
                  if v != {} and not (k in ("dispatch_s", "message_s") and v == 0)]  # fmt: skip
    return "\n".join(lines) + "\n"


def _fields(item: Link | Device) -> dict[str, Any]:
    return {f.name: getattr(item, f.name) for f in fields(item)}
