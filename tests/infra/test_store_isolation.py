"""Per-job isolation in the checkpoint bucket, read from the synthesized template and evaluated.

The job VMs' role holds nothing under jobs/; the store role allows only jobs/${aws:PrincipalTag/SpotcrJob}/,
only the store-credentials function may assume it, and only through its function URL may a job VM call that.
tests/infra/support.py's `allows` (Allow statements, `*`/`?` wildcards, policy variables,
StringLike/StringEquals/Bool; a missing key or variable matches nothing, as IAM evaluates them) checks what a
vended session may touch: the role's policy and the session policy store_access.session_policy, each alone and
together.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pytest
from spotcr_functions import store_access

from tests.infra.conftest import Synth
from tests.infra.support import allows, as_list

pytestmark = pytest.mark.claim("A run's store session reaches nothing of an earlier run's result")

BUCKET = "spotcr-checkpoints"
BUCKET_ARN = f"arn:aws:s3:::{BUCKET}"
OBJECT_ACTIONS = ("s3:GetObject", "s3:PutObject", "s3:DeleteObject")
REGION, ACCOUNT = "eu-west-1", "111122223333"
FILE_SYSTEM_ID = "fs-0123456789abcdef0"
FILE_SYSTEM_ARN = f"arn:aws:elasticfilesystem:{REGION}:{ACCOUNT}:file-system/{FILE_SYSTEM_ID}"


def _join(value: Any, resources: Mapping[str, Any]) -> Any:
    """Intrinsics resolved: the checkpoint bucket's Arn is BUCKET_ARN, other references keep their logical id."""
    if isinstance(value, list):
        return [_join(v, resources) for v in value]
    if not isinstance(value, dict):
        return value
    if "Fn::Join" in value:
        delimiter, items = value["Fn::Join"]
        return delimiter.join(str(_join(item, resources)) for item in items)
    if "Fn::GetAtt" in value:
        logical_id, attribute = value["Fn::GetAtt"]
        if resources[logical_id]["Type"] == "AWS::S3::Bucket" and logical_id.startswith("StorageCheckpoints"):
            return BUCKET_ARN
        if resources[logical_id]["Type"] == "AWS::EFS::FileSystem":
            return FILE_SYSTEM_ARN
        return f"<{logical_id}.{attribute}>"
    if "Ref" in value:
        return {"AWS::Partition": "aws", "AWS::Region": REGION, "AWS::AccountId": ACCOUNT}.get(
            value["Ref"], f"<{value['Ref']}>"
        )
    return {k: _join(v, resources) for k, v in value.items()}


def _policies_of(synth: Synth, role_prefix: str) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    resources = synth.resources
    [role_id] = [k for k, v in resources.items() if v["Type"] == "AWS::IAM::Role" and k.startswith(role_prefix)]
    statements = [
        statement
        for policy in resources.values()
        if policy["Type"] == "AWS::IAM::Policy" and {"Ref": role_id} in policy["Properties"]["Roles"]
        for statement in _join(policy["Properties"]["PolicyDocument"], resources)["Statement"]
    ]
    return role_id, resources[role_id]["Properties"], statements


def _session(job: str | None, prefix: str | None = None) -> dict[str, str]:
    context = {} if job is None else {f"aws:PrincipalTag/{store_access.SESSION_TAG}": job}
    if prefix is not None:
        context["s3:prefix"] = prefix
    return context


@pytest.fixture(scope="module")
def store_role(default_synth: Synth) -> list[dict[str, Any]]:
    return _policies_of(default_synth, "StoreAccessStoreRole")[2]


