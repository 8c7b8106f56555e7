"""Agent lifecycle events (source spotcr.agent) → registry updates and resumed workflow steps."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext
from spotcr_contracts import events

from spotcr_functions import agent_events
from spotcr_functions.handlers import _edge
from spotcr_functions.observability import logger, metrics, tracer


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    if not isinstance(event, dict) or event.get("source") != events.SOURCE:
        logger.debug("not an agent event")
        return {"action": "ignored", "reason": "not an agent event"}
    detail = event.get("detail")
    try:
        if not isinstance(detail, dict):
            raise events.InvalidEvent("detail is not an object")
        agent_event = events.parse_detail(str(event.get("detail-type", "")), detail)
    except events.InvalidEvent as error:
        logger.warning("malformed agent event ignored", error=str(error))
        return {"action": "ignored", "reason": str(error)}
    deps = _edge.deps()
    # Once per event: a copy EventBridge redelivers, or the agent resends with the same event_id, changes nothing.
    return _edge.once(deps, event, context, lambda _: agent_events.on_agent_event(deps, agent_event))
