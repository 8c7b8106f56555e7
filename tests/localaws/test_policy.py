"""The local AWS's IAM evaluator decides as AWS's policy evaluation logic documents it."""

from __future__ import annotations

from typing import Any

import pytest

from rehearsal.iam.policy import ContextValue, Decision, PolicyError, Principal, Request, evaluate, evaluate_all

ROLE = "arn:aws:iam::111122223333:role/spotcr-tag-change"
INSTANCE = "arn:aws:ec2:eu-west-1:111122223333:instance/i-0123456789abcdef0"
BUCKET = "arn:aws:s3:::spotcr-checkpoints"


def policy(*statements: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"Version": "2012-10-17", "Statement": list(statements), **top}


def allow(action: str = "*", resource: str = "*", **elements: Any) -> dict[str, Any]:
    return {"Effect": "Allow", "Action": action, "Resource": resource, **elements}


def deny(action: str = "*", resource: str = "*", **elements: Any) -> dict[str, Any]:
    return {"Effect": "Deny", "Action": action, "Resource": resource, **elements}


def decide(statements: list[dict[str, Any]], request: Request, **principal: Any) -> Decision:
    return evaluate(Principal(ROLE, (policy(*statements),), **principal), request)


def holds(condition: dict[str, Any], context: dict[str, Any], **principal: Any) -> bool:
    return decide([allow(Condition=condition)], Request("s3:GetObject", "*", context), **principal).allowed


# Today's grant (infra/grants.py `_ec2_tag`) as synthesized before issue 21: written out, not read from grants.py.
TODAYS_EC2_TAG_GRANT = {
    "Action": "ec2:CreateTags",
    "Condition": {
        "StringLike": {"aws:ResourceTag/spotcr:job": "?*"},
        "ForAllValues:StringEquals": {"aws:TagKeys": ["spotcr:error"]},
    },
    "Effect": "Allow",
    "Resource": "arn:aws:ec2:*:*:instance/*",
}


def create_tags(*keys: str) -> Request:
    context: dict[str, ContextValue] = {"aws:ResourceTag/spotcr:job": "train-1", "aws:TagKeys": keys}
    context |= {f"aws:RequestTag/{k}": "v" for k in keys}
    return Request("ec2:CreateTags", INSTANCE, context)


def test_todays_tag_grant_denies_registering_a_job_instance_with_its_run_id() -> None:
    # jobs.register_instance tags the job's instance with spotcr:run (functions/spotcr_functions/jobs.py)
    decision = decide([TODAYS_EC2_TAG_GRANT], create_tags("spotcr:run"))
    assert not decision.allowed
    assert "no statement allows ec2:CreateTags" in decision.reason


def test_todays_tag_grant_allows_writing_the_error_tag_on_a_job_instance() -> None:
    assert decide([TODAYS_EC2_TAG_GRANT], create_tags("spotcr:error")).allowed


def test_todays_tag_grant_denies_the_error_tag_on_an_instance_without_a_job() -> None:
    request = Request("ec2:CreateTags", INSTANCE, {"aws:TagKeys": ("spotcr:error",)})
    assert not decide([TODAYS_EC2_TAG_GRANT], request).allowed


def test_an_allow_names_the_statement_that_allowed() -> None:
    decision = decide(
        [allow("s3:GetObject", f"{BUCKET}/*", Sid="ReadCheckpoints")], Request("s3:GetObject", f"{BUCKET}/k")
    )
    assert decision.allowed
    assert "'ReadCheckpoints'" in decision.reason


def test_nothing_is_allowed_without_a_matching_allow() -> None:
    decision = decide([allow("s3:GetObject", f"{BUCKET}/*")], Request("s3:PutObject", f"{BUCKET}/k"))
    assert decision == Decision(False, f"no statement allows s3:PutObject on {BUCKET}/k (implicit deny)")


def test_an_explicit_deny_wins_over_any_allow() -> None:
    statements = [allow(), deny("s3:Delete*", f"{BUCKET}/*", Sid="KeepCheckpoints")]
    decision = decide(statements, Request("s3:DeleteObject", f"{BUCKET}/jobs/a"))
    assert not decision.allowed
    assert "explicit deny" in decision.reason and "'KeepCheckpoints'" in decision.reason
    assert decide(statements, Request("s3:GetObject", f"{BUCKET}/jobs/a")).allowed


