"""What every logic function gets from its handler: settings, the two adapters, a metric sink, a clock and a
sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from spotcr_functions.cloud import Cloud
from spotcr_functions.config import Settings
from spotcr_functions.registry import Registry

MetricSink = Callable[[str, str, float], None]  # name, unit (Powertools MetricUnit value), value


def utc_now() -> datetime:
    return datetime.now(UTC)


def _discard(name: str, unit: str, value: float) -> None:
    del name, unit, value


@dataclass
class Deps:
    settings: Settings
    registry: Registry
    cloud: Cloud
    metric: MetricSink = _discard
    now: Callable[[], datetime] = field(default=utc_now)
    sleep: Callable[[float], None] = field(default=time.sleep)

    @classmethod
    def from_settings(cls, settings: Settings, metric: MetricSink = _discard) -> Deps:
        return cls(settings=settings, registry=Registry(settings.jobs_table), cloud=Cloud(), metric=metric)

    def iso_now(self) -> str:
        return self.now().isoformat(timespec="milliseconds").replace("+00:00", "Z")

    def unix_now(self) -> int:
        return int(self.now().timestamp())
