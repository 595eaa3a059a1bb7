"""A failing step fails its own requests, not the engine (offline engine, default model)."""

from __future__ import annotations

import pytest

from cenote.engine.core import _MAX_CONSECUTIVE_STEP_FAILURES
from cenote.errors import RequestFailedError, RequestRejectedError
from cenote.request import Request


class _FailingExecute:
    """Wraps ``ModelRunner.execute``: raises for the next ``times`` calls, then runs normally."""

    def __init__(self, runner, times: int) -> None:
        self.execute = runner.execute
        self.times = times

    def __call__(self, scheduler_output):
        if self.times > 0:
            self.times -= 1
            raise RuntimeError("injected kernel failure")
        return self.execute(scheduler_output)


@pytest.fixture
def llm(llm_fp32, monkeypatch):
    yield llm_fp32
    assert not llm_fp32.engine.has_unfinished_requests()
    assert llm_fp32.client.num_unfinished == 0


def test_failed_step_fails_its_requests_and_the_engine_goes_on(llm, monkeypatch):
    expected = llm.embed(["after the failure"])[0].outputs.data
    monkeypatch.setattr(llm.engine.runner, "execute", _FailingExecute(llm.engine.runner, 1))
    with pytest.raises(RequestFailedError, match="injected kernel failure"):
        llm.embed(["first", "second"])
    # the failed requests left nothing behind; the next request is served as before
    again = llm.embed(["after the failure"])[0].outputs.data
    assert (again == expected).all()


def test_repeated_step_failures_mean_the_core_is_broken(llm, monkeypatch):
    times = _MAX_CONSECUTIVE_STEP_FAILURES
    monkeypatch.setattr(llm.engine.runner, "execute", _FailingExecute(llm.engine.runner, times))
    for _ in range(times - 1):
        with pytest.raises(RequestFailedError):
            llm.embed(["x"])
    with pytest.raises(RuntimeError, match="injected kernel failure") as info:
        llm.embed(["x"])
    assert not isinstance(info.value, RequestFailedError)  # the core's own failure propagates
    llm.engine._consecutive_failures = 0
    assert llm.embed(["x"])[0].outputs.data.shape == (384,)


def test_a_request_id_already_in_the_engine_is_refused(llm):
    scheduler = llm.engine.scheduler
    first = Request("same", [101, 102], None, None)
    scheduler.add_request(first)
    try:
        with pytest.raises(ValueError, match="already in the engine"):
            scheduler.add_request(Request("same", [101, 102], None, None))
    finally:
        scheduler.finish_requests(["same"], first.status.FINISHED_ABORTED)


@pytest.mark.parametrize(
    ("raised", "error", "message"),
    [
        (ValueError("cannot take this one"), RequestRejectedError, "^cannot take this one$"),
        (
            TypeError("a core bug"),
            RequestFailedError,
            "failed in the engine: TypeError: a core bug",
        ),
    ],
)
def test_a_request_the_core_refuses_reaches_the_caller_with_its_cause(
    llm, monkeypatch, raised, error, message
):
    """The core's own refusal (a ValueError of add_request: the input's fault) keeps its
    message; anything else it raises is a failure naming the request. The requests of the
    same call already added are taken back (the fixture checks the engine is idle)."""
    add_request = llm.engine.add_request
    added = []

    def refuse_the_second(request):
        if added:
            raise raised
        added.append(request.request_id)
        add_request(request)

    monkeypatch.setattr(llm.engine, "add_request", refuse_the_second)
    with pytest.raises(error, match=message):
        llm.embed(["first", "second", "third"])
    assert len(added) == 1