def test_actions_match_case_insensitively_with_wildcards() -> None:
    assert decide([allow("EC2:describe*")], Request("ec2:DescribeInstances", "*")).allowed
    assert decide([allow("ec2:?escribeInstances")], Request("ec2:DescribeInstances", "*")).allowed
    assert not decide([allow("ec2:Describe?")], Request("ec2:DescribeInstances", "*")).allowed


def test_not_action_allows_every_other_action() -> None:
    statement = {"Effect": "Allow", "NotAction": "iam:*", "Resource": "*"}
    assert decide([statement], Request("s3:GetObject", "*")).allowed
    assert not decide([statement], Request("iam:PassRole", "*")).allowed


def test_resources_match_case_sensitively_part_by_part() -> None:
    statement = allow("s3:GetObject", f"{BUCKET}/jobs/*")
    assert decide([statement], Request("s3:GetObject", f"{BUCKET}/jobs/a/b")).allowed
    assert not decide([statement], Request("s3:GetObject", f"{BUCKET}/JOBS/a")).allowed
    # a wildcard does not reach across the ARN's colon-separated parts
    spanning = allow("ec2:CreateTags", "arn:aws:ec2:*:instance/*")
    assert not decide([spanning], Request("ec2:CreateTags", INSTANCE)).allowed


def test_an_action_without_resource_level_permissions_needs_resource_star() -> None:
    assert decide([allow("ec2:DescribeInstances", "*")], Request("ec2:DescribeInstances", "*")).allowed
    scoped = allow("ec2:DescribeInstances", "arn:aws:ec2:*:*:instance/*")
    assert not decide([scoped], Request("ec2:DescribeInstances", "*")).allowed


def test_not_resource_allows_every_other_resource() -> None:
    statement = {"Effect": "Allow", "Action": "s3:GetObject", "NotResource": f"{BUCKET}/secrets/*"}
    assert decide([statement], Request("s3:GetObject", f"{BUCKET}/jobs/a")).allowed
    assert not decide([statement], Request("s3:GetObject", f"{BUCKET}/secrets/a")).allowed


def test_a_permissions_boundary_must_allow_too() -> None:
    boundary = policy(allow("s3:GetObject"))
    assert decide([allow()], Request("s3:GetObject", "*"), boundary=boundary).allowed
    decision = decide([allow()], Request("s3:PutObject", "*"), boundary=boundary)
    assert not decision.allowed and "permissions boundary" in decision.reason
    # a boundary alone grants nothing
    assert not decide([allow("s3:PutObject")], Request("s3:GetObject", "*"), boundary=boundary).allowed


def test_a_deny_in_the_permissions_boundary_denies() -> None:
    boundary = policy(allow(), deny("s3:GetObject"))
    assert not decide([allow()], Request("s3:GetObject", "*"), boundary=boundary).allowed


def test_a_session_policy_must_allow_too() -> None:
    sessions = (policy(allow("s3:GetObject", f"{BUCKET}/jobs/train-1/*")),)
    ok = Request("s3:GetObject", f"{BUCKET}/jobs/train-1/x")
    other = Request("s3:GetObject", f"{BUCKET}/jobs/train-2/x")
    assert decide([allow()], ok, session_policies=sessions).allowed
    decision = decide([allow()], other, session_policies=sessions)
    assert not decision.allowed and "session policy" in decision.reason


def test_every_request_of_a_call_must_be_allowed() -> None:
    principal = Principal(ROLE, (policy(allow("ec2:RunInstances")),))
    requests = [Request("ec2:RunInstances", INSTANCE), Request("ec2:CreateTags", INSTANCE)]
    decision = evaluate_all(principal, requests)
    assert not decision.allowed and "ec2:CreateTags" in decision.reason
    assert evaluate_all(principal, requests[:1]).allowed


def test_string_operators_compare_exactly_ignoring_case_or_with_wildcards() -> None:
    context = {"aws:ResourceTag/team": "Research"}
    assert holds({"StringEquals": {"aws:ResourceTag/team": "Research"}}, context)
    assert not holds({"StringEquals": {"aws:ResourceTag/team": "research"}}, context)
    assert holds({"StringNotEquals": {"aws:ResourceTag/team": "research"}}, context)
    assert holds({"StringEqualsIgnoreCase": {"aws:ResourceTag/team": "RESEARCH"}}, context)
    assert not holds({"StringNotEqualsIgnoreCase": {"aws:ResourceTag/team": "research"}}, context)
    assert holds({"StringLike": {"aws:ResourceTag/team": "Re*ch"}}, context)
    assert holds({"StringLike": {"aws:ResourceTag/team": "Re?earch"}}, context)
    assert not holds({"StringLike": {"aws:ResourceTag/team": "?"}}, context)
    assert holds({"StringNotLike": {"aws:ResourceTag/team": "Ops*"}}, context)
    # StringEquals has no wildcards
    assert not holds({"StringEquals": {"aws:ResourceTag/team": "Re*"}}, context)


