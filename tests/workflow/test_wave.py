"""A wave of interruptions: twenty jobs warned within a second, recovered by one control plane at once."""

from __future__ import annotations

from spotcr_functions.models import Status

from rehearsal import wave
from rehearsal.controlplane import ControlPlane
from rehearsal.simagent import AgentTiming, SimulatedAgents

JOBS = 20


def test_a_wave_of_twenty_jobs_all_recover_once(plane: ControlPlane) -> None:
    # Given twenty running jobs whose VMs are simulated agents
    with SimulatedAgents(AgentTiming(dump_s=0.5, boot_s=0.2, restore_s=0.2)) as agents:
        instances = wave.register(plane, JOBS)

        # When every one of them is warned within a second
        result = wave.run_wave(plane, agents, instances, warn_within_s=1.0, timeout_s=120.0)

    # Then every job runs again on its one backup, from its final dump, and nothing else is left
    assert (result.failed, result.stuck, result.live_copies, result.leaks, result.agent_errors) == ({}, [], {}, [], [])
    assert sorted(result.recovered) == sorted(instances)
    for job_id, primary in instances.items():
        job = plane.job(job_id)
        assert (job.status, job.generation) == (Status.RUNNING, 1)
        assert agents.job(job_id).backups == [job.instance_id] != [primary]
        assert job.checkpoint_id and job.checkpoint_id.endswith("-final")
    assert len(plane.sent_commands("checkpoint", kind="final")) == JOBS
    assert len(result.to_final_dump_command) == len(result.to_running_again) == JOBS
