"""The end-to-end tests' rehearsal, in one shape: a paced job checkpointed every 10 s, interrupted with an 8 s
notice, the scheduler ticking every 2 s, the run in the test's own directory, the sample job unpaced once its
interruptions are over (Options.hurry_file); each test changes what it is about."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rehearsal import ssm_agent
from rehearsal.cloud import LocalCloud
from rehearsal.scenario import Options, Rehearsal
from rehearsal.timeline import Timeline

E2E: dict[str, Any] = {
    "pace_s": 0.015,
    "notice_s": 8.0,
    "interval_s": 10,
    "schedule_every_s": 2.0,
    "timeout_s": 90.0,
    "hurry_file": "HURRY",
}


def e2e_rehearsal(runs_dir: Path, **changes: Any) -> tuple[Rehearsal, list[str]]:
    """The rehearsal, not started, and the lines it says (for the assertion messages)."""
    lines: list[str] = []
    options = Options(**{**E2E, "runs_dir": runs_dir, **changes})
    return Rehearsal(options, echo=lines.append), lines


FAKE_AGENT = Path(__file__).with_name("fake_agent.py")


@pytest.fixture
def events() -> list[dict[str, Any]]:
    """The events the local cloud emits, in order."""
    return []


@pytest.fixture
def cloud(tmp_path: Path, events: list[dict[str, Any]]) -> Iterator[LocalCloud]:
    """The local cloud alone (no workflow), its VMs running the SSM agent stand-in and a fake agent."""
    local = LocalCloud(
        run_dir=tmp_path,
        timeline=Timeline(echo=None),
        schedule_every_s=0.5,
        on_event=events.append,
        # The VM's boot starts the SSM agent stand-in, as bootstrap.sh starts amazon-ssm-agent.
        boot_commands=[[sys.executable, "-m", ssm_agent.__name__], ["sleep", "infinity"]],
        agent_command=[sys.executable, str(FAKE_AGENT)],
        with_workflow=False,
    )
    local.start()
    yield local
    local.stop()