def test_several_values_of_one_key_are_alternatives() -> None:
    assert holds(
        {"StringEquals": {"ec2:CreateAction": ["CreateVolume", "RunInstances"]}}, {"ec2:CreateAction": "RunInstances"}
    )


def test_several_keys_and_operators_must_all_hold() -> None:
    condition = {"StringEquals": {"a:x": "1", "a:y": "2"}, "StringLike": {"a:z": "z*"}}
    assert holds(condition, {"a:x": "1", "a:y": "2", "a:z": "zz"})
    assert not holds(condition, {"a:x": "1", "a:y": "2", "a:z": "q"})
    assert not holds(condition, {"a:x": "1", "a:z": "zz"})


def test_condition_keys_match_case_insensitively_tag_keys_included() -> None:
    assert holds({"StringEquals": {"AWS:ResourceTag/Spotcr:Job": "j"}}, {"aws:resourcetag/spotcr:job": "j"})


def test_numeric_operators_compare_numbers() -> None:
    context = {"s3:max-keys": "10"}
    assert holds({"NumericEquals": {"s3:max-keys": "10"}}, context)
    assert holds({"NumericNotEquals": {"s3:max-keys": "11"}}, context)
    assert holds({"NumericLessThan": {"s3:max-keys": "11"}}, context)
    assert holds({"NumericLessThanEquals": {"s3:max-keys": "10"}}, context)
    assert not holds({"NumericGreaterThan": {"s3:max-keys": "10"}}, context)
    assert holds({"NumericGreaterThanEquals": {"s3:max-keys": 10}}, context)
    assert not holds({"NumericEquals": {"s3:max-keys": "10"}}, {"s3:max-keys": "ten"})


def test_date_operators_compare_times_in_iso_or_epoch_form() -> None:
    context = {"aws:CurrentTime": "2026-11-26T12:00:00Z"}
    assert holds({"DateEquals": {"aws:CurrentTime": "2026-11-26T12:00:00+00:00"}}, context)
    assert holds({"DateNotEquals": {"aws:CurrentTime": "2026-11-26T12:00:01Z"}}, context)
    assert holds({"DateLessThan": {"aws:CurrentTime": "2027-01-01T00:00:00Z"}}, context)
    assert holds({"DateLessThanEquals": {"aws:CurrentTime": "2026-11-26T12:00:00Z"}}, context)
    assert not holds({"DateGreaterThan": {"aws:CurrentTime": "2027-01-01T00:00:00Z"}}, context)
    assert holds({"DateGreaterThanEquals": {"aws:CurrentTime": "1700000000"}}, context)


def test_bool_compares_true_and_false() -> None:
    assert holds({"Bool": {"aws:SecureTransport": "false"}}, {"aws:SecureTransport": False})
    assert not holds({"Bool": {"aws:SecureTransport": "false"}}, {"aws:SecureTransport": "true"})
    assert holds({"Bool": {"ec2:Encrypted": True}}, {"ec2:Encrypted": True})


def test_binary_equals_compares_base64_bytes() -> None:
    assert holds({"BinaryEquals": {"a:key": "QmluYXJ5"}}, {"a:key": "QmluYXJ5"})
    assert not holds({"BinaryEquals": {"a:key": "QmluYXJ5"}}, {"a:key": "T3RoZXI="})


def test_ip_address_operators_test_cidr_blocks() -> None:
    context = {"aws:SourceIp": "203.0.113.7"}
    assert holds({"IpAddress": {"aws:SourceIp": "203.0.113.0/24"}}, context)
    assert not holds({"IpAddress": {"aws:SourceIp": "198.51.100.0/24"}}, context)
    assert holds({"NotIpAddress": {"aws:SourceIp": "198.51.100.0/24"}}, context)


