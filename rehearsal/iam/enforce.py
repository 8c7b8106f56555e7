"""IAM enforced in moto: every call a spotcr principal makes is evaluated against its policies, and refused as AWS
refuses it.

The hook is moto's own authorization step (`ActionAuthenticatorMixin._authenticate_and_authorize_action`), reached by
every service's request in decorator and server mode alike. The caller is named by the access key id in the
request's SigV4 Authorization header (`Credential=<AKID>/...`):
- each spotcr principal has its own key (`Enforcer.keys`); code run in-process as a principal (a Lambda handler)
  runs inside `acting_as(key)`, and botocore signs its requests with that key (RequestSigner.sign, per request);
- moto's Step Functions engine signs its SDK integrations and Lambda invokes with the key "ak": the state machine's;
- a key moto's STS vended (AssumeRole) is that role's session, with the session policy and the session tags the
  AssumeRole call passed;
- `trusted` keys (the test or deployer that builds the local AWS, as CloudFormation would) are not evaluated.
Any other key is refused: an unidentified caller is an error, not an allow.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

from botocore.credentials import Credentials
from botocore.signers import RequestSigner
from moto.core.authorization import ActionAuthenticatorMixin
from werkzeug.exceptions import HTTPException

from rehearsal.iam import requests as iam_requests
from rehearsal.iam.policy import ContextValue, Decision, PolicyError, Principal, Request, evaluate_all

log = logging.getLogger("spotcr.iam")

# The key moto's Step Functions engine signs with (moto.stepfunctions.parser.asl.utils.boto_client).
STEP_FUNCTIONS_ENGINE_KEY = "ak"
_CREDENTIAL = re.compile(r"Credential=([^/,\s]+)/")
# botocore's service names where IAM's prefix differs.
_IAM_PREFIX = {
    "stepfunctions": "states",
    "efs": "elasticfilesystem",
    "awslambda": "lambda",
    "service-quotas": "servicequotas",
}

_acting_as: contextvars.ContextVar[str | None] = contextvars.ContextVar("spotcr_iam_acting_as", default=None)


def access_key(name: str) -> str:
    """A principal's local access key id: 20 characters as AWS's, derived from its name."""
    import hashlib

    return "AKIA" + hashlib.sha256(name.encode()).hexdigest()[:16].upper()


# The `spotcr` command's user's access key (principals.cli_user): in tests its calls run inside acting_as(it).
CLI_USER_KEY = access_key("user:spotcr")


def function_key(name: str) -> str:
    """The access key a catalog function's handler signs with: its role's."""
    return access_key(f"function:{name}")


@contextlib.contextmanager
def acting_as(key: str) -> Iterator[None]:
    """AWS calls made in this thread (and its context) are signed with this access key."""
    token = _acting_as.set(key)
    try:
        yield
    finally:
        _acting_as.reset(token)


class Denied(HTTPException):
    """A call IAM refused, in the shape the service's protocol gives it."""

    def __init__(self, protocol: str, service: str, message: str) -> None:
        super().__init__()
        if protocol == "ec2":
            self.code, self.error = 403, "UnauthorizedOperation"
            self.description = (
                f"<?xml version='1.0' encoding='UTF-8'?><Response><Errors><Error><Code>{self.error}</Code>"
                f"<Message>You are not authorized to perform this operation. {_xml(message)}</Message></Error>"
                "</Errors><RequestID>spotcr-iam</RequestID></Response>"
            )
            self.content_type = "text/xml"
        elif protocol == "query":
            self.code, self.error = 403, "AuthorizationError" if service == "sns" else "AccessDenied"
            self.description = (
                "<ErrorResponse><Error><Type>Sender</Type>"
                f"<Code>{self.error}</Code><Message>{_xml(message)}</Message></Error>"
                "<RequestId>spotcr-iam</RequestId></ErrorResponse>"
            )
            self.content_type = "text/xml"
        elif protocol == "rest-xml":
            self.code, self.error = 403, "AccessDenied"
            self.description = f"<Error><Code>AccessDenied</Code><Message>{_xml(message)}</Message></Error>"
            self.content_type = "application/xml"
        else:  # json (400, as DynamoDB, SSM, Step Functions and EventBridge answer) and rest-json (403)
            self.code, self.error = (400 if protocol == "json" else 403), "AccessDeniedException"
            self.description = json.dumps({"__type": self.error, "message": message, "Message": message})
            self.content_type = "application/x-amz-json-1.1" if protocol == "json" else "application/json"

    def get_headers(self, *args: Any, **kwargs: Any) -> list[tuple[str, str]]:
        return [("Content-Type", self.content_type), ("x-amzn-ErrorType", self.error)]

    def get_body(self, *args: Any, **kwargs: Any) -> str:
        return str(self.description)


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


