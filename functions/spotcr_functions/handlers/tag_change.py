"""Tag Change on Resource → spotcr:job added to a running instance: register the job; spotcr:mode added: check
that the instance is the backup spotcr launched."""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext
from spotcr_contracts import tags

from spotcr_functions import jobs
from spotcr_functions.handlers import _edge
from spotcr_functions.models import TagChange
from spotcr_functions.observability import logger, metrics, tracer


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    change = _edge.parse_or_none(event, TagChange)
    if change is None:
        return {"action": "ignored", "reason": "malformed tag change"}
    instance_id = change.instance_id()
    if change.detail.resource_type != "instance" or instance_id is None:
        logger.debug("tag change not on an instance", resources=change.resources)
        return {"action": "ignored", "reason": "not an instance"}
    changed = set(change.detail.changed_tag_keys) & {tags.JOB, tags.MODE}
    if not changed or tags.JOB not in change.detail.tags:
        return {"action": "ignored", "reason": f"neither {tags.JOB} nor {tags.MODE} added"}
    deps = _edge.deps()
    return jobs.register_instance(deps, instance_id)