def test_arn_operators_match_part_by_part_with_wildcards() -> None:
    template = "arn:aws:ec2:eu-west-1:111122223333:launch-template/lt-0123456789abcdef0"
    context = {"ec2:LaunchTemplate": template}
    assert holds({"ArnEquals": {"ec2:LaunchTemplate": template}}, context)
    assert holds({"ArnLike": {"ec2:LaunchTemplate": "arn:aws:ec2:*:*:launch-template/lt-*"}}, context)
    assert not holds({"ArnLike": {"ec2:LaunchTemplate": "arn:aws:ec2:*:launch-template/*"}}, context)
    assert holds({"ArnNotEquals": {"ec2:LaunchTemplate": "arn:aws:ec2:*:*:launch-template/lt-other"}}, context)
    assert not holds({"ArnNotLike": {"ec2:LaunchTemplate": "arn:aws:ec2:*:*:launch-template/*"}}, context)


def test_null_tests_whether_a_key_is_present() -> None:
    assert holds({"Null": {"elasticfilesystem:AccessPointArn": "true"}}, {})
    assert not holds({"Null": {"elasticfilesystem:AccessPointArn": "true"}}, {"elasticfilesystem:AccessPointArn": "a"})
    assert holds({"Null": {"aws:TagKeys": "false"}}, {"aws:TagKeys": ("k",)})
    assert not holds({"Null": {"aws:TagKeys": "false"}}, {"aws:TagKeys": ()})


def test_an_absent_key_fails_a_positive_operator_and_passes_a_negated_one() -> None:
    assert not holds({"StringEquals": {"aws:ResourceTag/spotcr:job": "j"}}, {})
    assert not holds({"StringLike": {"aws:ResourceTag/spotcr:job": "*"}}, {})
    assert not holds({"Bool": {"aws:SecureTransport": "false"}}, {})
    assert holds({"StringNotEquals": {"aws:ResourceTag/spotcr:job": "j"}}, {})
    assert holds({"ArnNotLike": {"aws:SourceArn": "arn:*:*:*:*:*"}}, {})
    assert holds({"NotIpAddress": {"aws:SourceIp": "10.0.0.0/8"}}, {})


def test_if_exists_holds_when_the_key_is_absent_and_tests_it_when_present() -> None:
    condition = {"StringEqualsIfExists": {"ec2:InstanceType": "c5.large"}}
    assert holds(condition, {})
    assert holds(condition, {"ec2:InstanceType": "c5.large"})
    assert not holds(condition, {"ec2:InstanceType": "m5.large"})
    assert holds({"NumericLessThanIfExists": {"a:n": "3"}}, {})


def test_for_all_values_needs_every_request_value_to_match_and_holds_on_an_absent_key() -> None:
    condition = {"ForAllValues:StringLike": {"aws:TagKeys": ["spotcr:*", "Name"]}}
    assert holds(condition, {"aws:TagKeys": ("spotcr:job", "Name")})
    assert not holds(condition, {"aws:TagKeys": ("spotcr:job", "owner")})
    assert holds(condition, {})
    assert holds(condition, {"aws:TagKeys": ()})


def test_for_any_value_needs_one_request_value_to_match_and_fails_on_an_absent_key() -> None:
    condition = {"ForAnyValue:StringEquals": {"aws:TagKeys": "spotcr:run"}}
    assert holds(condition, {"aws:TagKeys": ("spotcr:error", "spotcr:run")})
    assert not holds(condition, {"aws:TagKeys": ("spotcr:error",)})
    assert not holds(condition, {})
    assert not holds({"ForAnyValue:StringNotEquals": {"aws:TagKeys": "x"}}, {})


def test_negated_operators_under_a_set_qualifier_negate_each_value() -> None:
    # ForAllValues:StringNotLike: no request value may match any pattern
    condition = {"ForAllValues:StringNotLike": {"aws:TagKeys": "aws:*"}}
    assert holds(condition, {"aws:TagKeys": ("spotcr:job", "Name")})
    assert not holds(condition, {"aws:TagKeys": ("spotcr:job", "aws:cloudformation:stack-name")})
    # ForAnyValue:StringNotEquals: some request value is none of the policy values
    any_other = {"ForAnyValue:StringNotEquals": {"aws:TagKeys": ["spotcr:error"]}}
    assert holds(any_other, {"aws:TagKeys": ("spotcr:error", "spotcr:run")})
    assert not holds(any_other, {"aws:TagKeys": ("spotcr:error",)})


