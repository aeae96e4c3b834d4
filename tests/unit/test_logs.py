"""Run logging without workers: levels, plain progress lines, metrics rows, TensorBoard
scalars, and the trace.json / timeline.png of recorded steps."""

from __future__ import annotations

import importlib.util
import json
import logging
import statistics
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from plait.config import load_config
from plait.schedule.generators import one_f_one_b
from plait.trace import run_spans, write_run_timeline
from plait.train.logs import LOGGER, RunLogger, setup

SMALL = {"model.layers": 2, "model.hidden": 64, "model.seq_len": 32, "batch_size": 16}


@pytest.fixture(autouse=True)
def _fresh_logger() -> Iterator[None]:
    """Each test configures the logger itself; none leaves a handler on a closed capture."""
    yield
    logger = logging.getLogger(LOGGER)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)


def _report(loss: float, step: int, microbatches: int = 4) -> Any:
    ids = tuple(range(step * microbatches, (step + 1) * microbatches))
    return SimpleNamespace(loss=loss, skipped=False, grad_norm=1.0, microbatches=ids,
                           losses=(loss,) * microbatches)  # fmt: skip


@pytest.mark.parametrize(
    ("verbosity", "rank", "all_ranks", "level"),
    [
        (-1, 0, False, logging.WARNING),
        (0, 0, False, logging.INFO),
        (1, 0, False, logging.DEBUG),
        (1, 1, False, logging.WARNING),
        (0, 1, True, logging.INFO),
    ],
)
def test_setup_levels(verbosity: int, rank: int, all_ranks: bool, level: int) -> None:
    logger = setup(verbosity, rank, all_ranks=all_ranks)
    assert logger is logging.getLogger(LOGGER)
    assert logger.level == level and len(logger.handlers) == 1


def _lr(step: int) -> float:
    return 1e-3 * (step + 1)


def _peak(step: int) -> int:
    return 1000 + step


def _run(tmp_path: Path, steps: int, times: list[float], losses: list[float], **over: Any) -> Any:
    cfg = load_config(**SMALL, max_steps=steps, log_every=10, **over)
    log = RunLogger(tmp_path, cfg, group=4)
    for step in range(steps):
        log.step(step, _report(losses[step], step), times[step], lr=_lr(step),
                 peak_memory_bytes=_peak(step))  # fmt: skip
    return log


def test_plain_lines_when_not_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    setup(0, 0)  # pytest's captured stdout is no terminal
    steps = 25
    times = [0.01 + 0.001 * (i % 3) for i in range(steps)]
    losses = [5.0 - 0.1 * i for i in range(steps)]
    log = _run(tmp_path, steps, times, losses)
    log.metrics(24, {"val_loss": 2.5})
    out = capsys.readouterr().out.splitlines()
    tokens = 16 * 32
    expected = []
    for first, last in [(0, 1), (1, 10), (10, 20), (20, 25)]:  # 0-based steps, as in the files
        mean = statistics.fmean(times[first:last])
        expected.append(
            f"step {last - 1} ({last}/25) | loss {losses[last - 1]:.3f} | "
            f"{tokens / mean:,.0f} tok/s | {mean * 1e3:.1f} ms/step"
        )
    assert out == [*expected, "after step 24: val_loss 2.5"]
    log.metrics_file.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [*range(steps), 24]
    assert [r["loss"] for r in rows[:-1]] == losses
    assert [(r["lr"], r["peak_memory_bytes"], r["grad_norm"]) for r in rows[:-1]] == [
        (_lr(i), _peak(i), 1.0) for i in range(steps)
    ]
    assert rows[-1]["val_loss"] == 2.5