@dataclass(frozen=True)
class Denial:
    principal: str
    requests: tuple[Request, ...]
    reason: str


@dataclass
class Enforcer:
    """Who holds which key, and the evaluation of each call against the caller's policies."""

    keys: Mapping[str, Principal]  # access key id -> the principal it signs as
    trusted: Mapping[str, str]  # access key id -> who (the test building the local AWS); not evaluated
    roles: Mapping[str, Principal]  # role ARN -> its principal, for sessions STS vends of it
    state: iam_requests.State
    # access key id -> the condition keys AWS adds for its credentials (ec2:SourceInstanceARN for an instance's)
    contexts: dict[str, Mapping[str, ContextValue]] = field(default_factory=dict)
    # access key id -> its secret, for what verifies a SigV4 signature itself (the function URL stand-in)
    secrets: dict[str, str] = field(default_factory=dict)
    # resource ARN -> its own policy (principals.resource_policies): evaluated with the caller's where a call
    # crosses it; an object's is its bucket's
    resource_policies: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    denials: list[Denial] = field(default_factory=list)
    evaluated: list[tuple[str, str]] = field(default_factory=list)  # (principal ARN, service:operation)
    _session_tags: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add_key(
        self,
        key: str,
        principal: Principal,
        context: Mapping[str, ContextValue] | None = None,
        secret: str | None = None,
    ) -> None:
        """A principal that comes to be while the local AWS runs (a job VM's instance-profile session)."""
        with self._lock:
            self.keys = {**self.keys, key: principal}
            self.contexts[key] = dict(context or {})
            if secret is not None:
                self.secrets[key] = secret

    def authorize(self, key: str, account: str, requests: Sequence[Request]) -> tuple[Principal | None, Decision]:
        """A call that AWS authorizes outside the service APIs (a function URL, a private API), signed with `key`:
        its caller, and the decision on `requests` with the context AWS adds for the key's credentials."""
        principal = self.principal(key, account)
        if principal is None:
            return None, Decision(False, f"the access key {key!r} is no spotcr principal's")
        return principal, self.authorize_as(principal, account, requests, self.contexts.get(key, {}))

    def authorize_as(
        self,
        principal: Principal,
        account: str,
        requests: Sequence[Request],
        context: Mapping[str, ContextValue] | None = None,
    ) -> Decision:
        """What an AWS service does as a principal it holds no key of here (FIS as its experiment's role)."""
        extra = {"aws:PrincipalAccount": account, **(context or {})}
        full = tuple(Request(r.action, r.resource, {**extra, **r.context}, r.resource_policy) for r in requests)
        try:
            decision = evaluate_all(principal, full)
        except PolicyError as error:
            decision = Decision(False, f"policy error: {error}")
        with self._lock:
            self.evaluated.extend((principal.arn, r.action) for r in full)
            if not decision.allowed:
                self.denials.append(Denial(principal.arn, full, decision.reason))
        return decision

    def principal(self, key: str, account: str) -> Principal | None:
        if key in self.keys:
            return self.keys[key]
        from moto.sts.models import sts_backends

        for session in sts_backends[account]["global"].assumed_roles:
            if session.access_key_id != key:
                continue
            role = self.roles.get(session.role_arn)
            if role is None:
                return None
            with self._lock:
                tags = self._session_tags.get((session.role_arn, session.session_name), {})
            return Principal(
                arn=f"arn:aws:sts::{account}:assumed-role/{session.role_arn.rsplit('/', 1)[-1]}/{session.session_name}",
                policies=role.policies,
                boundary=role.boundary,
                session_policies=(json.loads(session.policy),) if session.policy else (),
                tags={**role.tags, **tags},
            )
        return None

    def check(self, key: str, call: iam_requests.Call) -> Decision | None:
        """None when the key is trusted; else the decision on every request the call makes."""
        if key in self.trusted:
            return None
        principal = self.principal(key, call.account)
        name = f"{call.service}:{call.operation}"
        if principal is None:
            return Decision(False, f"the access key {key!r} is no spotcr principal's: {name} refused")
        common: dict[str, ContextValue] = {"aws:PrincipalArn": principal.arn, "aws:PrincipalAccount": call.account}
        common["aws:RequestedRegion"] = call.region
        # Production clients reach AWS over TLS (botocore's default); the local AWS is plain http on loopback.
        common["aws:SecureTransport"] = True
        common.update(self.contexts.get(key, {}))
        requests: tuple[Request, ...] = ()
        try:
            requests = tuple(
                Request(r.action, r.resource, {**common, **r.context}, r.resource_policy or self._guarding(r.resource))
                for r in iam_requests.requests_for(call, self.state)
            )
            # An operation that asks nothing (sts:GetCallerIdentity) needs no permission.
            decision = evaluate_all(principal, requests) if requests else Decision(True, f"{name} needs no permission")
        except PolicyError as error:
            decision = Decision(False, f"policy error: {error}")
        except iam_requests.UnknownOperation as error:
            # Refused, never allowed, and said in the service's own error shape (not a 500 in server mode).
            decision = Decision(False, f"the local AWS has no IAM request model for {name}: {error}")
        with self._lock:
            self.evaluated.append((principal.arn, name))
            if not decision.allowed:
                self.denials.append(Denial(principal.arn, requests, decision.reason))
            elif call.operation == "AssumeRole" and call.service == "sts":
                tags = {t["Key"]: t["Value"] for t in call.params.get("Tags", []) or []}
                self._session_tags[(call.params["RoleArn"], call.params["RoleSessionName"])] = tags
        if not decision.allowed:
            log.warning("IAM denied %s: %s (%s)", principal.arn, name, decision.reason)
        return decision

    def _guarding(self, resource: str) -> Mapping[str, Any] | None:
        """The policy of the resource, or of the bucket an object is in."""
        return self.resource_policies.get(resource) or self.resource_policies.get(resource.split("/", 1)[0])

    def denied_message(self, principal_arn: str, decision: Decision, call: iam_requests.Call) -> str:
        with self._lock:  # this call's denial: another thread's may have come after it
            mine = (d for d in reversed(self.denials) if d.principal == principal_arn and d.reason == decision.reason)
            denial = next(mine, None)
        first = next(iter(denial.requests), None) if denial else None
        action = first.action if first else f"{call.service}:{call.operation}"
        resource = first.resource if first else "*"
        for request in denial.requests if denial else ():
            if request.action in decision.reason or request.resource in decision.reason:
                action, resource = request.action, request.resource
        return (
            f"User: {principal_arn} is not authorized to perform: {action} on resource: {resource} because no "
            f"identity-based policy allows the {action} action ({decision.reason})"
        )


