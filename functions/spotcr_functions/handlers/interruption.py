"""EC2 Spot Instance Interruption Warning → fence the generation, order the final dump, start recovery."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from spotcr_functions import recovery
from spotcr_functions.handlers import _edge
from spotcr_functions.models import InterruptionWarning
from spotcr_functions.observability import logger, metrics, tracer


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    warning = _edge.parse_or_none(event, InterruptionWarning)
    if warning is None:
        return {"action": "ignored", "reason": "malformed interruption warning"}
    deps = _edge.deps()
    warned_at = warning.time.isoformat().replace("+00:00", "Z")
    return _edge.once(
        deps, event, context, lambda _: recovery.on_interruption_warning(deps, warning.detail.instance_id, warned_at)
    )
