"""The store-credentials function URL (AuthType AWS_IAM): a job VM's S3 credentials for its own job's prefix."""

from __future__ import annotations

import json
from typing import Any

from aws_lambda_powertools.utilities.parser.models import LambdaFunctionUrlModel
from aws_lambda_powertools.utilities.typing import LambdaContext

from spotcr_functions import store_access
from spotcr_functions.handlers import _edge
from spotcr_functions.observability import logger, metrics, tracer


def _response(status: int, body: dict[str, Any]) -> dict[str, Any]:
    return {"statusCode": status, "headers": {"content-type": "application/json"}, "body": json.dumps(body)}


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    request = _edge.parse_or_none(event, LambdaFunctionUrlModel)
    if request is None:
        return _response(400, {"error": "not a function URL request"})
    authorizer = request.requestContext.authorizer
    user_arn = authorizer.iam.userArn if authorizer and authorizer.iam else None
    job_id = (request.queryStringParameters or {}).get("job")
    try:
        return _response(200, store_access.vend(_edge.deps(), job_id, user_arn))
    except store_access.Refused as refused:
        logger.warning("store credentials refused", caller=user_arn, job=job_id, reason=refused.reason)
        return _response(refused.status, {"error": refused.reason})
