"""Publishing the agent's lifecycle events (spotcr_contracts.events) to the project's bus."""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any, Protocol

from spotcr_contracts.events import AgentEvent

log = logging.getLogger(__name__)


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class Publisher(Protocol):
    def publish(self, event: AgentEvent) -> bool: ...


class EventBridgePublisher:
    """PutEvents with a few retries; a failure is logged and never raised, so it cannot stop a job."""

    def __init__(self, bus_name: str, region: str, attempts: int = 4, backoff_s: float = 0.5) -> None:
        self._bus_name = bus_name
        self._region = region
        self._attempts = attempts
        self._backoff_s = backoff_s
        self._client: Any = None

    def _events(self) -> Any:
        if self._client is None:
            import boto3

            self._client = boto3.client("events", region_name=self._region or None)
        return self._client

    def publish(self, event: AgentEvent) -> bool:
        if not self._bus_name:
            log.warning("no event bus configured; %s not published", event.DETAIL_TYPE)
            return False
        entry = event.to_entry(self._bus_name)
        for attempt in range(1, self._attempts + 1):
            try:
                response = self._events().put_events(Entries=[entry])
                if not response.get("FailedEntryCount"):
                    return True
                failure = response["Entries"][0]
                reason = f"{failure.get('ErrorCode')}: {failure.get('ErrorMessage')}"
            except Exception as error:
                reason = f"{type(error).__name__}: {error}"
            log.warning("publishing %s failed (attempt %d/%d): %s", event.DETAIL_TYPE, attempt, self._attempts, reason)
            if attempt < self._attempts:
                time.sleep(self._backoff_s * 2 ** (attempt - 1))
        log.error("gave up publishing %s", event.DETAIL_TYPE)
        return False
