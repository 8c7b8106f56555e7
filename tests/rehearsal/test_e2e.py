"""End to end: a real job, real CRIU, the shipped handlers and ASL, two successive interruptions."""

import pytest

pytestmark = [
    pytest.mark.claim("The result equals an uninterrupted run's"),
    pytest.mark.claim("Nothing left allocated"),
]


@pytest.mark.e2e
@pytest.mark.criu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("storage", ["s3", "ebs"])
def test_a_job_interrupted_twice_ends_with_the_uninterrupted_result(storage, rehearse):
    # Given a 32 MiB job that runs about a minute, with periodic dumps every 10 s
    rehearsal, lines = rehearse(storage=storage, size_mb=32, steps=4000, interruptions=2)
    # When its primary is interrupted, and then its backup
    outcome = rehearsal.run()  # fails if anything but the checkpoints is left (the leak check)
    # Then it was restored twice and finished with the same result as a run that was never interrupted
    assert len(outcome.recoveries_s) == 2, "\n".join(lines)
    assert outcome.result == outcome.expected, "\n".join(lines)
    assert outcome.timeline_png.stat().st_size > 0
    # And every VM got commands only after its SSM agent registered, and reported its boot-to-ready time
    instances = set(rehearsal.cloud.vms)
    assert {row["InstanceId"] for row in rehearsal.cloud.managed_instances.describe([])} == instances
    assert set(rehearsal.watcher.boot_to_ready_s) == instances
    # And the agents' S3 credentials came from the store-credentials URL, for their own job only (on S3 storage
    # every VM uses the store; on EBS only the VM where the job ends, to commit its result)
    granted = set(rehearsal.cloud.store_credentials_granted)
    assert granted == instances if storage == "s3" else granted and granted <= instances, granted
