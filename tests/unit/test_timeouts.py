"""Timed waits without a process group: the text of a `PipelineTimeout`, which backend
errors become one, and that every wait of the transport gets the default timeout."""

from __future__ import annotations

import datetime
import inspect
from typing import Any

import pytest
import torch

from plait.parallel import GradReducer
from plait.runtime import DEFAULT_TIMEOUT_S, PipelineExecutor, PipelineTimeout
from plait.runtime.boundary import BoundaryMeta
from plait.runtime.channels import Channels
from plait.runtime.transport import Transport
from plait.schedule import Action, Op, build
from plait.schedule.lower import Batch, Message, lower
from plait.train.parallelize import parallelize
from plait.wait import PeerLost, named_timeout, timed_wait, timeout_message

# what gloo's Work.wait raises when a receive outlasts its timeout (torch 2.13)
GLOO_TIMEOUT = (
    "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation "
    "to complete"
)


class FakeWork:
    """A Work whose wait records its timeout and then raises `error` (or returns `done`)."""

    def __init__(self, error: Exception | None = None, done: bool = True) -> None:
        self.error, self.done = error, done
        self.timeouts: list[datetime.timedelta | None] = []

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.timeouts.append(timeout)
        if self.error is not None:
            raise self.error
        return self.done


def test_message_names_rank_action_peer_and_remedy() -> None:
    text = timeout_message("rank 0", "0B5", 30.0, "the gradients from rank 1 (stage 1)")
    assert text == (
        "rank 0: 0B5 waited 30 s for the gradients from rank 1 (stage 1); the peer may have "
        "failed or stalled: check its log; raise timeout_s if its steps are this slow"
    )
    several = timeout_message("rank 2", "REDUCE stage 1", 2.5, "the all-reduce", peers=3)
    assert several.endswith(
        "2.5 s for the all-reduce; a peer may have failed or stalled: check their logs; "
        "raise timeout_s if their steps are this slow"
    )


def test_only_a_timed_out_wait_becomes_a_pipeline_timeout() -> None:
    with pytest.raises(PipelineTimeout, match=r"^explained$") as info:
        timed_wait(FakeWork(RuntimeError(GLOO_TIMEOUT)), 2.0, lambda: "explained")
    assert isinstance(info.value, RuntimeError)
    assert isinstance(info.value.__cause__, RuntimeError)  # the backend's own words kept
    with pytest.raises(PipelineTimeout):  # gloo's collectives say it this way
        timed_wait(FakeWork(RuntimeError("Operation timed out!")), 2.0, lambda: "x")
    with pytest.raises(PipelineTimeout):  # a backend that returns False instead
        timed_wait(FakeWork(done=False), 2.0, lambda: "x")
    crashed = RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    said = timeout_message("rank 0", "0B1", 2.0, "the gradients from rank 1 (stage 1)")
    with pytest.raises(
        PeerLost,
        match=r"^rank 0: 0B1 lost the connection while waiting for "
        r"the gradients from rank 1 \(stage 1\) \(Connection closed",
    ) as lost:
        timed_wait(FakeWork(crashed), 2.0, lambda: said)  # fmt: skip
    assert lost.value.__cause__ is crashed  # the backend's own words kept
    wrong = RuntimeError("Tensors must be contiguous")
    with pytest.raises(RuntimeError) as other:  # not about a peer: kept as is
        timed_wait(FakeWork(wrong), 2.0, lambda: "x")
    assert other.value is wrong
    untimed = FakeWork()
    timed_wait(untimed, None, lambda: "x")
    assert untimed.timeouts == [None]


def _transport(monkeypatch: pytest.MonkeyPatch, works: list[FakeWork]) -> Transport:
    """A transport of rank 0 of a two-stage 1F1B whose sends and receives are `works`."""
    pending = iter(works)

    def fake(*_: Any, **__: Any) -> FakeWork:
        return next(pending)

    monkeypatch.setattr("torch.distributed.irecv", fake)
    monkeypatch.setattr("torch.distributed.isend", fake)
    channels = Channels({(0, 1): None, (1, 0): None}, (0, 1))  # type: ignore[dict-item]
    return Transport(build("1f1b", 2, 2), 0, channels)


def _message(action: Action) -> Message:
    schedule = build("1f1b", 2, 2)
    return next(s.batch for s in lower(schedule, 0, [action]).steps).messages[0]  # type: ignore[union-attr]


def test_receives_and_sends_wait_with_the_default_timeout_and_name_the_action(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    received, sent = FakeWork(), FakeWork(RuntimeError(GLOO_TIMEOUT))
    transport = _transport(monkeypatch, [received, sent])
    meta = BoundaryMeta.of(torch.zeros(2, 3))  # stage 1's input: stage 0's output
    transport.post(_message(Action(Op.RECV_B, 0, 1)), meta.empty_grads(torch.device("cpu")))
    (grads,), _ = transport.take((Op.RECV_B, 0, 1), Action(Op.B, 0, 1))
    assert grads.shape == (2, 3)
    assert received.timeouts == [datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)]
    send = _message(Action(Op.SEND_F, 0, 3))
    transport.send(Batch((send,), send.channel), [[torch.zeros(2, 3)]], window=0)
    with pytest.raises(PipelineTimeout) as info:
        transport.settle(0)
    assert str(info.value).startswith(
        "rank 0: 0SEND_F3 waited 300 s for rank 1 (stage 1) to receive the activations of "
        "stage 0; the peer may have failed"
    )


def test_a_timed_out_receive_names_its_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    transport = _transport(monkeypatch, [FakeWork(RuntimeError(GLOO_TIMEOUT))])
    transport.timeout_s = 30.0
    meta = BoundaryMeta.of(torch.zeros(2, 3))
    transport.post(_message(Action(Op.RECV_B, 0, 5)), meta.empty_grads(torch.device("cpu")))
    with pytest.raises(PipelineTimeout, match=r"^rank 0: 0B5 waited 30 s for the gradients "):
        transport.take((Op.RECV_B, 0, 5), Action(Op.B, 0, 5))


def test_the_default_timeout_is_documented_and_shared() -> None:
    assert DEFAULT_TIMEOUT_S == 300.0
    for api in (Transport, PipelineExecutor, GradReducer, parallelize):
        param = inspect.signature(api).parameters["timeout_s"]
        assert param.default == DEFAULT_TIMEOUT_S, api
        assert param.kind is inspect.Parameter.KEYWORD_ONLY, api
        assert "timeout_s" in (api.__doc__ or ""), f"{api.__name__} does not document it"
    for bad in (0.0, 1e-4, -1.0, float("nan")):  # torch reads under 1 ms as no timeout
        with pytest.raises(ValueError, match=r"at least 0\.001 seconds"):
            Transport(build("1f1b", 2, 2), 0, None, timeout_s=bad)


def test_a_blocking_collectives_bare_timeout_is_named() -> None:
    said = timeout_message("rank 2", "the clipped norm", None, "the other ranks' norms", peers=3)
    expired = pytest.raises(PipelineTimeout, match="rank 2: the clipped norm waited the process")
    with expired, named_timeout(lambda: said):
        raise RuntimeError("[x.cc:81] Timed out waiting 8000ms for recv operation")
    closed = pytest.raises(RuntimeError, match="Connection closed by peer")
    with closed, named_timeout(lambda: said):
        raise RuntimeError("Connection closed by peer")
