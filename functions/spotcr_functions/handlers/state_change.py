"""EC2 Instance State-change Notification → register a tagged job on running; recover on a missed warning."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from spotcr_functions import jobs, recovery
from spotcr_functions.handlers import _edge
from spotcr_functions.models import StateChange
from spotcr_functions.observability import logger, metrics, tracer

DOWN_STATES = ("stopping", "stopped", "shutting-down", "terminated")


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    change = _edge.parse_or_none(event, StateChange)
    if change is None:
        return {"action": "ignored", "reason": "malformed state-change notification"}
    instance_id, state = change.detail.instance_id, change.detail.state
    deps = _edge.deps()
    if state == "running":
        return _edge.once(deps, event, context, lambda _: jobs.register_instance(deps, instance_id))
    if state in DOWN_STATES:
        at = change.time.isoformat().replace("+00:00", "Z")
        return _edge.once(deps, event, context, lambda _: recovery.on_instance_down(deps, instance_id, state, at))
    logger.debug("state not acted on", instance_id=instance_id, state=state)
    return {"action": "ignored", "reason": f"state {state}"}
