"""Who calls AWS in spotcr and with which policies: the roles of the synthesized template, put in the local AWS.

The stack is synthesized once per process (and cached on disk by a hash of the sources it is built from). Each role's
identity policies are read from the template (AWS::IAM::Policy resources attached to it, its inline Policies), with
CloudFormation's intrinsics resolved to the local resources' names and ARNs (`Local`). Which role is which is read
from the template too: a Lambda function's Role, by its Handler in the catalog; the state machine's RoleArn; the
instance profile's role; the role the store-credentials function assumes (SPOTCR_STORE_ROLE_ARN); the FIS role.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from spotcr_functions import catalog
from spotcr_functions.config import ENV

from rehearsal.iam import requests as iam_requests
from rehearsal.iam.policy import Principal, Request

REPO = Path(__file__).resolve().parents[2]
# What the template is built from: a change to any of these synthesizes again.
_SOURCES = ("infra", "functions", "statemachines", "vm-bootstrap", "cdk.json")
_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spotcr"
STORE_ROLE_ENV = ENV["store_role_arn"]
_LOGICAL_ID = re.compile(r"^(?P<stem>.+)[0-9A-F]{8}$")


def _sources_hash() -> str:
    digest = hashlib.sha256()
    for name in _SOURCES:
        path = REPO / name
        files = (
            sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
            if path.is_dir()
            else [path]
        )
        for file in files:
            digest.update(str(file.relative_to(REPO)).encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()[:24]


def template(context: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The stack's CloudFormation template as `cdk synth` writes it: cdk.json's context, with `context` over it.
    Parsed once per context and shared: read it, never change it."""
    return _template(json.dumps(dict(context or {}), sort_keys=True))


@functools.cache
def _template(context_json: str) -> dict[str, Any]:
    return dict(json.loads(_template_text(context_json)))


@functools.cache
def _template_text(context_json: str) -> str:
    key = hashlib.sha256(f"{_sources_hash()}:{context_json}".encode()).hexdigest()[:24]
    cached = _CACHE / f"template-{key}.json"
    if cached.is_file():
        return cached.read_text()
    import aws_cdk as cdk

    from infra.agent_bundle import EFS_UTILS_ENV
    from infra.app import build_app

    context = {**json.loads((REPO / "cdk.json").read_text())["context"], **json.loads(context_json)}
    # The local AWS reads only the template's policies: a test build's EFS helper stand-in may be in its asset.
    with (
        tempfile.TemporaryDirectory(prefix="spotcr-synth-") as outdir,
        mock.patch.dict(os.environ, {EFS_UTILS_ENV: "stand-in"}),
    ):
        app, stack = build_app(cdk.App(context=context, outdir=outdir))
        text = json.dumps(app.synth().get_stack_by_name(stack.stack_name).template)
    _CACHE.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(text)
    partial.replace(cached)
    return text


def stem(logical_id: str) -> str:
    """A logical id without CDK's hash suffix: the construct path, e.g. RegistryJobs4B35A9CD -> RegistryJobs."""
    match = _LOGICAL_ID.match(logical_id)
    return match.group("stem") if match else logical_id


@dataclass(frozen=True)
class Local:
    """Where the stack's resources are in the local AWS: physical names (or ids, or a topic's ARN: what Ref gives)
    by logical-id stem. Lambda functions are named function_prefix + their catalog name; anything else not named
    here keeps its stem as its name (nothing local calls it)."""

    region: str
    account: str
    names: Mapping[str, str] = field(default_factory=dict)
    function_prefix: str = "spotcr-"


class UnresolvedIntrinsic(ValueError):
    """A template value this resolver does not know how to put in the local AWS."""


def _catalog_function(resource: Mapping[str, Any]) -> catalog.Function | None:
    """The catalog function a template's Lambda function runs (by its handler), if any."""
    handler = resource.get("Properties", {}).get("Handler", "")
    return next((f for f in catalog.FUNCTIONS if f.handler == handler), None)


