"""The driver's progress lines under a launcher (output not a terminal)."""

import logging

import pytest

from splitrun.runtime.job import progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch, caplog) -> Clock:
    """A clock the test moves, progress lines logged as under a launcher."""
    clock = Clock()
    monkeypatch.setattr(progress.time, "perf_counter", clock)
    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: False, raising=False)
    caplog.set_level(logging.INFO, logger=progress.__name__)
    return clock


def test_a_line_at_the_first_step_then_every_few_seconds_and_at_the_last(clock, caplog):
    shown = progress.Progress(total=10)
    for step in range(10):
        clock.now += 0.5  # a step every half second: a line at most every 4 steps
        shown.update(step, loss=1.0)
    lines = [record.getMessage().split(" loss")[0] for record in caplog.records]
    assert lines == ["step 1/10", "step 5/10", "step 9/10", "step 10/10"]


def test_a_resumed_run_shows_its_first_step_at_once(clock, caplog):
    shown = progress.Progress(total=100)
    clock.now += 0.25
    shown.update(40, loss=None)
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage().startswith("step 41/100 ")
