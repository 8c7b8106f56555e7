"""The deadline plan: the final dump's time predicted from periodic dumps' figures, and the interval that fits.

The samples are figures recorded on this project's 2-core machine (recorded/deadline_samples.json): a periodic
dump of a 1 GiB bench/memjob.py job into a directory store on local disk, and the next one, 5% of memory rewritten.
"""

import json
import math
from pathlib import Path
from typing import ClassVar

import pytest
from spotcr_agent import agent as agent_module
from spotcr_agent import deadline
from spotcr_agent.checkpoint import CheckpointOutcome
from spotcr_agent.deadline import GiB, Rates, Sample, plan

from .conftest import make_agent, make_config

RECORDED = Path(__file__).parent / "recorded" / "deadline_samples.json"


def recorded() -> list[Sample]:
    return [Sample.from_json(s) for s in json.loads(RECORDED.read_text())["samples"]]


def scaled(samples: list[Sample], factor: float) -> list[Sample]:
    """The same job, `factor` times the memory, at the same rates."""
    out = []
    for s in samples:
        out.append(
            Sample(
                checkpoint_id=s.checkpoint_id,
                bytes_total=int(s.bytes_total * factor),
                bytes_new=int(s.bytes_new * factor),
                bytes_changed=int(s.bytes_changed * factor),
                since_parent_s=s.since_parent_s,
                criu_s=s.criu_s * factor,
                store_s=s.store_s * factor,
                read_s=s.read_s * factor,
                hash_s=s.hash_s * factor,
                compress_s=s.compress_s * factor,
                upload_s=s.upload_s * factor,
            )
        )
    return out


def test_rates_come_from_the_recorded_dumps():
    # Given the recorded periodic dumps
    samples = recorded()
    rates = Rates.of(samples)

    # Then CRIU's rate is bytes over CRIU's seconds (the slowest dump), and the dirty rate is the changed share
    # of the second dump over the time since the first
    assert rates is not None
    assert rates.criu_bps == pytest.approx(min(s.bytes_total / s.criu_s for s in samples))
    second = samples[1]
    assert rates.dirty_per_s == pytest.approx(second.bytes_changed / second.bytes_total / second.since_parent_s)
    assert rates.periodic_s == max(s.criu_s + s.store_s for s in samples)
    # And the store's wall time is split between reading every byte and sending the new ones
    scan, send = second.split_store()
    assert scan + send == pytest.approx(second.store_s)
    assert 0 < send < second.store_s


def test_a_job_that_fits_keeps_its_own_interval():
    # Given a 1 GiB job's recorded dumps and a five-minute interval
    result = plan(recorded(), interval_s=300)

    # Then its interval stays, and the prediction is within the notice less the default margin
    assert result is not None and result.fits
    assert result.interval_s == 300 and result.reason == ""
    assert result.budget_s == deadline.AWS_NOTICE_S - deadline.DEFAULT_MARGIN_S
    assert result.predicted_final_s <= result.budget_s


def test_a_job_that_would_miss_the_notice_at_its_interval_gets_the_longest_interval_that_fits():
    # Given the same rates for a job half as large again, checkpointed once an hour
    samples = scaled(recorded(), 1.5)
    rates = Rates.of(samples)
    assert rates is not None
    memory = samples[-1].bytes_total
    budget = deadline.AWS_NOTICE_S - deadline.DEFAULT_MARGIN_S
    assert rates.worst_final_dump_s(memory, 3600) > budget

    # When the agent plans
    result = plan(samples, interval_s=3600)

    # Then the interval is the longest whose worst final dump fits, and the reason names both intervals
    assert result is not None and result.fits
    assert deadline.SHORTEST_INTERVAL_S <= result.interval_s < 3600
    assert rates.worst_final_dump_s(memory, result.interval_s) <= budget
    assert rates.worst_final_dump_s(memory, result.interval_s + 1) > budget
    assert f"every {result.interval_s} s instead of 3600 s" in result.reason


def test_a_job_too_large_for_the_notice_at_any_interval_is_said_to_be_at_risk_with_the_figures():
    # Given the same rates for a job 200 times the size (reading it all takes longer than the notice)
    result = plan(scaled(recorded(), 200), interval_s=300)

    # Then the plan asks for the shortest interval all the same and says why it cannot fit
    assert result is not None and not result.fits
    assert result.interval_s == deadline.SHORTEST_INTERVAL_S
    assert result.predicted_final_s > result.budget_s
    assert "cannot fit the notice" in result.reason and "GiB" in result.reason and "MiB/s" in result.reason


def test_a_larger_margin_shortens_the_interval():
    samples = scaled(recorded(), 1.5)
    loose = plan(samples, interval_s=3600, margin_s=10)
    tight = plan(samples, interval_s=3600, margin_s=25)
    assert loose is not None and tight is not None
    assert tight.interval_s < loose.interval_s


