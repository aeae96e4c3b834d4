"""The plan's five sections: in code (each a dataclass of its own fields and checks, the
plan their union) and in files (TOML, a run's config.json, plan files), with files written
before the sections still read."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from plait.cli.main import main
from plait.config import ParallelPlan, load_config
from plait.config.sections import (
    SECTIONS,
    MemorySection,
    PipelineSection,
    flat_plan_file,
    from_file,
    to_file,
)
from plait.plan.io import parallel_plan_of, read_plan

ROOT = Path(__file__).resolve().parents[2]

# the sections as the docs list them, written out here rather than read from the code
EXPECTED = {
    "layout": ["dp", "dp_replicate", "dp_shard", "tp", "cp", "pp", "ep", "rank_order"],
    "pipeline": ["schedule", "microbatches", "chunks", "partition", "pipelines",
                 "wsp_staleness", "wsp_wave", "wsp_at_most"],
    "memory": ["zero", "recompute", "recompute_stages", "sequence_parallel",
               "offload_activations", "offload_optimizer"],
    "numerics": ["dtype"],
    "communication": ["compress"],
}  # fmt: skip


def test_each_field_of_the_plan_belongs_to_exactly_one_section() -> None:
    got = {name: [f.name for f in dataclasses.fields(cls)] for name, cls in SECTIONS.items()}
    assert got == EXPECTED
    flat = [name for names in EXPECTED.values() for name in names]
    assert sorted(f.name for f in dataclasses.fields(ParallelPlan)) == sorted(flat)
    assert len(flat) == len(set(flat))


def test_a_section_is_a_value_of_the_plan_and_checks_its_own_fields() -> None:
    plan = ParallelPlan(dp=2, pp=2, zero=1, recompute="full", schedule="gpipe")
    memory = plan.section("memory")
    assert isinstance(memory, MemorySection)
    assert (memory.zero, memory.recompute) == (1, "full")
    assert plan.sections()["pipeline"] == PipelineSection(schedule="gpipe")
    with pytest.raises(ValueError, match="zero=5 must be 0, 1, 2 or 3"):
        MemorySection(zero=5)
    with pytest.raises(ValueError, match="schedule='nope' is unknown"):
        PipelineSection(schedule="nope")
    with pytest.raises(ValueError, match="section 'optimizer' is unknown"):
        plan.section("optimizer")


_SECTIONED = """
max_steps = 7
[model]
layers = 6
[layout]
dp = 2
pp = 2
[pipeline]
schedule = "zb-h1"
microbatches = 4
[memory]
zero = 1
recompute = "selective"
[numerics]
dtype = "bf16"
[communication]
compress = "fp16"
"""

_FLAT = """
max_steps = 7
[model]
layers = 6
[parallel]
dp = 2
pp = 2
schedule = "zb-h1"
microbatches = 4
zero = 1
recompute = "selective"
dtype = "bf16"
compress = "fp16"
"""


def test_toml_sections_and_the_old_flat_table_load_the_same_plan(tmp_path: Path) -> None:
    (tmp_path / "new.toml").write_text(_SECTIONED)
    (tmp_path / "old.toml").write_text(_FLAT)
    new, old = load_config(tmp_path / "new.toml"), load_config(tmp_path / "old.toml")
    expected = ParallelPlan(dp=2, pp=2, schedule="zb-h1", microbatches=4, zero=1,
                            recompute="selective", dtype="bf16", compress="fp16")  # fmt: skip
    assert new.parallel == expected and old.parallel == expected
    assert new.max_steps == old.max_steps == 7 and new.model.layers == 6


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[layout]\nzero = 1\n", r"zero in \[layout\] .* memory setting: move it to \[memory\]"),
        ("[memory]\nzeroo = 1\n", r"unknown key 'zeroo' in \[memory\]"),
        ("[layout]\ndp = 2\n[parallel]\ndp = 2\n", r"dp is set twice .* and in \[parallel\]"),
        ("layout = 3\n", r"\[layout\] must be a table"),
        ("dp = 2\n", r"dp is a layout setting: put it under \[layout\]"),
        ("[memory]\nzero = 9\n", r"zero=9 must be 0, 1, 2 or 3"),
    ],
)  # fmt: skip
def test_a_misplaced_or_bad_key_is_refused_naming_where_it_belongs(
    tmp_path: Path, text: str, message: str
) -> None:
    (tmp_path / "c.toml").write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(tmp_path / "c.toml")


def test_to_file_and_from_file_round_trip_every_field() -> None:
    plan = ParallelPlan(dp=2, tp=2, pp=2, schedule="interleaved", chunks=2, microbatches=4,
                        zero=1, recompute="full", sequence_parallel=True, dtype="bf16",
                        partition=(1, 1, 1, 1))  # fmt: skip
    values = plan.to_dict()
    written = to_file({"parallel": values, "max_steps": 3, "model": {"layers": 4}})
    assert list(written) == ["model", *SECTIONS, "max_steps"]
    for name, keys in EXPECTED.items():
        assert set(written[name]) <= set(keys)
    back, rest = from_file(json.loads(json.dumps(written)))
    assert rest == {"max_steps": 3, "model": {"layers": 4}}
    assert ParallelPlan(**back) == plan


def test_a_plan_file_has_sections_and_reads_as_the_old_flat_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--cluster", "local-cpu", "--batch-size", "8", "--out", str(out)]) == 0
    capsys.readouterr()
    written = json.loads(out.read_text())
    assert {"layout", "pipeline", "memory", "numerics"} <= set(written)
    assert not {"dp", "pp", "schedule", "zero", "dtype"} & set(written)  # only in sections
    assert "global_batch" in written and "predicted" in written  # beside the sections
    flat = {k: v for k, v in written.items() if k not in SECTIONS}
    for name in SECTIONS:
        flat.update(written.get(name, {}))
    old = tmp_path / "old.json"  # the same plan as files were written before the sections
    old.write_text(json.dumps(flat))
    assert read_plan(out) == read_plan(old) == flat_plan_file(written)
    assert parallel_plan_of(read_plan(out)) == parallel_plan_of(flat)
    # both drive `plait simulate` alike
    assert main(["simulate", "--plan", str(out), "--json"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert main(["simulate", "--plan", str(old), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == a


def test_the_committed_old_plan_file_reads_as_written() -> None:
    old = json.loads((ROOT / "tests" / "golden" / "v1_run" / "plan.json").read_text())
    layout = parallel_plan_of(read_plan(ROOT / "tests" / "golden" / "v1_run" / "plan.json"))
    for key in ("dp", "tp", "pp", "schedule", "microbatches", "zero", "recompute", "dtype"):
        assert getattr(layout, key) == old[key], key
