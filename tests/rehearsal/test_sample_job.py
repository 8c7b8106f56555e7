"""The rehearsal's sample job: its pace only stretches the run, and a hurry file ends the pacing."""

from __future__ import annotations

from pathlib import Path

import pytest

from rehearsal import sample_job


def test_a_hurry_file_stops_the_pacing_and_keeps_the_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the job paced, and a hurry file put in its work dir after its fifth step's pause
    monkeypatch.chdir(tmp_path)
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 5:
            Path("HURRY").write_text("hurry\n")

    monkeypatch.setattr(sample_job.time, "sleep", sleep)

    # When it runs
    result = sample_job.run(2, 40, 0.02, hurry_file="HURRY")

    # Then it paced those five steps only, and its result is the unpaced run's
    assert slept == [0.02] * 5
    assert result == sample_job.run(2, 40, 0.0)
