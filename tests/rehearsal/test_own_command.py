"""`make demo ARGS="--command '...' --result FILE"`: a user's own program through the whole rehearsal on bare VMs."""

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from rehearsal.__main__ import main, parse
from rehearsal.vm import REPO

# Not the sample job: a hash chain of 600 steps, 50 ms each, its result written to out.txt at the end.
# Written without shell syntax, as the spotcr:command tag requires.
CHAIN = (
    "__import__('pathlib').Path('out.txt').write_text(__import__('functools').reduce(lambda h, i: "
    "(__import__('time').sleep(0.05), __import__('hashlib').sha256((h + str(i)).encode()).hexdigest())[1], "
    "range(600), 'seed'))"
)
# The same length of work, but its result is the name of the VM it started on: an interruption changes it.
WHERE_IT_STARTED = (
    "__import__('pathlib').Path('out.txt').write_text(__import__('socket').gethostname() "
    "+ str(len([__import__('time').sleep(0.05) for i in range(600)])))"
)


def rehearse(tmp_path, capsys, command, *extra):
    argv = ["--command", command, "--result", "out.txt", "--notice", "8", "--schedule-every", "2"]
    argv += ["--timeout", "90", "--runs-dir", str(tmp_path), *extra]
    code = main(argv)
    return code, capsys.readouterr()


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["--command", "python3 job.py"], "--command needs --result"),
        (["--result", "out.txt"], "--result goes with --command"),
        (["--command", "python3 job.py", "--result", "o", "--size-mb", "8"], "--size-mb: only for the sample job"),
    ],
)
def test_the_command_line_refuses_what_it_cannot_rehearse(argv, complaint, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    assert exit_.value.code == 2
    assert complaint in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "result", "complaint"),
    [
        ("python3 job.py > out.txt", "out.txt", "spotcr:command: command uses shell syntax '>'"),
        ("python3 'job.py", "out.txt", "spotcr:command: command does not parse"),
        ("python3 job.py", "../out.txt", "--result '../out.txt': must be a path relative to the job's work dir"),
        ("python3 job.py", "/tmp/out.txt", "must be a path relative to the job's work dir"),
        ("x" * 300, "out.txt", "spotcr:command: value is 300 characters, at most 256"),
    ],
)
def test_a_command_the_tag_would_refuse_ends_with_2_and_the_reason(command, result, complaint, tmp_path, capsys):
    code = main(["--command", command, "--result", result, "--runs-dir", str(tmp_path)])
    assert code == 2
    assert complaint in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [], "nothing was started"


@pytest.mark.e2e
@pytest.mark.criu
@pytest.mark.timeout(300)
def test_a_users_own_command_interrupted_ends_with_the_uninterrupted_result(tmp_path, capsys):
    # Given a program that is not the sample job, as the user would tag it
    command = f'python3 -c "{CHAIN}"'
    # When it is rehearsed with an interruption, on S3 storage
    code, output = rehearse(tmp_path, capsys, command, "--storage", "s3")
    # Then its out.txt equals an uninterrupted run's, byte for byte, and the demo showed the VMs' addresses
    assert code == 0, output.out + output.err
    assert "OK: the interrupted job's out.txt equals the uninterrupted run's, byte for byte" in output.out
    assert output.out.count(" running at 198.") >= 2
    assert "uninterrupted reference run on a bare VM at 198." in output.out
    (run_dir,) = tmp_path.iterdir()
    assert (run_dir / "result").read_bytes() == (run_dir / "result.reference").read_bytes()
    assert len((run_dir / "result").read_bytes()) == 64


@pytest.mark.e2e
@pytest.mark.criu
@pytest.mark.timeout(300)
def test_a_result_that_depends_on_the_vm_is_reported_as_different(tmp_path, capsys):
    # Given a program whose result names the VM it started on
    command = f'python3 -c "{WHERE_IT_STARTED}"'
    # When it is rehearsed: the restored job keeps its first VM's name, the reference run has its own
    code, output = rehearse(tmp_path, capsys, command)
    # Then the rehearsal completes and says the results differ
    assert code == 1, output.out + output.err
    assert "MISMATCH: the interrupted job's out.txt" in output.err


@pytest.mark.e2e
@pytest.mark.criu
@pytest.mark.timeout(300)
def test_a_command_that_fails_ends_with_2_and_its_stderr(tmp_path, capsys):
    code, output = rehearse(tmp_path, capsys, "python3 -c \"raise SystemExit('no data set here')\"")
    assert code == 2, output.out + output.err
    assert "the job exited with 1" in output.err
    assert "no data set here" in output.err


@pytest.mark.e2e
@pytest.mark.criu
@pytest.mark.timeout(300)
def test_a_job_in_its_own_mount_namespace_restores_onto_the_backups_files(capsys):
    # Given a job that makes its own mount namespace, rehearsed where `make demo` puts its runs: not under /tmp, so
    # every VM's own file system is mounted where the other VMs could see it (a backup boots while its primary runs)
    (REPO / "rehearsal-runs").mkdir(exist_ok=True)
    runs = Path(tempfile.mkdtemp(prefix="own-mount-ns-", dir=REPO / "rehearsal-runs"))
    try:
        job = f"{REPO}/rehearsal/sample_job.py --mb 16 --steps 600 --pace 0.05 --result out.txt"
        command = f"unshare --mount --mount-proc {sys.executable} {job}"
        # When it is interrupted and restored
        code, output = rehearse(runs, capsys, command)
        # Then its writes after the restore land on the backup: the result is stored and equals the reference's
        assert code == 0, output.out + output.err
        assert "OK: the interrupted job's out.txt equals the uninterrupted run's, byte for byte" in output.out
    finally:
        shutil.rmtree(runs, ignore_errors=True)