def test_quiet_prints_nothing_and_verbose_debug(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    setup(-1, 0)
    _run(tmp_path, 12, [0.01] * 12, [1.0] * 12).metrics_file.close()
    assert capsys.readouterr().out == ""
    setup(1, 0)
    logging.getLogger(LOGGER).debug("details")
    assert capsys.readouterr().out == "details\n"
    setup(0, 0)
    logging.getLogger(LOGGER).debug("details")
    assert capsys.readouterr().out == ""


def test_other_ranks_warn_only_unless_asked(capsys: pytest.CaptureFixture[str]) -> None:
    setup(0, 1)
    logging.getLogger(LOGGER).info("progress")
    logging.getLogger(LOGGER).warning("trouble")
    assert capsys.readouterr().out == "trouble\n"
    setup(0, 1, all_ranks=True)
    logging.getLogger(LOGGER).info("progress")
    assert capsys.readouterr().out == "[rank 1] progress\n"


def _records(rank: int, step: int, offset: float) -> list[dict[str, Any]]:
    labels = [f"{rank}F{step}", f"{rank}SEND_F{step}", f"{rank}RECV_B{step}", f"{rank}B{step}"]
    return [
        {"rank": rank, "index": i, "label": label, "start": offset + 0.001 * i,
         "end": offset + 0.001 * i + 0.0008, "wait": 0.0002 * (i == 3)}
        for i, label in enumerate(labels)
    ]  # fmt: skip


def _recent() -> list[list[dict[str, Any]]]:
    # rank 1 ran step 7 longest (5 ms): step 8 starts 5 ms after step 7 in the drawing
    times = {(0, 7): 0.004, (1, 7): 0.005, (0, 8): 0.0045, (1, 8): 0.004}
    return [
        [{"step": s, "step_time": times[rank, s], "records": _records(rank, s, 0.0003 * rank)}
         for s in (7, 8)]
        for rank in (0, 1)
    ]  # fmt: skip


def test_trace_has_one_slice_per_recorded_action(tmp_path: Path) -> None:
    recent = _recent()
    written = write_run_timeline(tmp_path, recent, step_time_s=0.0042, bubble=0.25)
    trace = json.loads((tmp_path / "trace.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    expected = []
    for rank, steps in enumerate(recent):
        for k, entry in enumerate(steps):
            offset = 0.005 * k  # the slowest rank's step 7
            expected += [
                (rank, r["label"], entry["step"], pytest.approx((r["start"] + offset) * 1e6),
                 pytest.approx((r["end"] - r["start"]) * 1e6))
                for r in entry["records"]
            ]  # fmt: skip
    got = [(e["pid"], e["name"], e["args"]["step"], e["ts"], e["dur"]) for e in slices]
    assert sorted(got, key=str) == sorted(expected, key=str)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"
             and e["name"] == "process_name"}  # fmt: skip
    assert names == {0: "rank 0", 1: "rank 1"}
    assert trace["otherData"]["steps"] == [7, 8]
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed: no timeline.png")
    png = tmp_path / "timeline.png"
    assert png in written and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_drawn_spans_keep_waits_and_leave_out_receives() -> None:
    spans = run_spans(_recent(), waits=True, receives=False)
    assert not any("RECV" in s.label for s in spans)
    waits = [s for s in spans if s.kind == "wait"]
    assert len(waits) == 4  # one B per rank and step waited
    assert all(w.end - w.start == pytest.approx(0.0002) for w in waits)


def test_tensorboard_scalars(tmp_path: Path) -> None:
    if importlib.util.find_spec("tensorboard") is None:
        pytest.skip("tensorboard is not installed (pip install 'plait[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    setup(-1, 0)
    steps, times, losses = 3, [0.02, 0.01, 0.04], [4.0, 3.5, 3.25]
    tb = tmp_path / "tb"
    log = _run(tmp_path, steps, times, losses, tensorboard=str(tb))
    log.metrics(2, {"val_loss": 3.0})
    records = [_records(0, 2, 0.0), _records(1, 2, 0.0)]
    log.finish(one_f_one_b(num_stages=2, num_microbatches=4), times, records, "", 0)
    events = EventAccumulator(str(tb))
    events.Reload()
    scalars = {t: [(e.step, e.value) for e in events.Scalars(t)] for t in events.Tags()["scalars"]}
    assert scalars["loss"] == [(i, pytest.approx(x)) for i, x in enumerate(losses)]
    assert scalars["step_time_s"] == [(i, pytest.approx(x)) for i, x in enumerate(times)]
    assert scalars["tokens_per_s"] == [(i, pytest.approx(512 / x)) for i, x in enumerate(times)]
    assert scalars["val_loss"] == [(2, 3.0)]
    assert scalars["lr"] == [(i, pytest.approx(_lr(i))) for i in range(steps)]
    assert scalars["grad_norm"] == [(i, 1.0) for i in range(steps)]
    assert scalars["peak_memory_bytes"] == [(i, _peak(i)) for i in range(steps)]


def test_counters_continue_after_a_resume_and_a_restarted_stream(tmp_path: Path) -> None:
    """A run resumed at step 4 (its engine numbers micro-batches from 0 again) logs steps,
    loss steps and updates from 4 on; a stream restarted at step 6 (after a save) too."""
    setup(-1, 0)
    cfg = load_config(**SMALL, max_steps=8)
    first = RunLogger(tmp_path, cfg, group=4)
    for step in range(5):  # an attempt that died after step 4; the checkpoint holds 4 steps
        first.step(step, _report(5.0 - step, step), 0.01)
    first.metrics_file.close()
    first.update_log.close()
    log = RunLogger(tmp_path, cfg, group=4, start=4)
    for step in range(4, 8):
        engine_step = step - 4 if step < 6 else step - 6  # ids from 0 again at 4 and at 6
        if step == 6:
            log.restarted(6)
        log.step(step, _report(5.0 - step, engine_step), 0.01)
    log.metrics_file.close()
    log.update_log.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss_step"], r["loss"]) for r in rows] == [
        (s, s, 5.0 - s) for s in range(8)
    ]
    updates = [json.loads(x) for x in (tmp_path / "updates.jsonl").read_text().splitlines()]
    assert [(u["update"], u["step"], u["loss"]) for u in updates] == [
        (s, s, 5.0 - s) for s in range(8)
    ]


def _wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The history rows of an offline W&B run file once its writer (W&B's own service
    process, which may lag behind `finish`) has written the run's exit record."""
    import time

    for _ in range(120):
        rows, ended = _wandb_records(run_dir)
        if ended:
            return rows
        time.sleep(0.5)
    raise AssertionError("the W&B run file never got its exit record")


def _wandb_records(run_dir: Path) -> tuple[list[dict[str, Any]], bool]:
    """(history rows, whether the exit record is there) of an offline W&B run file, read
    with W&B's own protobuf records: the file is a log of 32 KiB blocks of (crc32, length,
    type) framed records after a 7-byte header (the leveldb log format)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, block, pending, rows = path.read_bytes(), 7, 32768, b"", []
    ended = False
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (kind == 0 and length == 0) or pos + 7 + length > len(data):  # end, or mid-write
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            ended = ended or record.WhichOneof("record_type") == "exit"
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                             for i in items})  # fmt: skip
    return rows, ended


def test_wandb_offline_gets_the_metrics_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    setup(-1, 0)
    steps, times, losses = 3, [0.02, 0.01, 0.04], [4.0, 3.5, 3.25]
    log = _run(tmp_path, steps, times, losses, wandb="plait-test")
    records = [_records(0, 2, 0.0), _records(1, 2, 0.0)]
    log.finish(one_f_one_b(num_stages=2, num_microbatches=4), times, records, "", 0)
    rows = [r for r in _wandb_history(tmp_path) if "loss" in r]
    assert [r["_step"] for r in rows] == list(range(steps))
    assert [r["loss"] for r in rows] == losses
    assert [r["lr"] for r in rows] == [_lr(i) for i in range(steps)]
    assert [r["peak_memory_bytes"] for r in rows] == [_peak(i) for i in range(steps)]
    assert all(r["grad_norm"] == 1.0 for r in rows)


def test_the_summary_records_versions_commit_host_and_device(tmp_path: Path) -> None:
    import platform
    import socket
    import subprocess

    import torch

    from plait.train.environment import git_commit, run_environment

    env = run_environment(torch.device("cpu"))
    assert env["versions"]["torch"] == torch.__version__
    assert env["versions"]["python"] == platform.python_version()
    assert env["host"] == socket.gethostname() and env["device"].startswith("cpu")
    assert git_commit(tmp_path) is None  # not a checkout
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f").write_text("x")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "m"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert git_commit(tmp_path) == head.strip()
    (tmp_path / "f").write_text("y")
    assert git_commit(tmp_path) == head.strip() + "-dirty"


def test_bad_logging_options_are_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="verbosity=2"):
        load_config(**SMALL, verbosity=2)
    with pytest.raises(ValueError, match="profile_steps='5'"):
        load_config(**SMALL, profile_steps="5")
    with pytest.raises(ValueError, match="profile_steps='7:5'"):
        load_config(**SMALL, profile_steps="7:5")
    with pytest.raises(ValueError, match="ends after max_steps=10"):
        load_config(**SMALL, max_steps=10, profile_steps="8:12")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name)
    )
    with pytest.raises(ValueError, match=r"pip install 'plait\[tensorboard\]'"):
        load_config(**SMALL, tensorboard="tb")


def test_the_measured_bubble_counts_idle_time_within_the_pipelined_compute() -> None:
    from plait.train.logs import _measured_bubble

    def rec(label: str, start: float, end: float) -> dict[str, object]:
        return {"label": label, "start": start, "end": end}

    # one stage: forward, backward, then a long optimizer step — no bubble at all
    alone = [[rec("0F0", 0.0, 1.0), rec("0B0", 1.0, 3.0), rec("0UPDATE0v1", 3.0, 9.0)]]
    assert _measured_bubble(alone) == 0.0
    # two stages, one micro-batch: rank 1 waits 1 for the forward, rank 0 waits 3 for the
    # backward; compute spans 0..6 on each of 2 ranks, 6 of the 12 rank-seconds are busy
    two = [
        [rec("0F0", 0.0, 1.0), rec("0RECV_B0", 1.0, 4.0), rec("0B0", 4.0, 6.0)],
        [rec("1F0", 1.0, 2.0), rec("1B0", 2.0, 4.0), rec("1UPDATE0v1", 4.0, 8.0)],
    ]
    assert _measured_bubble(two) == 1.0 - 6.0 / 12.0