@dataclass(frozen=True)
class MotoState:
    """The local AWS's resources before the call, read from moto's backends."""

    account: str
    region: str

    def _ec2(self) -> Any:
        from moto.ec2.models import ec2_backends

        return ec2_backends[self.account][self.region]

    def ec2_tags(self, resource_id: str) -> Mapping[str, str]:
        return dict(self._ec2().tags.get(resource_id, {}))

    def launch_template(self, template_id: str, template_name: str, version: str) -> tuple[str, Mapping[str, Any]]:
        backend = self._ec2()
        template = (
            backend.get_launch_template(template_id)
            if template_id
            else backend.get_launch_template_by_name(template_name)
        )
        chosen = {"$Default": template.default_version, "$Latest": template.latest_version}
        found = chosen[version]() if version in chosen else template.get_version(int(version))
        return template.id, dict(found.data)

    def subnet_default(self, launch_data: Mapping[str, Any]) -> str:
        interfaces = launch_data.get("NetworkInterfaces") or [{}]
        return str(interfaces[0].get("SubnetId", ""))

    def instance_profile_roles(self, profile: Mapping[str, str]) -> list[str]:
        from moto.iam.models import iam_backends

        backend = iam_backends[self.account]["global"]
        for candidate in backend.instance_profiles.values():
            if profile.get("Arn") in (candidate.arn,) or profile.get("Name") in (candidate.name,):
                return [role.arn for role in candidate.roles]
        raise iam_requests.UnknownOperation(f"no instance profile {dict(profile)} in the local AWS")

    def state_machine_of_token(self, token: str) -> str:
        from moto.stepfunctions.responses import get_backend

        machines = [m.arn for m in get_backend(self.account, self.region).state_machines]
        if len(machines) != 1:  # a token names no state machine in moto: one state machine is unambiguous
            raise iam_requests.UnknownOperation(f"the task token's state machine is one of {machines}")
        return machines[0]

    def topic_key(self, topic_arn: str) -> str:
        from moto.sns.models import sns_backends

        topic = sns_backends[self.account][self.region].topics.get(topic_arn)
        key = str(getattr(topic, "kms_master_key_id", "") or "")
        if key and not key.startswith("arn:"):
            key = f"arn:aws:kms:{self.region}:{self.account}:key/{key}"
        return key

    def access_point_tags(self, access_point_id: str) -> Mapping[str, str]:
        from moto.efs.models import efs_backends

        backend = efs_backends[self.account][self.region]
        return {t["Key"]: t["Value"] for t in backend.list_tags_for_resource(access_point_id)}

    def file_system_arn(self, file_system_id: str) -> str:
        return f"arn:aws:elasticfilesystem:{self.region}:{self.account}:file-system/{file_system_id}"

    def role_arn(self, role_name: str) -> str:
        from moto.iam.models import iam_backends

        for role in iam_backends[self.account]["global"].get_roles():
            if role.name == role_name:
                return str(role.arn)
        return f"arn:aws:iam::{self.account}:role/{role_name}"  # no such role: no path to name it by

    def kms_key_arn(self, key_id: str) -> str:
        from moto.kms.models import kms_backends

        backend = kms_backends[self.account][self.region]
        alias = backend.get_alias_name(key_id)
        if alias.startswith("alias/"):
            found = [key.id for key in backend.keys.values() if alias in key.aliases]
            if not found:  # no such alias: AWS answers NotFound; the alias is all there is to name
                return f"arn:aws:kms:{self.region}:{self.account}:{alias}"
            key_id = found[0]
        return f"arn:aws:kms:{self.region}:{self.account}:key/{backend.get_key_id(key_id)}"

    def _s3_bucket(self, bucket: str) -> Any:
        from moto.s3.models import s3_backends

        return s3_backends[self.account]["global"].buckets.get(bucket)

    def _sse_kms(self, algorithm: str | None, key_id: str | None, bucket_key: Any) -> iam_requests.SseKms | None:
        if algorithm != "aws:kms":
            return None
        key = key_id or "alias/aws/s3"  # SSE-KMS naming no key: S3's AWS managed key
        arn = key if key.startswith("arn:aws:kms:") and ":key/" in key else self.kms_key_arn(key)
        return iam_requests.SseKms(arn, str(bucket_key).lower() == "true")

    def bucket_encryption(self, bucket: str) -> iam_requests.SseKms | None:
        found = self._s3_bucket(bucket)
        rule = (found.encryption or {}).get("Rule", {}) if found is not None else {}
        default = rule.get("ApplyServerSideEncryptionByDefault", {})
        return self._sse_kms(default.get("SSEAlgorithm"), default.get("KMSMasterKeyID"), rule.get("BucketKeyEnabled"))

    def object_encryption(self, bucket: str, key: str) -> iam_requests.SseKms | None:
        found = self._s3_bucket(bucket)
        written = found.keys.get(key) if found is not None else None
        if written is None:
            return None
        return self._sse_kms(written.encryption, written.kms_key_id, written.bucket_key_enabled)

    def stack_arn(self, stack_name: str) -> str:
        if stack_name.startswith("arn:"):
            return stack_name
        from moto.cloudformation.models import cloudformation_backends

        for stack in cloudformation_backends[self.account][self.region].stacks.values():
            if stack.name == stack_name and stack.status != "DELETE_COMPLETE":
                return str(stack.stack_id)
        # No such stack: AWS authorizes the name with any id (DescribeStacks then answers it does not exist).
        return f"arn:aws:cloudformation:{self.region}:{self.account}:stack/{stack_name}/*"


