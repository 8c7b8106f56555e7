"""EC2 Instance Rebalance Recommendation → a periodic checkpoint now."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from spotcr_functions import checkpoints
from spotcr_functions.handlers import _edge
from spotcr_functions.models import RebalanceRecommendation
from spotcr_functions.observability import logger, metrics, tracer


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    recommendation = _edge.parse_or_none(event, RebalanceRecommendation)
    if recommendation is None:
        return {"action": "ignored", "reason": "malformed rebalance recommendation"}
    deps = _edge.deps()
    return _edge.once(deps, event, context, lambda _: checkpoints.on_rebalance(deps, recommendation.detail.instance_id))