RUN = "r-0123456789abcdef"
EARLIER_RUN = "r-fedcba9876543210"
OWN = [
    f"{BUCKET_ARN}/jobs/render-42/runs/{RUN}/checkpoints/c1.json",
    f"{BUCKET_ARN}/jobs/render-42/runs/{RUN}/chunks/ab/abcd",
    f"{BUCKET_ARN}/jobs/render-42/runs/{RUN}/result/result.json",
    f"{BUCKET_ARN}/jobs/render-42/criu-logs/0001-dump-c1.log",  # the logs `spotcr logs` reads, of every run
    f"{BUCKET_ARN}/jobs/render-42/agent-logs/0001-dump-c1.log",
]
OTHERS = [
    f"{BUCKET_ARN}/jobs/render-43/checkpoints/c1.json",  # another job
    f"{BUCKET_ARN}/jobs/render-42-evil/chunks/ab/abcd",  # a job whose name starts with this one's
    f"{BUCKET_ARN}/jobs/render-4/x",
    f"{BUCKET_ARN}/specs/render-42.json",
    f"{BUCKET_ARN}/jobs/render-42",  # not under the prefix
    "arn:aws:s3:::another-bucket/jobs/render-42/x",
]


def _both(store_role: list[dict[str, Any]], action: str, resource: str, context: Mapping[str, str]) -> bool:
    session = store_access.session_policy("aws", BUCKET, RUN)["Statement"]
    return allows(store_role, action, resource, context) and allows(session, action, resource, context)


@pytest.mark.parametrize("action", OBJECT_ACTIONS)
def test_a_vended_session_touches_its_own_jobs_objects_only(store_role: list[dict[str, Any]], action: str) -> None:
    session = store_access.session_policy("aws", BUCKET, RUN)["Statement"]
    for resource in OWN:
        assert allows(store_role, action, resource, _session("render-42")), resource
        assert _both(store_role, action, resource, _session("render-42")), resource
    for resource in OTHERS:
        # Each policy alone already refuses: the role's by the session tag, the session policy by its prefix
        assert not allows(store_role, action, resource, _session("render-42")), resource
        assert not allows(session, action, resource, _session("render-42")), resource


@pytest.mark.parametrize("action", OBJECT_ACTIONS)
def test_a_runs_session_never_touches_an_earlier_runs_result(store_role: list[dict[str, Any]], action: str) -> None:
    # Given a run's session, and an earlier run of the same job name whose result is stored under its run
    session = store_access.session_policy("aws", BUCKET, RUN)["Statement"]
    earlier = f"{BUCKET_ARN}/jobs/render-42/runs/{EARLIER_RUN}/"
    # Then it reaches nothing of that run's result, nor the job's objects outside runs/
    for resource in (
        f"{earlier}result/result.json",
        f"{earlier}result/chunks/ab/abcd",
        f"{earlier}result/checkpoints/c1.json",
        f"{BUCKET_ARN}/jobs/render-42/checkpoints/c1.json",
        f"{BUCKET_ARN}/jobs/render-42/runs/r-0123/checkpoints/c1.json",
    ):
        assert not allows(session, action, resource, _session("render-42")), resource
    # And of the earlier run only the checkpoint state it left, which the new run prunes: it writes there only its
    # sweep marker, so no checkpoint, chunk or commit marker of another run is ever written
    for part in ("checkpoints/c1.json", "chunks/ab/abcd", "commits/c1", "sweeps/u1"):
        allowed = action != "s3:PutObject" or part.startswith("sweeps/")
        assert _both(store_role, action, f"{earlier}{part}", _session("render-42")) is allowed, part


def test_a_session_without_the_job_tag_touches_nothing(store_role: list[dict[str, Any]]) -> None:
    for action in OBJECT_ACTIONS:
        for resource in OWN + OTHERS:
            assert not allows(store_role, action, resource, _session(None))
    assert not allows(store_role, "s3:ListBucket", BUCKET_ARN, _session(None, "jobs/render-42/"))


def test_listing_is_limited_to_the_jobs_prefix(store_role: list[dict[str, Any]]) -> None:
    for prefix in ("jobs/render-42/", "jobs/render-42/chunks/"):
        assert _both(store_role, "s3:ListBucket", BUCKET_ARN, _session("render-42", prefix)), prefix
    for prefix in ("jobs/render-43/", "jobs/", "", "jobs/render-42-evil/", "specs/"):
        assert not allows(store_role, "s3:ListBucket", BUCKET_ARN, _session("render-42", prefix)), prefix
    # A listing without a prefix (the whole bucket) has no s3:prefix key: refused
    assert not allows(store_role, "s3:ListBucket", BUCKET_ARN, _session("render-42"))


