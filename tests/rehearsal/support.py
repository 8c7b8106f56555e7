"""The end-to-end tests' rehearsal, in one shape: a paced job checkpointed every 10 s, interrupted with an 8 s
notice, the scheduler ticking every 2 s, the run in the test's own directory; each test changes what it is about."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rehearsal.scenario import Options, Rehearsal

E2E: dict[str, Any] = {"pace_s": 0.015, "notice_s": 8.0, "interval_s": 10, "schedule_every_s": 2.0, "timeout_s": 90.0}


def e2e_rehearsal(runs_dir: Path, **changes: Any) -> tuple[Rehearsal, list[str]]:
    """The rehearsal, not started, and the lines it says (for the assertion messages)."""
    lines: list[str] = []
    options = Options(**{**E2E, "runs_dir": runs_dir, **changes})
    return Rehearsal(options, echo=lines.append), lines
