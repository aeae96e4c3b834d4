"""What one `plait train` run leaves besides metrics: plain progress lines when piped, the
trace.json and timeline.png of its last steps, TensorBoard scalars, a profiler trace."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from plait.cli.main import main

pytestmark = pytest.mark.dist

SMALL = ["--layers", "2", "--hidden", "64", "--seq-len", "32", "--batch-size", "16",
         "--sample-chars", "0", "--pp", "2", "--microbatches", "2"]  # fmt: skip


def test_a_run_logs_plainly_and_leaves_its_timelines(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    config = tmp_path / "run.toml"
    lines = ['profile_steps = "2:4"', "trace_steps = 2"]
    if tensorboard:
        lines.append(f'tensorboard = "{tmp_path / "tb"}"')
    config.write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    steps = 6
    code = main(["train", "--config", str(config), "--max-steps", str(steps), "--log-every",
                 "5", "--run-dir", str(run_dir), *SMALL])  # fmt: skip
    assert code == 0
    out = capfd.readouterr().out  # the workers' stdout is a pipe here, not a terminal
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    progress = [x for x in out.splitlines() if x.startswith("step ")]
    # steps from 0 on the console as in metrics.jsonl, TensorBoard and profile_steps
    assert [x.split(" | ")[0] for x in progress] == ["step 0 (1/6)", "step 4 (5/6)",
                                                     "step 5 (6/6)"]  # fmt: skip
    for line, row in zip(progress, [rows[0], rows[4], rows[5]], strict=True):
        assert line.split(" | ")[1] == f"loss {row['loss']:.3f}"
    assert [r["lr"] for r in rows] == [3e-3] * steps  # the default, constant schedule
    assert all(r["peak_memory_bytes"] > 0 and r["grad_norm"] > 0 for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"]["torch"] and summary["host"] and summary["device"]

    # trace.json: the last two steps, one slice per recorded action; the last step's slices
    # are timeline.json's records, shifted by the step before it
    trace = json.loads((run_dir / "trace.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted({e["args"]["step"] for e in slices}) == [steps - 2, steps - 1]
    timeline = json.loads((run_dir / "timeline.json").read_text())
    assert len(timeline) == 2
    for rank, records in enumerate(timeline):
        last = sorted(
            e["name"] for e in slices if e["pid"] == rank and e["args"]["step"] == steps - 1
        )
        assert last == sorted(r["label"] for r in records)
        durations = {e["name"]: e["dur"] for e in slices if e["pid"] == rank}
        for r in records:
            assert durations[r["label"]] == pytest.approx((r["end"] - r["start"]) * 1e6)
    assert (run_dir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the profiler recorded steps 2 and 3 on both ranks, with the executor's labels
    for rank in (0, 1):
        profile = json.loads((run_dir / f"profile-rank{rank}.json").read_text())
        names = {e.get("name", "") for e in profile["traceEvents"]}
        assert f"PP:{rank}F4" in names and f"PP:{rank}B7" in names  # steps 2-3: mb 4-7
        assert f"PP:{rank}F8" not in names and f"PP:{rank}F3" not in names

    if not tensorboard:
        pytest.skip("tensorboard is not installed (pip install 'plait[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([r["loss"] for r in rows])
    for name in ("lr", "grad_norm", "peak_memory_bytes"):
        scalars = [(e.step, e.value) for e in events.Scalars(name)]
        assert scalars == [(r["step"], pytest.approx(r[name])) for r in rows]
