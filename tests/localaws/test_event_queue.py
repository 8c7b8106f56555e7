"""Lambda's event queue in the local AWS: asynchronous invocations retried as AWS documents it."""

from __future__ import annotations

from typing import Any

import pytest

from rehearsal.localaws.awslambda import AsyncRetries, EventQueue, TooManyRequests


def _queue(outcomes: list[Exception | None], retries: AsyncRetries | None = None) -> tuple[EventQueue, list[float]]:
    """A queue whose function fails with each of `outcomes` in turn (None: it runs), and the waits it slept."""
    slept: list[float] = []

    def run(name: str, payload: Any) -> None:
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    return EventQueue(run, retries or AsyncRetries(), slept.append), slept


def test_a_throttled_event_is_tried_again_with_doubling_waits_until_it_runs() -> None:
    queue, slept = _queue([TooManyRequests("busy")] * 4 + [None])
    with queue:
        queue.submit("interruption", {})
    assert (slept, queue.dropped) == ([1.0, 2.0, 4.0, 8.0], [])


def test_a_throttled_event_is_dropped_past_its_maximum_age() -> None:
    queue, slept = _queue([TooManyRequests("busy")] * 100, AsyncRetries(max_age_s=10.0))
    with queue:
        queue.submit("interruption", {})
    assert slept == [1.0, 2.0, 4.0]
    assert queue.dropped == ["interruption: throttled for 7 s, past the event's maximum age"]


def test_a_failed_event_is_retried_twice_one_then_two_minutes_later_then_dropped() -> None:
    queue, slept = _queue([RuntimeError("boom")] * 3)
    with queue:
        queue.submit("command-result", {})
    assert slept == [60.0, 120.0]
    assert queue.errors_retried == 2
    assert queue.dropped == ["command-result: failed 3 times, last: RuntimeError: boom"]


def test_scaled_retries_shorten_every_wait() -> None:
    scaled = AsyncRetries().scaled(0.5)
    assert (scaled.throttle_first_s, scaled.throttle_max_s, scaled.error_waits_s) == (0.5, 150.0, (30.0, 60.0))
    with pytest.raises(ValueError, match="positive"):
        AsyncRetries().scaled(0)
