"""Store credentials for job VMs: a job VM's S3 credentials for its own job's prefix.

Served at the function URL (AuthType AWS_IAM), or, with private subnets, behind a private API Gateway REST API
(AWS_IAM) that job VMs reach through the stack's execute-api VPC endpoint. Both name the SigV4 caller in the
event, in different places; `credentials_request` reads either into one request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aws_lambda_powertools.utilities.parser.models import APIGatewayProxyEventModel, LambdaFunctionUrlModel
from aws_lambda_powertools.utilities.typing import LambdaContext

from spotcr_functions import store_access
from spotcr_functions.handlers import _edge
from spotcr_functions.observability import logger, metrics, tracer


@dataclass(frozen=True)
class CredentialsRequest:
    """Who asks (the SigV4 caller's ARN, as the front door verified it) and for which job."""

    job_id: str | None
    user_arn: str | None


def credentials_request(event: Any) -> CredentialsRequest | None:
    """A function URL request (payload 2.0) or an API Gateway REST proxy request; anything else is None."""
    if isinstance(event, dict) and "httpMethod" in event:
        api = _edge.parse_or_none(event, APIGatewayProxyEventModel)
        if api is None:
            return None
        # AWS_IAM on a REST API method: API Gateway names the verified caller in requestContext.identity.
        return CredentialsRequest(
            (api.queryStringParameters or {}).get("job"), api.requestContext.identity.userArn or None
        )
    url = _edge.parse_or_none(event, LambdaFunctionUrlModel)
    if url is None:
        return None
    authorizer = url.requestContext.authorizer
    user_arn = authorizer.iam.userArn if authorizer and authorizer.iam else None
    return CredentialsRequest((url.queryStringParameters or {}).get("job"), user_arn)


def _response(status: int, body: dict[str, Any]) -> dict[str, Any]:
    return {"statusCode": status, "headers": {"content-type": "application/json"}, "body": json.dumps(body)}


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    request = credentials_request(event)
    if request is None:
        return _response(400, {"error": "not a function URL or API Gateway request"})
    try:
        return _response(200, store_access.vend(_edge.deps(), request.job_id, request.user_arn))
    except store_access.Refused as refused:
        logger.warning("store credentials refused", caller=request.user_arn, job=request.job_id, reason=refused.reason)
        return _response(refused.status, {"error": refused.reason})