def test_the_store_role_grants_nothing_else(store_role: list[dict[str, Any]]) -> None:
    actions = {action for statement in store_role for action in as_list(statement["Action"])}
    assert actions == {*OBJECT_ACTIONS, "s3:ListBucket"}


def test_only_the_store_credentials_function_may_assume_the_store_role(default_synth: Synth) -> None:
    _, properties, _ = _policies_of(default_synth, "StoreAccessStoreRole")
    [trust] = properties["AssumeRolePolicyDocument"]["Statement"]
    assert sorted(as_list(trust["Action"])) == ["sts:AssumeRole", "sts:TagSession"]
    principal, attribute = trust["Principal"]["AWS"]["Fn::GetAtt"]
    assert (attribute, default_synth.resources[principal]["Type"]) == ("Arn", "AWS::IAM::Role")
    assert principal.startswith("FunctionsstorecredentialsRole")
    assert properties["MaxSessionDuration"] == 3600


def test_the_job_role_holds_nothing_under_jobs_and_calls_the_url_only_through_it(default_synth: Synth) -> None:
    _, _, statements = _policies_of(default_synth, "VmLaunchJobRole")
    for resource in OWN + OTHERS[:3]:
        for action in (*OBJECT_ACTIONS, "s3:ListBucket"):
            assert not allows(statements, action, resource, {}), (action, resource)
    assert not allows(statements, "s3:ListBucket", BUCKET_ARN, {"s3:prefix": "jobs/render-42/"})
    url_call = {"lambda:FunctionUrlAuthType": "AWS_IAM", "lambda:InvokedViaFunctionUrl": "true"}
    [function_id] = [k for k in default_synth.of_type("AWS::Lambda::Function") if k.startswith("Functionsstorecred")]
    function = f"<{function_id}.Arn>"
    assert allows(statements, "lambda:InvokeFunctionUrl", function, url_call)
    assert allows(statements, "lambda:InvokeFunction", function, url_call)
    # A direct Invoke (not through the URL, so with an event the caller wrote) is not allowed
    assert not allows(statements, "lambda:InvokeFunction", function, {"lambda:InvokedViaFunctionUrl": "false"})
    [url] = default_synth.of_type("AWS::Lambda::Url").values()
    assert url["Properties"]["AuthType"] == "AWS_IAM"


# EFS (efs_isolation=true, the custom synth): a vended session mounts only through its own job's access point.
EFS_CLIENT_ACTIONS = store_access.EFS_CLIENT_ACTIONS
OWN_ACCESS_POINT = f"arn:aws:elasticfilesystem:{REGION}:{ACCOUNT}:access-point/fsap-0aaaaaaaaaaaaaaa1"
OTHER_ACCESS_POINT = f"arn:aws:elasticfilesystem:{REGION}:{ACCOUNT}:access-point/fsap-0bbbbbbbbbbbbbbb2"


def _mount(access_point: str | None, tls: bool = True) -> dict[str, str]:
    """The request context EFS evaluates for an NFS client (only these keys: see store_access)."""
    context = {"aws:SecureTransport": "true" if tls else "false"}
    if access_point is not None:
        context[store_access.ACCESS_POINT_KEY] = access_point
    return context


def denied_by(statements: Iterable[Mapping[str, Any]], action: str, context: Mapping[str, str]) -> bool:
    """Whether a Deny of the file system policy applies (Bool and Null, the operators it uses)."""
    for statement in statements:
        assert statement["Effect"] == "Deny" and statement["Principal"] == {"AWS": "*"}, statement
        if action not in as_list(statement["Action"]):
            continue
        holds = True
        for operator, tests in statement["Condition"].items():
            for key, expected in tests.items():
                if operator == "Null":
                    holds &= (key not in context) == (str(expected).lower() == "true")
                elif operator == "Bool":
                    holds &= key in context and context[key] == str(expected).lower()
                else:
                    raise AssertionError(f"the evaluator does not know {operator}")
        if holds:
            return True
    return False


