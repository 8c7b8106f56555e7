"""EC2 Spot (or Capacity Reservation) Instance Interruption Warning → fence, order the final dump, start recovery."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from spotcr_functions import catalog, recovery
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
    source = "capacity-reservation" if warning.detail_type == catalog.CAPACITY_RESERVATION_WARNING else "spot"
    detail = warning.detail
    return _edge.once(
        deps,
        event,
        context,
        lambda _: recovery.on_interruption_warning(
            deps, detail.instance_id, warned_at, action=detail.instance_action, source=source
        ),
    )