class Resolver:
    """CloudFormation intrinsics (Ref, Fn::GetAtt Arn, Fn::Join, Fn::Sub, pseudo parameters) in the local AWS."""

    def __init__(self, resources: Mapping[str, Any], local: Local) -> None:
        self.resources = resources
        self.local = local

    def name(self, logical_id: str) -> str:
        resource = self.resources[logical_id]
        function = _catalog_function(resource) if resource["Type"] == "AWS::Lambda::Function" else None
        if function is not None:
            return self.local.function_prefix + function.name
        return self.local.names.get(stem(logical_id), stem(logical_id))

    def ref(self, name: str) -> str:
        pseudo = {
            "AWS::Region": self.local.region,
            "AWS::AccountId": self.local.account,
            "AWS::Partition": "aws",
            "AWS::URLSuffix": "amazonaws.com",
        }
        if name in pseudo:
            return pseudo[name]
        if name not in self.resources:
            raise UnresolvedIntrinsic(f"Ref {name}: no such resource or pseudo parameter")
        if self.resources[name]["Type"] == "AWS::StepFunctions::StateMachine":
            return self.arn(name)  # Ref of a state machine is its ARN
        return self.name(name)

    def arn(self, logical_id: str) -> str:
        kind = self.resources[logical_id]["Type"]
        name, region, account = self.name(logical_id), self.local.region, self.local.account
        arns = {
            "AWS::DynamoDB::Table": f"arn:aws:dynamodb:{region}:{account}:table/{name}",
            "AWS::S3::Bucket": f"arn:aws:s3:::{name}",
            "AWS::SQS::Queue": f"arn:aws:sqs:{region}:{account}:{name}",
            "AWS::KMS::Key": f"arn:aws:kms:{region}:{account}:key/{name}",
            "AWS::Events::EventBus": f"arn:aws:events:{region}:{account}:event-bus/{name}",
            "AWS::Events::Rule": f"arn:aws:events:{region}:{account}:rule/{name}",
            "AWS::IAM::Role": f"arn:aws:iam::{account}:role/{name}",
            "AWS::IAM::InstanceProfile": f"arn:aws:iam::{account}:instance-profile/{name}",
            "AWS::Lambda::Function": f"arn:aws:lambda:{region}:{account}:function:{name}",
            "AWS::Logs::LogGroup": f"arn:aws:logs:{region}:{account}:log-group:{name}:*",
            "AWS::StepFunctions::StateMachine": f"arn:aws:states:{region}:{account}:stateMachine:{name}",
            "AWS::FIS::ExperimentTemplate": f"arn:aws:fis:{region}:{account}:experiment-template/{name}",
            "AWS::EFS::FileSystem": f"arn:aws:elasticfilesystem:{region}:{account}:file-system/{name}",
            "AWS::SNS::Topic": name,
        }
        if kind not in arns:
            raise UnresolvedIntrinsic(f"Fn::GetAtt {logical_id}.Arn: no local ARN for a {kind}")
        return arns[kind]

    def __call__(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self(item) for item in value]
        if not isinstance(value, dict):
            return value
        if len(value) == 1:
            ((key, argument),) = value.items()
            if key == "Ref" or key.startswith("Fn::"):
                return self._intrinsic(key, argument)
        return {k: self(v) for k, v in value.items()}

    def _intrinsic(self, key: str, argument: Any) -> Any:
        if key == "Ref":
            return self.ref(argument)
        if key == "Fn::GetAtt":
            logical_id, attribute = argument if isinstance(argument, list) else argument.split(".", 1)
            if attribute != "Arn":
                raise UnresolvedIntrinsic(f"Fn::GetAtt {logical_id}.{attribute}: only Arn is resolved")
            return self.arn(logical_id)
        if key == "Fn::Join":
            separator, parts = argument
            return separator.join(str(self(part)) for part in parts)
        if key == "Fn::Sub":
            return self._sub(argument)
        raise UnresolvedIntrinsic(f"{key} is not resolved in the local AWS")

    def _sub(self, argument: Any) -> str:
        text, variables = (argument, {}) if isinstance(argument, str) else argument
        values = {k: str(self(v)) for k, v in variables.items()}

        def substitute(match: re.Match[str]) -> str:
            name = match.group(1)
            if name in values:
                return values[name]
            if "." in name:
                logical_id, attribute = name.split(".", 1)
                return str(self._intrinsic("Fn::GetAtt", [logical_id, attribute]))
            return self.ref(name)

        return re.sub(r"\$\{([^}!][^}]*)\}", substitute, str(text))