def test_before_a_second_periodic_dump_the_whole_memory_counts_as_changed():
    # Given only the first periodic dump (no parent: the dirty rate is not measured yet)
    first = recorded()[:1]
    rates = Rates.of(first)
    assert rates is not None and rates.dirty_per_s is None

    # Then a final dump is predicted to send everything, whatever the interval
    memory = first[0].bytes_total
    assert rates.changed_share(60) == rates.changed_share(3600) == 1.0
    assert rates.worst_final_dump_s(memory, 60) == pytest.approx(rates.worst_final_dump_s(memory, 3600))


def test_a_notice_during_a_periodic_dump_waits_for_it():
    # Given a job that barely dirties memory: the worst moment is a notice as a periodic dump starts
    samples = recorded()
    quiet = [Sample.from_json({**s.to_json(), "bytes_changed": 1}) for s in samples]
    rates = Rates.of(quiet)
    assert rates is not None
    memory = quiet[-1].bytes_total
    during = rates.periodic_s + rates.final_dump_s(memory, rates.changed_share(rates.periodic_s))
    assert rates.worst_final_dump_s(memory, 60) == pytest.approx(during)


def test_a_final_dump_is_not_begun_only_when_even_its_least_time_exceeds_what_the_notice_has_left():
    # Given the recorded periodic dumps, 8 times the memory, and the least a final dump of it can take: every
    # stage at the fastest rate measured, overlapped, the slowest dirtying since the last freeze
    samples = scaled(recorded(), 8)
    memory = samples[-1].bytes_total
    criu = memory / max(s.bytes_total / s.criu_s for s in samples)
    scan = memory / max(s.bytes_total / s.split_store()[0] for s in samples)
    least = max(criu, scan)  # right after a freeze nothing is counted as changed
    assert least > 0

    # Then with less time left than that it is refused, with the figures, and with as much it may begin
    why = deadline.cannot_fit(samples, since_freeze_s=0, seconds_left=least * 0.9)
    assert why.startswith(f"the final dump cannot fit the {least * 0.9:.1f} s the notice has left")
    assert f"at least {least:.1f} s" in why and f"{memory / GiB:.2f} GiB" in why
    assert deadline.cannot_fit(samples, since_freeze_s=0, seconds_left=least * 1.01) == ""
    # And the longer since the last freeze, the more it must send: a notice that fits right after a periodic dump
    # does not fit an hour later
    assert deadline.cannot_fit(samples, since_freeze_s=3600, seconds_left=least * 1.01) != ""
    # And with nothing measured yet, nothing is refused
    assert deadline.cannot_fit([], since_freeze_s=0, seconds_left=0) == ""


def test_a_dirty_rate_the_job_is_known_to_have_reached_is_not_undercut_by_a_slower_one():
    # Given the recorded periodic dumps, 8 times the memory, and a notice 10 s after the last freeze with time
    # left for all but sending: the slowest dirtying they measured changes too little in 10 s to matter
    samples = scaled(recorded(), 8)
    memory = samples[-1].bytes_total
    slowest = min(s.bytes_changed / s.bytes_total / s.since_parent_s for s in samples if s.since_parent_s > 0)
    send = memory / max(s.bytes_new / s.split_store()[1] for s in samples if s.bytes_new > 0)
    left = 1.2 * max(memory / max(s.bytes_total / s.criu_s for s in samples), slowest * 10 * send)
    assert deadline.cannot_fit(samples, since_freeze_s=10, seconds_left=left) == ""
    # and a stopped commit's rate, slower still, changes nothing
    assert deadline.cannot_fit(samples, since_freeze_s=10, seconds_left=left, dirty_seen=[slowest / 2]) == ""
    # When the job is known to have changed all of its memory since (memsample.py: 10 s at 10% a second)
    why = deadline.cannot_fit(
        samples, since_freeze_s=10, seconds_left=left, dirty_seen=[slowest / 2], dirty_at_least=0.1
    )
    # Then the final dump counts all of it to send, and is not begun
    assert "sending the 100% changed since the last checkpoint" in why


def test_the_largest_memory_that_fits_is_where_the_prediction_meets_the_budget():
    rates = Rates.of(recorded())
    assert rates is not None
    for share in (0.01, 0.05, 0.2, 1.0):
        largest = rates.largest_memory(90, share)
        assert rates.final_dump_s(largest, share) == pytest.approx(90)
        assert largest > GiB  # the recorded job (1 GiB) fits the budget many times over


