"""Task tokens meet answers (agent events, SSM command results): whichever of (token stored, answer arrived) comes
second resumes the workflow.

Both sides write with one atomic UpdateItem returning ALL_NEW, so at least one of them sees both halves.

Invariant: an answer completes only the wait it answers. The key names the wait, and each restore attempt of a
generation has its own key (registry.restore_key, from the Attempt of the restore command whose SSM result is the
answer: recovery.on_restore_command); the generation stored with both halves must match. So a duplicated failure
of attempt N lands on attempt N's key (whose token was used already) and never completes attempt N+1's token, and
a retried step of the same attempt finds its answer instead of forgetting it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aws_lambda_powertools import Logger

from spotcr_functions.deps import Deps
from spotcr_functions.models import JobRecord
from spotcr_functions.observability import SERVICE

logger = Logger(service=SERVICE, child=True)


def wait_for(deps: Deps, job_id: str, key: str, generation: int, token: str) -> None:
    """Store the waiting step's token; complete it now if the event is already here."""
    record = deps.registry.store_token(job_id, key, generation, token)
    arrival = record.arrival(key)
    if arrival and arrival.get("generation") == generation:
        _complete(deps, token, arrival, job_id=job_id, key=key, how="token stored after the event")


def arrive(
    deps: Deps, job_id: str, key: str, generation: int, output: Mapping[str, Any], *, error: str = "", cause: str = ""
) -> bool:
    """Record the event's outcome; resume the waiting step if its token is already stored. False when stale."""
    arrival = {"output": dict(output), "error": error, "cause": cause}
    record = deps.registry.record_arrival(job_id, key, generation, arrival)
    if record is None:
        logger.info("event for another generation ignored", job_id=job_id, key=key, generation=generation)
        return False
    _complete_if_waiting(deps, record, key, generation)
    return True


def _complete_if_waiting(deps: Deps, record: JobRecord, key: str, generation: int) -> None:
    token = record.token(key)
    arrival = record.arrival(key)
    if token and arrival and token.get("generation") == generation:
        _complete(
            deps, str(token["token"]), arrival, job_id=record.job_id, key=key, how="event arrived after the token"
        )


def _complete(deps: Deps, token: str, arrival: Mapping[str, Any], *, job_id: str, key: str, how: str) -> None:
    error = str(arrival.get("error") or "")
    output = arrival.get("output") or {}
    resumed = deps.cloud.complete_task(token, output, error=error, cause=str(arrival.get("cause") or ""))
    logger.info("workflow step resumed", job_id=job_id, key=key, error=error or None, how=how, first=resumed)