@dataclass(frozen=True)
class Role:
    logical_id: str
    arn: str
    policies: tuple[Mapping[str, Any], ...]

    def principal(self, tags: Mapping[str, str] | None = None) -> Principal:
        return Principal(arn=self.arn, policies=self.policies, tags=dict(tags or {}))


@dataclass(frozen=True)
class StackRoles:
    """The stack's roles in the local AWS, by what assumes them."""

    functions: Mapping[str, Role]  # catalog name -> its function's role
    workflow: Role
    job: Role  # the job VMs' instance profile role
    store: Role  # assumed by store-credentials for one job's session
    fault_injection: Role

    def all(self) -> Iterator[Role]:
        yield from self.functions.values()
        yield from (self.workflow, self.job, self.store, self.fault_injection)


def _role_policies(resources: Mapping[str, Any], resolve: Resolver) -> dict[str, list[Mapping[str, Any]]]:
    policies: dict[str, list[Mapping[str, Any]]] = {}
    for logical_id, resource in resources.items():
        properties = resource.get("Properties", {})
        if resource["Type"] == "AWS::IAM::Role":
            inline = [resolve(p["PolicyDocument"]) for p in properties.get("Policies", [])]
            policies.setdefault(logical_id, []).extend(inline)
        elif resource["Type"] == "AWS::IAM::Policy":
            for role in properties.get("Roles", []):
                policies.setdefault(role["Ref"], []).append(resolve(properties["PolicyDocument"]))
    return policies


def _role_of(value: Any) -> str:
    """The logical id of a role given as Ref or Fn::GetAtt [role, Arn]."""
    if isinstance(value, dict) and "Ref" in value:
        return str(value["Ref"])
    if isinstance(value, dict) and "Fn::GetAtt" in value:
        return str(value["Fn::GetAtt"][0])
    raise UnresolvedIntrinsic(f"a role given as {json.dumps(value)[:200]}")


def stack_roles(local: Local, synthesized: Mapping[str, Any]) -> StackRoles:
    """The roles of the synthesized stack (`template()`) with their policies resolved in `local`."""
    resources = dict(synthesized["Resources"])
    resolve = Resolver(resources, local)
    policies = _role_policies(resources, resolve)

    def role(logical_id: str) -> Role:
        properties = resources[logical_id].get("Properties", {})
        if properties.get("ManagedPolicyArns") or properties.get("PermissionsBoundary"):
            raise UnresolvedIntrinsic(f"role {logical_id}: managed policies and boundaries are not read yet")
        arn = resolve.arn(logical_id)
        return Role(logical_id, arn, tuple(policies.get(logical_id, ())))

    functions: dict[str, Role] = {}
    workflow = job = store = fault_injection = None
    for resource in resources.values():
        properties = resource.get("Properties", {})
        kind = resource["Type"]
        if kind == "AWS::Lambda::Function":
            function = _catalog_function(resource)
            if function is not None:
                functions[function.name] = role(_role_of(properties["Role"]))
                store_role = properties.get("Environment", {}).get("Variables", {}).get(STORE_ROLE_ENV)
                if store_role is not None:
                    store = role(_role_of(store_role))
        elif kind == "AWS::StepFunctions::StateMachine":
            workflow = role(_role_of(properties["RoleArn"]))
        elif kind == "AWS::IAM::InstanceProfile":
            (only,) = properties["Roles"]
            job = role(_role_of(only))
        elif kind == "AWS::FIS::ExperimentTemplate":
            fault_injection = role(_role_of(properties["RoleArn"]))
    missing = sorted(set(f.name for f in catalog.FUNCTIONS) - set(functions))
    if missing or not (workflow and job and store and fault_injection):
        raise UnresolvedIntrinsic(f"the template lacks a role for: functions {missing}, or workflow/job/store/FIS")
    return StackRoles(functions, workflow, job, store, fault_injection)


