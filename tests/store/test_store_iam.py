"""On S3 the store signs with its vended session: the store role's grants, the run's session policy and the bucket's
policy (all from the synthesized template) bound it."""

from __future__ import annotations

from pathlib import Path

import pytest
from spotcr_agent.checkpoint import keep_criu_log
from spotcr_agent.store import CheckpointStore, StoreUnavailable

from rehearsal.iam import principals
from tests.localaws.vended import Enforced

from .support import JOB, RUN, checkpoint_id, images, meta

OTHER_JOB = "job-other"
EARLIER = "r-00000000000000e1"


def test_without_the_store_roles_put_grant_a_commit_is_refused_naming_it(s3_iam: Enforced, tmp_path: Path) -> None:
    # Given the store role as deployed but without s3:PutObject
    role = s3_iam.roles.store
    s3_iam.enforcer.roles = {role.arn: principals.without_grant(role.principal(), "s3:PutObject")}
    store = CheckpointStore.for_s3(s3_iam.bucket, JOB, session=s3_iam.store_session(JOB, RUN), run_id=RUN)
    # Then a commit fails as S3 refuses it, and IAM names the action
    with pytest.raises(StoreUnavailable, match="AccessDenied"):
        store.commit(images(tmp_path / "a", 1), meta(1))
    assert "s3:PutObject" in s3_iam.enforcer.denials[-1].reason


def test_a_session_vended_for_another_job_cannot_write_this_jobs_checkpoints(s3_iam: Enforced, tmp_path: Path) -> None:
    # Given a store of this job signing with the session vended to another job (its session tag and policy)
    store = CheckpointStore.for_s3(s3_iam.bucket, JOB, session=s3_iam.store_session(OTHER_JOB, RUN), run_id=RUN)
    # Then IAM refuses it: neither the store role (by the session's job tag) nor the session policy allows it
    with pytest.raises(StoreUnavailable, match="AccessDenied"):
        store.commit(images(tmp_path / "a", 1), meta(1))
    assert "(implicit deny)" in s3_iam.enforcer.denials[-1].reason


def test_the_bucket_policy_refuses_a_store_session_over_plain_http(s3_iam: Enforced, tmp_path: Path) -> None:
    # Given a store whose session the identity policies allow, but whose requests would travel without TLS
    session = s3_iam.store_session(JOB, RUN)
    s3_iam.enforcer.contexts[session.get_credentials().access_key] = {"aws:SecureTransport": False}
    store = CheckpointStore.for_s3(s3_iam.bucket, JOB, session=session, run_id=RUN)
    # Then the checkpoint bucket's own policy denies it, whatever the identity policies allow
    with pytest.raises(StoreUnavailable, match="AccessDenied"):
        store.commit(images(tmp_path / "a", 1), meta(1))
    assert "explicit deny" in s3_iam.enforcer.denials[-1].reason
    assert "resource policy" in s3_iam.enforcer.denials[-1].reason


def test_a_run_writes_its_own_store_and_prunes_an_earlier_run_but_no_run_writes_anothers_chunks(
    s3_iam: Enforced, tmp_path: Path
) -> None:
    # Given an ended run's checkpoint, and the name's new run, each store on the session vended for its run
    earlier = CheckpointStore.for_s3(s3_iam.bucket, JOB, session=s3_iam.store_session(JOB, EARLIER), run_id=EARLIER)
    earlier.commit(images(tmp_path / "a", 1), meta(1))
    later = CheckpointStore.for_s3(s3_iam.bucket, JOB, session=s3_iam.store_session(JOB, RUN), run_id=RUN)

    # When the new run commits, keeps a CRIU log, and deletes the earlier run's checkpoints as the agent does
    later.commit(images(tmp_path / "b", 2), meta(2))
    keep_criu_log(later, "dump", checkpoint_id(2), "criu said no")
    done = CheckpointStore(later.backend, JOB, run_id=EARLIER).delete_run()

    # Then IAM allowed all of it, the prune's sweep marker in the earlier run included
    assert done.deleted_checkpoints == [checkpoint_id(1)] and s3_iam.enforcer.denials == []
    # But the ended run's session (a zombie VM's) cannot write a chunk the new run restores
    with pytest.raises(StoreUnavailable, match="AccessDenied"):
        earlier.backend.put(f"jobs/{JOB}/runs/{RUN}/chunks/ab/abcd", b"not the chunk")
    assert "s3:PutObject" in s3_iam.enforcer.denials[-1].reason