def test_a_multivalued_key_without_a_set_qualifier_is_an_error() -> None:
    with pytest.raises(PolicyError, match="ForAllValues: or ForAnyValue:"):
        holds({"StringEquals": {"aws:TagKeys": "spotcr:error"}}, {"aws:TagKeys": ("spotcr:error",)})


def test_policy_variables_resolve_from_the_request_and_the_principal() -> None:
    statement = allow("s3:GetObject", f"{BUCKET}/jobs/${{aws:PrincipalTag/spotcr:job}}/*")
    request = Request("s3:GetObject", f"{BUCKET}/jobs/train-1/manifest")
    assert decide([statement], request, tags={"spotcr:job": "train-1"}).allowed
    assert not decide([statement], request, tags={"spotcr:job": "train-2"}).allowed
    user = evaluate(
        Principal(
            "arn:aws:iam::111122223333:user/people/ana", (policy(allow("s3:*", f"{BUCKET}/${{aws:username}}/*")),)
        ),
        Request("s3:PutObject", f"{BUCKET}/ana/x"),
    )
    assert user.allowed
    sourced = {"StringEquals": {"ec2:SourceInstanceARN": "arn:aws:ec2:eu-west-1:111122223333:instance/${aws:userid}"}}
    context = {"ec2:SourceInstanceARN": INSTANCE, "aws:userid": "i-0123456789abcdef0"}
    assert holds(sourced, context)
    assert holds({"ArnLike": {"aws:SourceArn": "${ec2:SourceInstanceARN}"}}, {**context, "aws:SourceArn": INSTANCE})


def test_a_policy_variable_with_an_absent_key_makes_its_statement_not_match() -> None:
    statement = allow("s3:GetObject", f"{BUCKET}/jobs/${{aws:PrincipalTag/spotcr:job}}/*")
    assert not decide([statement], Request("s3:GetObject", f"{BUCKET}/jobs//x")).allowed
    # a Deny whose variable cannot be resolved does not deny either (AWS: the statement is invalid for the request)
    guarded = [allow(), deny("s3:GetObject", f"{BUCKET}/jobs/${{aws:PrincipalTag/other}}/*")]
    assert decide(guarded, Request("s3:GetObject", f"{BUCKET}/jobs/a/x")).allowed
    # unless it gives a default
    defaulted = allow("s3:GetObject", f"{BUCKET}/jobs/${{aws:PrincipalTag/spotcr:job, 'shared'}}/*")
    assert decide([defaulted], Request("s3:GetObject", f"{BUCKET}/jobs/shared/x")).allowed


def test_escaped_wildcards_in_variables_are_literal_characters() -> None:
    literal = {"StringLike": {"a:name": "a${*}b${?}c${$}"}}
    assert holds(literal, {"a:name": "a*b?c$"})
    assert not holds(literal, {"a:name": "axxbycd"})


def test_variables_are_plain_text_in_policies_of_the_old_version() -> None:
    old = {"Version": "2008-10-17", "Statement": [allow("s3:GetObject", f"{BUCKET}/${{aws:username}}")]}
    principal = Principal("arn:aws:iam::111122223333:user/ana", (old,))
    assert not evaluate(principal, Request("s3:GetObject", f"{BUCKET}/ana")).allowed
    assert evaluate(principal, Request("s3:GetObject", f"{BUCKET}/${{aws:username}}")).allowed


