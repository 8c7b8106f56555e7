"""`make demo ARGS="... --missed-warning"`: the notice is lost, so the backup restores the newest periodic checkpoint.

A job that appends to a file in shared storage (efs, fsx) keeps what it wrote after that checkpoint there: resumed
from the checkpoint it writes those lines again (O_APPEND: CRIU checks no size), so its result differs, as the
README's "What survives a checkpoint" says.
"""

import pytest

from rehearsal.__main__ import parse

LINES = 600
# One line a step into a file on the shared storage, opened for appending; at the end the file is the result.
APPEND_TO_SHARED = (
    "python3 -c \"[f:=open('/mnt/spotcr/appended.log','a'),[(f.write(str(i)+chr(10)),f.flush(),"
    f"__import__('time').sleep(0.05)) for i in range({LINES})],open('out.txt','w').write(open(f.name).read())]\""
)


def test_the_option_loses_the_notice():
    assert parse(["--missed-warning"]).missed_warning is True
    assert parse([]).missed_warning is False


def test_an_interruption_may_wait_for_more_than_one_periodic_checkpoint():
    assert parse([]).checkpoints_before_interruption == 1
    assert parse(["--checkpoints-before", "2"]).checkpoints_before_interruption == 2
    with pytest.raises(SystemExit):
        parse(["--checkpoints-before", "0"])


@pytest.mark.e2e
@pytest.mark.criu
@pytest.mark.timeout(400)
@pytest.mark.parametrize("storage", ["efs", "fsx"])
def test_a_job_appending_to_shared_storage_repeats_lines_after_a_missed_warning(storage, rehearse):
    # Given a job that appends a line a step to a file on shared storage, and an interruption whose notice is lost
    rehearsal, lines = rehearse(
        storage=storage,
        command=APPEND_TO_SHARED,
        result_file="out.txt",
        missed_warning=True,
        timeout_s=120.0,
        timeline_png=False,
    )

    # When it is rehearsed
    outcome = rehearsal.run()

    # Then the backup restored the newest periodic checkpoint (no final dump was taken)
    assert outcome.final_dumps == [], "\n".join(lines)
    assert outcome.restored_from == outcome.newest_periodic
    assert all(outcome.restored_from)
    # And the lines written after that checkpoint are in the file twice: the result differs from the uninterrupted run
    expected = outcome.expected.decode().splitlines()
    result = outcome.result.decode().splitlines()
    assert expected == [str(i) for i in range(LINES)]
    assert not outcome.identical
    assert sorted(set(result), key=int) == expected
    assert len(result) > len(expected)
