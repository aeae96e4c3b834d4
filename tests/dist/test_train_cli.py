"""`plait train` end to end: workers launched, run folder written, the loss falls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.cli.main import main
from plait.config.sections import flat_plan_file
from plait.mesh import host_cores

pytestmark = pytest.mark.dist

SMALL = ["--layers", "2", "--hidden", "64", "--seq-len", "32", "--batch-size", "16",
         "--sample-chars", "20"]  # fmt: skip


def _rows(run_dir: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_writes_the_run_folder_and_learns(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code = main(["train", "--max-steps", "40", "--run-dir", str(run_dir), "--pp", "2", *SMALL])
    assert code == 0
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(40))
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5  # type: ignore[misc]
    assert last < first - 0.5, (first, last)  # type: ignore[operator]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["plan"]["pp"] == 2 and summary["step_time_s"] > 0
    assert summary["plan_source"] == "as given"
    assert 0.0 <= summary["bubble_fraction"] < 1.0
    timeline = json.loads((run_dir / "timeline.json").read_text())
    first_of_last = 39 * summary["plan"]["microbatches"]  # micro-batches carry global ids
    assert len(timeline) == 2
    assert {r["label"] for r in timeline[1]} >= {f"1F{first_of_last}", f"1B{first_of_last}"}
    assert json.loads((run_dir / "schedule.json").read_text())["kind"] == "1f1b"
    assert json.loads((run_dir / "config.json").read_text())["max_steps"] == 40


def test_auto_plan_profiles_plans_and_trains(tmp_path: Path) -> None:
    run_dir = tmp_path / "auto"
    assert main(["train", "--max-steps", "12", "--run-dir", str(run_dir), *SMALL]) == 0
    plan = flat_plan_file(json.loads((run_dir / "plan.json").read_text()))
    assert plan["dp"] * plan["tp"] * plan["pp"] == 2
    assert plan["global_batch"] == 16 and plan["predicted"]["step_time_s"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["plan_source"] == "auto"
    assert {k: summary["plan"][k] for k in ("dp", "tp", "pp")} == {
        k: plan[k] for k in ("dp", "tp", "pp")
    }
    rows = _rows(run_dir)
    assert rows[-1]["loss"] < rows[0]["loss"]  # type: ignore[operator]


def test_auto_plan_of_workers_outnumbering_cores_measures_their_sharing(tmp_path: Path) -> None:
    """4 workers planned as if on 2 cores (`plait.mesh.host_cores`, what `init_worker`
    pins them by): the decision records the share of a core each kept while all four
    computed, measured (`plait.profile.sharing`), which the planner priced them at, and
    the seconds a worker took to post a message (`plait.profile.calibrate.posting_s`)."""
    run_dir = tmp_path / "shared"
    code = main(["train", "--nproc", "4", "--max-steps", "2", "--run-dir", str(run_dir),
                 "--replan", *SMALL])  # fmt: skip
    assert code == 0
    decision = json.loads((run_dir / "plan.json").read_text())["decision"]
    assert decision["source"] == "measured" and decision["workers"] == 4
    if host_cores() >= 4:  # a core each: nothing is shared
        assert decision["sharing_efficiency"] == 1.0
    else:  # two to a core: each keeps a share of it, at most all
        assert 0.0 < decision["sharing_efficiency"] <= 1.0, decision
    # CPU workers post pipeline messages on their computing thread: measured, not assumed
    assert 0.0 < decision["message_s"] < 0.05, decision


def test_plan_file_is_trained_as_written(tmp_path: Path) -> None:
    plan = {"dp": 1, "tp": 1, "pp": 2, "schedule": "gpipe", "microbatches": 2, "chunks": 1,
            "zero": 0, "recompute": "full", "dtype": "fp32", "partition": [1, 3],
            "global_batch": 8}  # fmt: skip
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    run_dir = tmp_path / "from-file"
    assert main(["train", "--max-steps", "3", "--run-dir", str(run_dir), "--plan", str(path),
                 "--layers", "2", "--hidden", "32", "--seq-len", "16", "--sample-chars",
                 "0"]) == 0  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["plan"]["schedule"] == "gpipe" and summary["plan"]["partition"] == [1, 3]
    assert summary["plan"]["recompute"] == "full"


def test_bad_flags_fail_before_any_worker_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--nproc", "2", "--pp", "3"]) == 2
    assert "nproc=2 workers but dp × tp × pp = 1 × 1 × 3 = 3" in capsys.readouterr().err
    assert main(["train", "--plan", "/nonexistent/plan.json"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_an_asynchronous_schedule_trains_and_logs_every_update(tmp_path: Path) -> None:
    """2BW over 2 stages, 4 micro-batches a step: one update per step; the drain finishes
    the last step's updates, so updates.jsonl has one line per step, each loss the mean of
    its 4 micro-batches (reported a step late in metrics.jsonl)."""
    run_dir = tmp_path / "2bw"
    argv = ["train", "--max-steps", "12", "--run-dir", str(run_dir), "--pp", "2"]
    assert main([*argv, "--schedule", "2bw", "--microbatches", "4", *SMALL]) == 0
    updates = [json.loads(x) for x in (run_dir / "updates.jsonl").read_text().splitlines()]
    assert [u["update"] for u in updates] == list(range(12))
    rows = _rows(run_dir)
    reported = {r["loss_step"]: r["loss"] for r in rows if r["loss"] is not None}
    assert reported and all(reported[s] == pytest.approx(updates[s]["loss"]) for s in reported)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["updates"] == 12 and summary["schedule"]["policy"] == "2bw"
    assert summary["final_loss"] < summary["first_loss"]


def test_checkpoints_and_resume_continue_the_run(tmp_path: Path) -> None:
    """Four steps with a checkpoint every 2 (and one at the end), then `--resume auto`
    with two more steps: the second run starts at step 4 and metrics.jsonl holds every
    step once."""
    run_dir = tmp_path / "ck"
    base = ["train", "--run-dir", str(run_dir), "--pp", "2", "--checkpoint-every", "2", *SMALL]
    assert main([*base, "--max-steps", "4"]) == 0
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step-00000002", "step-00000004"]
    assert main([*base, "--max-steps", "6", "--resume", "auto", "--keep", "1"]) == 0
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(6))
    # the counters go on from the checkpoint too (the resumed engine's ids begin at 0)
    assert [r["loss_step"] for r in rows] == list(range(6))
    assert all(r["lr"] == 3e-3 for r in rows)
    updates = [json.loads(x) for x in (run_dir / "updates.jsonl").read_text().splitlines()]
    assert [(u["update"], u["step"]) for u in updates] == [(s, s) for s in range(6)]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000006"]


def test_one_cpu_worker_trains_and_samples_on_its_device(tmp_path: Path) -> None:
    """`--device cpu --nproc 1`: one worker, its layout planned for one; the text sample is
    generated on the worker's device from the gathered stages (a GPT: with its KV cache)."""
    run_dir = tmp_path / "one"
    code = main(["train", "--device", "cpu", "--nproc", "1", "--max-steps", "3",
                 "--run-dir", str(run_dir), *SMALL])  # fmt: skip
    assert code == 0
    assert [r["step"] for r in _rows(run_dir)] == [0, 1, 2]
    summary = json.loads((run_dir / "summary.json").read_text())
    plan = summary["plan"]
    assert plan["dp"] * plan["tp"] * plan["pp"] == 1
    assert summary["sample"].startswith("def ") and len(summary["sample"]) == 4 + 20
    assert json.loads((run_dir / "config.json").read_text())["device"] == "cpu"
