"""A failed checkpoint save as the one line a user reads: the operating system's error
found inside DCP's exception (which gathers every rank's), the step, the folder and the
remedy for that error."""

from __future__ import annotations

import errno
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from plait.checkpoint.store import SaveFailed, _saving_failed


def test_a_full_disk_inside_dcps_exception_reads_as_one_line_with_its_remedy() -> None:
    full = OSError(errno.ENOSPC, "No space left on device")
    err = CheckpointException("write", {0: (RuntimeError("other"), None), 1: (full, None)})
    failed = _saving_failed(err, 6, Path("runs/x/checkpoints"))
    assert isinstance(failed, SaveFailed) and isinstance(failed, Exception)
    assert str(failed) == (
        "OSError: [Errno 28] No space left on device while saving step 6 to "
        "runs/x/checkpoints: free space on that disk or lower --keep"
    )


def test_a_read_only_folder_and_an_unknown_error_name_their_remedy() -> None:
    ro = OSError(errno.EROFS, "Read-only file system")
    wrapped = RuntimeError("publishing failed")
    wrapped.__cause__ = ro
    said = str(_saving_failed(wrapped, 4, Path("r/checkpoints")))
    assert said.startswith("OSError: [Errno 30] Read-only file system while saving step 4")
    assert said.endswith("the folder is read-only: make it writable or give another --run-dir")
    other = str(_saving_failed(ValueError("bad state\nmore"), 2, Path("c")))
    assert other == "ValueError: bad state while saving step 2 to c: check that folder"


def test_a_peer_lost_during_a_save_is_not_blamed_on_the_folder() -> None:
    lost = RuntimeError("Connection closed by peer [127.0.0.1]:8087")
    said = str(_saving_failed(CheckpointException("write", {1: (lost, None)}), 8, Path("c")))
    assert said == (
        "RuntimeError: Connection closed by peer [127.0.0.1]:8087 while saving step 8 to c: "
        "a worker was lost or stalled meanwhile: see its error"
    )