def agent_asset(job: Role) -> tuple[str, str]:
    """(bucket, key) of the agent asset the job role may read: the object CDK publishes in its assets bucket."""
    for document in job.policies:
        for statement in document["Statement"]:
            resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
            for resource in resources:
                bucket, _, key = resource.removeprefix("arn:aws:s3:::").partition("/")
                if resource.startswith("arn:aws:s3:::cdk-") and key.endswith(".zip"):
                    return bucket, key
    raise UnresolvedIntrinsic(f"the job role {job.arn} may read no agent asset")


def function_setting(synthesized: Mapping[str, Any], variable: str) -> str:
    """The value the stack gives its functions for the environment variable `variable` (a literal in the template)."""
    for resource in synthesized["Resources"].values():
        if resource["Type"] == "AWS::Lambda::Function":
            value = resource["Properties"].get("Environment", {}).get("Variables", {}).get(variable)
            if isinstance(value, str):
                return value
    raise UnresolvedIntrinsic(f"no function of the stack has {variable} as a literal")


def state_machine_name(synthesized: Mapping[str, Any]) -> str:
    """The name the stack gives its state machine: the function roles' grants name its ARN by it."""
    (name,) = [
        r["Properties"]["StateMachineName"]
        for r in synthesized["Resources"].values()
        if r["Type"] == "AWS::StepFunctions::StateMachine"
    ]
    return str(name)


def cli_user(account: str, stack: str, region: str, outputs: Mapping[str, str]) -> Principal:
    """The user who runs `spotcr`: an IAM user holding only the policy the README gives (infra/user_policy.py)."""
    from infra.user_policy import cli_user_policy

    return Principal(f"arn:aws:iam::{account}:user/spotcr-user", (cli_user_policy(stack, region, account, outputs),))


def without_grant(principal: Principal, action: str) -> Principal:
    """The principal with one action taken out of every statement that names it: a grant removed on purpose.

    Only an action named as such is removed (a pattern that covers it is not): ValueError if none names it, so a
    test of a missing grant cannot pass without removing one.
    """

    def listed(value: Any) -> list[Any]:
        return value if isinstance(value, list) else [value]

    removed = False

    def strip(policy: Mapping[str, Any]) -> dict[str, Any]:
        nonlocal removed
        statements = []
        for statement in listed(policy["Statement"]):
            if "Action" not in statement:
                statements.append(statement)
                continue
            actions = [a for a in listed(statement["Action"]) if a != action]
            removed |= len(actions) < len(listed(statement["Action"]))
            if actions:
                statements.append({**statement, "Action": actions})
        return {**policy, "Statement": statements}

    policies = tuple(strip(policy) for policy in principal.policies)
    if not removed:
        raise ValueError(f"no statement of {principal.arn}'s policies names {action}")
    return dataclasses.replace(principal, policies=policies)


@dataclass(frozen=True)
class StoreCredentialsAddress:
    """How job VMs reach the store-credentials function, as the template configures it: the SigV4 service they
    sign for, and the IAM requests AWS authorizes on each call (the caller's identity and the resource's policy)."""

    signing_service: str  # "lambda" (the function URL) or "execute-api" (the private API)
    requests: tuple[Request, ...]


def store_credentials_address(local: Local, synthesized: Mapping[str, Any]) -> StoreCredentialsAddress:
    """The store-credentials function's URL (AWS::Lambda::Url), or with private subnets its private API."""
    resources = dict(synthesized["Resources"])
    resolve = Resolver(resources, local)
    (function_id,) = [  # the one function that vends store sessions
        logical_id
        for logical_id, resource in resources.items()
        if catalog.STORE_CREDENTIALS in getattr(_catalog_function(resource), "capabilities", ())
    ]
    function_arn = resolve.arn(function_id)
    for logical_id, resource in resources.items():
        properties = resource.get("Properties", {})
        if resource["Type"] == "AWS::Lambda::Url" and resolve(properties["TargetFunctionArn"]) == function_arn:
            if properties["AuthType"] != "AWS_IAM":
                raise UnresolvedIntrinsic(f"{logical_id}: AuthType {properties['AuthType']}: job VMs sign (AWS_IAM)")
            policy = _function_policy(resources, resolve, function_arn)
            return StoreCredentialsAddress("lambda", tuple(iam_requests.function_url(function_arn, "AWS_IAM", policy)))
        if resource["Type"] == "AWS::ApiGateway::RestApi":
            return _private_api(resources, resolve, logical_id)
    raise UnresolvedIntrinsic("the template serves the store-credentials function at no URL and no API")