def _parameters(response: Any, operation: str) -> dict[str, Any]:
    """The request's parameters parsed by its protocol, as botocore names them."""
    from moto.core.parse import PROTOCOL_PARSERS
    from moto.core.request import determine_request_protocol
    from moto.core.responses import get_service_model

    service_model = get_service_model(response.boto3_service_name)
    request = response.normalized_request
    protocol = determine_request_protocol(service_model, request.content_type)
    if operation not in service_model.operation_names and protocol == "json":
        # An operation botocore does not model (SSM Agent's UpdateInstanceInformation): its JSON body as sent.
        return dict(json.loads(request.data or b"{}"))
    operation_model = service_model.operation_model(operation)
    parser = PROTOCOL_PARSERS[protocol](operation_model, map_type=dict)
    parsed = parser.parse(
        {
            "method": request.method,
            "values": request.values,
            "headers": request.headers,
            "body": request.data,
            "url_path": request.path,
            "url_params": getattr(response, "uri_match", {}) or {},
        }
    )
    return dict(parsed)


def _protocol(response: Any) -> str:
    from moto.core.responses import get_service_model

    return str(get_service_model(response.boto3_service_name).protocol)


def _s3_call(response: Any, resource: str, account: str) -> iam_requests.Call:
    """S3 as moto already names it: the IAM action and the bucket or object ARN."""
    action = str(response._get_action())
    params: dict[str, Any] = {"Resource": resource}
    prefix = response.querystring.get("prefix") if isinstance(response.querystring, dict) else None
    if prefix:
        params["prefix"] = prefix[0] if isinstance(prefix, list) else prefix
    if action == "DeleteObject" and response.is_delete_keys():
        # DeleteObjects is authorized as s3:DeleteObject on each key it names.
        from xml.etree import ElementTree

        body = ElementTree.fromstring(response.raw_body)  # noqa: S314 (the local cloud's own request)
        params["Keys"] = [key.text or "" for key in body.iterfind("{*}Object/{*}Key")]
    return iam_requests.Call("s3", action, params, response.region, account)


