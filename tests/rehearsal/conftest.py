from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rehearsal.scenario import Rehearsal
from tests.rehearsal.support import cloud, e2e_rehearsal, events

__all__ = ["cloud", "events"]  # the local cloud alone, for test_local_cloud.py


@pytest.fixture
def rehearse(tmp_path: Path) -> Callable[..., tuple[Rehearsal, list[str]]]:
    """The e2e tests' rehearsal (tests/rehearsal/support.py) with the options a test changes, in its tmp_path."""

    def make(**changes: Any) -> tuple[Rehearsal, list[str]]:
        return e2e_rehearsal(tmp_path, **changes)

    return make