def _function_policy(resources: Mapping[str, Any], resolve: Resolver, function_arn: str) -> dict[str, Any] | None:
    """The function's resource policy: its AWS::Lambda::Permission resources, as Lambda writes them into it."""
    statements = []
    for resource in resources.values():
        properties = resource.get("Properties", {})
        if resource["Type"] != "AWS::Lambda::Permission" or resolve(properties["FunctionName"]) != function_arn:
            continue
        who = str(resolve(properties["Principal"]))
        if who.endswith(".amazonaws.com"):
            principal: dict[str, str] = {"Service": who}
        else:
            principal = {"AWS": who if who.startswith("arn:") or who == "*" else f"arn:aws:iam::{who}:root"}
        condition: dict[str, dict[str, str]] = {}
        if "SourceArn" in properties:
            condition["ArnLike"] = {"aws:SourceArn": str(resolve(properties["SourceArn"]))}
        if "SourceAccount" in properties:
            condition.setdefault("StringEquals", {})["aws:SourceAccount"] = str(resolve(properties["SourceAccount"]))
        if "FunctionUrlAuthType" in properties:
            condition.setdefault("StringEquals", {})["lambda:FunctionUrlAuthType"] = properties["FunctionUrlAuthType"]
        statement = {
            "Effect": "Allow",
            "Principal": principal,
            "Action": properties["Action"],
            "Resource": function_arn,
        }
        statements.append({**statement, **({"Condition": condition} if condition else {})})
    return {"Version": "2012-10-17", "Statement": statements} if statements else None


def _private_api(resources: Mapping[str, Any], resolve: Resolver, api_id: str) -> StoreCredentialsAddress:
    """The private API's GET on its root, reached through its VPC endpoint, with the API's resource policy (API
    Gateway reads `execute-api:/...` in it as the API's own ARN)."""
    properties = resources[api_id]["Properties"]
    local = resolve.local
    api_arn = f"arn:aws:execute-api:{local.region}:{local.account}:{resolve.name(api_id)}/"
    (stage,) = [
        r["Properties"]["StageName"]
        for r in resources.values()
        if r["Type"] == "AWS::ApiGateway::Stage" and r["Properties"]["RestApiId"] == {"Ref": api_id}
    ]
    (endpoint,) = properties["EndpointConfiguration"]["VpcEndpointIds"]
    policy = json.loads(json.dumps(resolve(properties["Policy"])).replace('"execute-api:/', f'"{api_arn}'))
    requests = iam_requests.api_invoke(f"{api_arn}{stage}/GET/", str(resolve(endpoint)), policy)
    return StoreCredentialsAddress("execute-api", tuple(requests))


def resource_policies(local: Local, synthesized: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The stack's resource policies by the ARN of the resource they guard: its buckets' policies and its Lambda
    functions' permissions, resolved in `local` (a call on an object is guarded by its bucket's policy)."""
    resources = dict(synthesized["Resources"])
    resolve = Resolver(resources, local)
    found: dict[str, Mapping[str, Any]] = {}
    for logical_id, resource in resources.items():
        properties = resource.get("Properties", {})
        if resource["Type"] == "AWS::S3::BucketPolicy":
            found[f"arn:aws:s3:::{resolve(properties['Bucket'])}"] = resolve(properties["PolicyDocument"])
        elif resource["Type"] == "AWS::Lambda::Function":
            function_arn = resolve.arn(logical_id)
            policy = _function_policy(resources, resolve, function_arn)
            if policy is not None:
                found[function_arn] = policy
    return found