def test_the_agent_records_its_periodic_dumps_and_reports_the_plan(tmp_path, publisher, monkeypatch):
    # Given an agent whose checkpoints return the recorded figures (a fake Checkpointer: no CRIU here)
    samples = recorded()
    outcomes = [_outcome(samples[0], parent=None), _outcome(samples[1], parent=samples[0].checkpoint_id)]
    monkeypatch.setattr(agent_module, "Checkpointer", _FakeCheckpointer.returning(outcomes))
    agent = make_agent(make_config(tmp_path, interval_s=300), publisher)

    # When two periodic dumps are taken
    agent.checkpoint("periodic", 1)
    agent.checkpoint("periodic", 1)

    # Then both are kept in the state, the second with the time since the first, and the event carries the plan
    kept = [Sample.from_json(s) for s in agent.state.read().dump_samples]
    assert [s.checkpoint_id for s in kept] == [s.checkpoint_id for s in samples]
    assert kept[0].since_parent_s == 0
    assert kept[1].since_parent_s == pytest.approx(samples[1].since_parent_s)
    completed = publisher.of("CheckpointCompleted")[-1]
    expected = plan(kept, interval_s=300)
    assert expected is not None
    assert (completed.next_interval_s, completed.predicted_final_seconds) == (300, expected.predicted_final_s)
    assert completed.deadline_risk == "" and publisher.of("FinalDumpAtRisk") == []


def test_the_agent_says_when_the_final_dump_cannot_fit(tmp_path, publisher, monkeypatch):
    # Given a periodic dump of a job far too large for the notice at these rates
    big = scaled(recorded(), 200)
    monkeypatch.setattr(agent_module, "Checkpointer", _FakeCheckpointer.returning([_outcome(big[0], parent=None)]))
    agent = make_agent(make_config(tmp_path), publisher)

    # When it is taken
    agent.checkpoint("periodic", 1)

    # Then the agent reports the risk, in the checkpoint's event and in its own
    completed = publisher.of("CheckpointCompleted")[-1]
    (risk,) = publisher.of("FinalDumpAtRisk")
    assert completed.deadline_risk == risk.reason and "cannot fit" in risk.reason
    assert risk.interval_s == completed.next_interval_s == deadline.SHORTEST_INTERVAL_S
    assert risk.predicted_final_seconds > risk.budget_seconds == 90
    assert risk.checkpoint_id == big[0].checkpoint_id


def test_a_restored_parent_does_not_count_as_the_previous_periodic_dump(tmp_path, publisher, monkeypatch):
    # Given a first periodic dump after a restore: its parent is the restored checkpoint, not one of this run's
    sample = recorded()[1]
    outcome = _outcome(sample, parent="1795293000000-g1-final")
    monkeypatch.setattr(agent_module, "Checkpointer", _FakeCheckpointer.returning([outcome]))
    agent = make_agent(make_config(tmp_path), publisher)

    # When it is taken
    agent.checkpoint("periodic", 1)

    # Then no dirty rate is derived from it (the job was stopped for part of that time)
    (kept,) = agent.state.read().dump_samples
    assert kept["since_parent_s"] == 0


def _outcome(sample: Sample, parent: str | None) -> CheckpointOutcome:
    return CheckpointOutcome(
        checkpoint_id=sample.checkpoint_id,
        kind="periodic",
        generation=1,
        seconds=round(sample.criu_s + sample.store_s, 3),
        frozen_seconds=sample.criu_s,
        bytes_total=sample.bytes_total,
        bytes_uploaded=sample.bytes_new // 2,
        parent=parent,
        criu_seconds=sample.criu_s,
        store_seconds=sample.store_s,
        bytes_new=sample.bytes_new,
        bytes_changed=sample.bytes_changed,
        read_seconds=sample.read_s,
        hash_seconds=sample.hash_s,
        compress_seconds=sample.compress_s,
        upload_seconds=sample.upload_s,
    )


class _FakeCheckpointer:
    """Stands in for the Checkpointer: returns the given outcomes in turn."""

    outcomes: ClassVar[list[CheckpointOutcome]] = []

    @classmethod
    def returning(cls, outcomes: list[CheckpointOutcome]) -> type["_FakeCheckpointer"]:
        return type("Fake", (cls,), {"outcomes": list(outcomes)})

    def __init__(self, **_: object) -> None:
        pass

    def checkpoint(self, kind: str, generation: int) -> CheckpointOutcome:
        return type(self).outcomes.pop(0)


def test_recorded_samples_are_consecutive():
    samples = recorded()
    assert len(samples) == 2
    first, second = samples
    assert math.isclose(
        second.since_parent_s,
        deadline.checkpoint_seconds(second.checkpoint_id) - deadline.checkpoint_seconds(first.checkpoint_id),
        abs_tol=0.01,
    )