@pytest.fixture(scope="module")
def efs_policies(custom_synth: Synth) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """The store role's statements, the vended session's (for render-42), the file system policy's."""
    store_role = _policies_of(custom_synth, "StoreAccessStoreRole")[2]
    session = store_access.session_policy(
        "aws", BUCKET, RUN, access_point_arn=OWN_ACCESS_POINT, file_system_id=FILE_SYSTEM_ID
    )["Statement"]
    [file_system] = custom_synth.of_type("AWS::EFS::FileSystem").values()
    return store_role, session, file_system["Properties"]["FileSystemPolicy"]["Statement"]


@pytest.mark.parametrize("action", EFS_CLIENT_ACTIONS)
def test_a_vended_session_mounts_its_own_jobs_access_point(efs_policies: Any, action: str) -> None:
    store_role, session, file_system = efs_policies
    context = _mount(OWN_ACCESS_POINT)
    assert allows(store_role, action, FILE_SYSTEM_ARN, context)
    assert allows(session, action, FILE_SYSTEM_ARN, context)
    assert not denied_by(file_system, action, context)


@pytest.mark.parametrize("action", EFS_CLIENT_ACTIONS)
def test_a_vended_session_never_reaches_another_jobs_access_point_or_the_root(efs_policies: Any, action: str) -> None:
    store_role, session, file_system = efs_policies
    # Another job's access point: the session policy names only its own (EFS enforces no principal-tag condition)
    assert not allows(session, action, FILE_SYSTEM_ARN, _mount(OTHER_ACCESS_POINT))
    # The file system's root (no access point): each of the three refuses on its own
    root = _mount(None)
    assert not allows(store_role, action, FILE_SYSTEM_ARN, root)
    assert not allows(session, action, FILE_SYSTEM_ARN, root)
    assert denied_by(file_system, action, root)
    # Another file system: neither allows it
    elsewhere = FILE_SYSTEM_ARN.replace(FILE_SYSTEM_ID, "fs-0ffffffffffffffff")
    assert not allows(store_role, action, elsewhere, _mount(OWN_ACCESS_POINT))
    assert not allows(session, action, elsewhere, _mount(OWN_ACCESS_POINT))


@pytest.mark.parametrize("action", EFS_CLIENT_ACTIONS)
def test_the_file_system_refuses_plain_nfs_and_connections_without_tls(efs_policies: Any, action: str) -> None:
    _, _, file_system = efs_policies
    # No statement allows anything: with a file system policy in effect EFS's default (anonymous full access) is
    # gone, so a client without IAM is refused; and every principal is denied without TLS, even at its access point
    assert all(statement["Effect"] == "Deny" for statement in file_system)
    assert denied_by(file_system, action, _mount(OWN_ACCESS_POINT, tls=False))


def test_without_efs_the_store_role_holds_no_efs_grant(store_role: list[dict[str, Any]], default_synth: Synth) -> None:
    actions = {action for statement in store_role for action in as_list(statement["Action"])}
    assert not {a for a in actions if a.startswith("elasticfilesystem:")}
    assert default_synth.of_type("AWS::EFS::FileSystem") == {}


def test_only_registering_and_ending_functions_manage_access_points(custom_synth: Synth) -> None:
    holders = set()
    for role_id in custom_synth.of_type("AWS::IAM::Role"):
        statements = _policies_of(custom_synth, role_id)[2] if role_id.startswith("Functions") else []
        for statement in statements:
            if any(str(a).startswith("elasticfilesystem:") for a in as_list(statement["Action"])):
                holders.add((role_id.split("Role")[0].removeprefix("Functions"), tuple(as_list(statement["Action"]))))
    creators = {name for name, actions in holders if "elasticfilesystem:CreateAccessPoint" in actions}
    deleters = {name for name, actions in holders if "elasticfilesystem:DeleteAccessPoint" in actions}
    assert creators == {"statechange", "tagchange", "agentevents"}
    # The scheduler closes the access point of a job it fails for never starting (jobs.time_out_pending), the
    # interruption function that of a job over several VMs it fails for a node warned after its restore was ordered
    # (recovery._nodes_lost), and the restore step that of a job its final-dump order found ended
    # (checkpoints.settle_final_dump)
    ended = {"failrecovery", "recoveryended", "commandresult", "scheduler", "interruption", "restorejob"}
    assert deleters == {"statechange", "tagchange", "agentevents", *ended}