@pytest.mark.parametrize(
    ("statement", "message"),
    [
        (allow(Condition={"StringEqualsSometimes": {"a:b": "c"}}), "unknown condition operator"),
        (allow(Condition={"ForEveryValue:StringEquals": {"a:b": "c"}}), "unknown condition operator"),
        (allow(Condition={"ForAllValues:Null": {"a:b": "true"}}), "Null takes no set qualifier"),
        (allow(Condition={"NumericEquals": {"a:b": "ten"}}), "not a number"),
        (allow(Condition={"DateEquals": {"a:b": "yesterday"}}), "not a date"),
        (allow(Condition={"Bool": {"a:b": "yes"}}), "true or false"),
        (allow(Condition={"IpAddress": {"a:b": "10.0.0.300/8"}}), "not an IP address"),
        (allow(Condition={"StringEquals": {"a:b": {"Ref": "AWS::AccountId"}}}), "must map to a value"),
        (allow(Condition={"StringEquals": {"a:b": "${a:c"}}), "unterminated policy variable"),
        ({"Effect": "allow", "Action": "*", "Resource": "*"}, "Effect must be Allow or Deny"),
        ({"Effect": "Allow", "Resource": "*"}, "exactly one of Action and NotAction"),
        ({"Effect": "Allow", "Action": "*", "Resource": "*", "NotResource": "*"}, "exactly one of Resource"),
        (allow(Principal="*"), "not valid in an identity-based policy"),
        (allow("GetObject"), "is not an action"),
    ],
)
def test_what_the_evaluator_cannot_read_is_an_error_never_an_allow(statement: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        decide([allow(), statement], Request("s3:GetObject", "*", {"a:b": "c", "a:c": "d"}))


def test_a_malformed_policy_document_is_an_error() -> None:
    with pytest.raises(PolicyError, match="unknown Version"):
        evaluate(Principal(ROLE, ({"Version": "2020-01-01", "Statement": [allow()]},)), Request("s3:GetObject", "*"))
    with pytest.raises(PolicyError, match="Statement"):
        evaluate(Principal(ROLE, ({"Version": "2012-10-17", "Statement": []},)), Request("s3:GetObject", "*"))


SESSION = "arn:aws:sts::111122223333:assumed-role/spotcr-tag-change/i-0123456789abcdef0"


def on_bucket(*statements: dict[str, Any]) -> Request:
    return Request("s3:GetObject", f"{BUCKET}/jobs/a", {}, policy(*statements))


def test_same_account_a_resource_policy_naming_the_callers_role_allows_without_an_identity_grant() -> None:
    # Given a session whose identity policies allow nothing, and a bucket policy naming its role
    session = Principal(SESSION, (policy(deny("sqs:*")),))
    named = on_bucket(allow("s3:GetObject", f"{BUCKET}/*", Principal={"AWS": ROLE}))
    # Then either policy allows in one account; a statement naming another principal allows nothing
    assert evaluate(session, named).allowed
    other = on_bucket(allow("s3:GetObject", f"{BUCKET}/*", Principal={"AWS": "arn:aws:iam::111122223333:role/x"}))
    assert not evaluate(session, other).allowed


def test_a_resource_policy_naming_the_account_root_only_delegates_to_identity_policies() -> None:
    root = on_bucket(allow("s3:*", "*", Principal={"AWS": "arn:aws:iam::111122223333:root"}))
    assert not evaluate(Principal(SESSION, (policy(deny("sqs:*")),)), root).allowed
    assert evaluate(Principal(SESSION, (policy(allow("s3:GetObject")),)), root).allowed


def test_an_explicit_deny_in_the_resource_policy_denies_what_the_identity_policy_allows() -> None:
    denied = on_bucket(deny("s3:*", "*", Principal="*", Condition={"Bool": {"aws:SecureTransport": "false"}}))
    caller = Principal(SESSION, (policy(allow("s3:GetObject")),))
    assert not evaluate(
        caller, Request(denied.action, denied.resource, {"aws:SecureTransport": False}, denied.resource_policy)
    ).allowed
    assert evaluate(
        caller, Request(denied.action, denied.resource, {"aws:SecureTransport": True}, denied.resource_policy)
    ).allowed


def test_a_resource_policy_statement_without_a_principal_is_an_error() -> None:
    with pytest.raises(PolicyError, match="names its Principal"):
        evaluate(Principal(SESSION, ()), on_bucket(allow("s3:GetObject")))
    with pytest.raises(PolicyError, match="NotPrincipal"):
        evaluate(Principal(SESSION, ()), on_bucket(allow("s3:GetObject", NotPrincipal={"AWS": ROLE})))


def test_a_policy_changed_in_place_is_evaluated_as_it_now_reads() -> None:
    # Given a principal whose one policy allows reading objects, evaluated once (its parse is kept for the next call)
    document = policy(allow("s3:GetObject"))
    principal = Principal(ROLE, (document,))
    read = Request("s3:GetObject", f"{BUCKET}/k")
    assert evaluate(principal, read).allowed
    # When the same document object is changed to deny what it allowed
    document["Statement"].append(deny("s3:GetObject"))
    # Then the next evaluation reads the change, and changed back it allows again
    assert not evaluate(principal, read).allowed
    document["Statement"].pop()
    assert evaluate(principal, read).allowed
