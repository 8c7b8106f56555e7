"""Waiting for a condition by polling: the control plane's waits and the tests' share it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T | None], what: str = "the condition", timeout: float = 30.0, interval: float = 0.05
) -> T:
    """Poll until `predicate` returns something true and return that; after `timeout` seconds, fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
