"""What moto lacks of an account's settings and quotas, answered as AWS answers (what `spotcr preflight` reads).

- Lambda GetAccountSettings: the concurrency quota is moto's own knob, MOTO_LAMBDA_CONCURRENCY_QUOTA (1000, a
  new account's, when unset), which moto's PutFunctionConcurrency enforces too; the unreserved share is the quota
  less every function's reservation.
- EC2 GetEbsDefaultKmsKeyId: `alias/aws/ebs` until ModifyEbsDefaultKmsKeyId names another key.
- Service Quotas GetServiceQuota for EC2's standard vCPU quotas, from `Account.ec2_quotas`.
- The Spot service-linked role under the name AWS gives it (moto's CreateServiceLinkedRole names it otherwise).
Every patch is undone when `serve` exits.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

from spotcr_cli.preflight import ON_DEMAND_VCPU_QUOTA, SPOT_ROLE, SPOT_ROLE_PATH, SPOT_VCPU_QUOTA

DEFAULT_LAMBDA_CONCURRENCY = 1000
ACCOUNT_SETTINGS_PATH = r"{0}/(?P<api_version>[^/]+)/account-settings/?$"


@dataclass
class Account:
    """The account's EC2 vCPU quotas by quota code (a test lowers one to break a check on purpose)."""

    ec2_quotas: dict[str, float] = field(default_factory=lambda: {SPOT_VCPU_QUOTA: 640.0, ON_DEMAND_VCPU_QUOTA: 640.0})


@contextlib.contextmanager
def serve(account: Account) -> Iterator[Account]:
    from moto.awslambda import urls as lambda_urls
    from moto.awslambda.responses import LambdaResponse
    from moto.ec2.responses.elastic_block_store import ElasticBlockStore
    from moto.servicequotas.models import ServiceQuotasBackend

    original_quota = ServiceQuotasBackend.get_service_quota

    def get_service_quota(backend: Any, service_code: str, quota_code: str) -> dict[str, Any]:
        if service_code == "ec2" and quota_code in account.ec2_quotas:
            return {"ServiceCode": "ec2", "QuotaCode": quota_code, "Value": account.ec2_quotas[quota_code]}
        return original_quota(backend, service_code, quota_code)

    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.dict(lambda_urls.url_paths, {ACCOUNT_SETTINGS_PATH: LambdaResponse.dispatch}))
        patches.enter_context(
            mock.patch.object(LambdaResponse, "get_account_settings", _lambda_account_settings, create=True)
        )
        patches.enter_context(
            mock.patch.object(ElasticBlockStore, "get_ebs_default_kms_key_id", _ebs_default_key, create=True)
        )
        patches.enter_context(mock.patch.object(ServiceQuotasBackend, "get_service_quota", get_service_quota))
        yield account


def _lambda_account_settings(response: Any) -> tuple[int, dict[str, str], str]:
    quota = int(os.environ.get("MOTO_LAMBDA_CONCURRENCY_QUOTA", DEFAULT_LAMBDA_CONCURRENCY))
    functions = list(response.backend.list_functions())
    reserved = sum(int(f.reserved_concurrency or 0) for f in functions)
    limits = {"ConcurrentExecutions": quota, "UnreservedConcurrentExecutions": quota - reserved}
    usage = {"TotalCodeSize": 0, "FunctionCount": len(functions)}
    return 200, {}, json.dumps({"AccountLimit": limits, "AccountUsage": usage})


def _ebs_default_key(response: Any) -> Any:
    from moto.core.responses import ActionResult

    return ActionResult({"KmsKeyId": response.ec2_backend.default_kms_key_id or "alias/aws/ebs"})


def create_spot_role(iam: Any) -> str:
    """AWSServiceRoleForEC2Spot, as the stack's SpotServiceLinkedRole leaves it in the account."""
    trust = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Principal": {"Service": "spot.amazonaws.com"}, "Action": "sts:AssumeRole"}],
    }
    role = iam.create_role(RoleName=SPOT_ROLE, Path=SPOT_ROLE_PATH, AssumeRolePolicyDocument=json.dumps(trust))
    return str(role["Role"]["Arn"])