@contextlib.contextmanager
def enforced(enforcer: Enforcer) -> Iterator[Enforcer]:
    """moto evaluates every call against the caller's policies while inside; both patches undone on leaving."""
    with contextlib.ExitStack() as stack:
        original_sign = RequestSigner.sign

        def sign(signer: Any, operation_name: str, request: Any, *args: Any, **kwargs: Any) -> Any:
            key = _acting_as.get()
            if key is not None:
                signing = request.context.setdefault("signing", {})
                signing["request_credentials"] = Credentials(key, "spotcr-local-secret")
            return original_sign(signer, operation_name, request, *args, **kwargs)

        def authorize(response: Any, iam_request_cls: type, resource: str = "*") -> None:
            match = _CREDENTIAL.search(response.headers.get("Authorization", ""))
            key = match.group(1) if match else ""
            if key in enforcer.trusted:
                return
            account = response.current_account
            service = response.boto3_service_name
            if service == "s3":
                call = _s3_call(response, resource, account)
                protocol = "rest-xml"
            else:
                operation = str(response._get_action())
                call = iam_requests.Call(
                    _IAM_PREFIX.get(service, service),
                    operation,
                    _parameters(response, operation),
                    response.region,
                    account,
                )
                protocol = _protocol(response)
            decision = enforcer.check(key, call)
            if decision is None or decision.allowed:
                return
            principal = enforcer.principal(key, account)
            arn = principal.arn if principal else f"unidentified key {key}"
            raise Denied(protocol, service, enforcer.denied_message(arn, decision, call))

        stack.enter_context(mock.patch.object(RequestSigner, "sign", sign))
        authenticate = "_authenticate_and_authorize_action"
        stack.enter_context(mock.patch.object(ActionAuthenticatorMixin, authenticate, authorize))
        yield enforcer
