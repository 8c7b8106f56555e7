"""What every handler does at the edge: settings once, adapters cached for warm starts, idempotency, parsing."""

from __future__ import annotations

import functools
from collections.abc import Callable
from functools import cache
from typing import Any, TypeVar

from aws_lambda_powertools.utilities.idempotency import DynamoDBPersistenceLayer, IdempotencyConfig, idempotent_function
from aws_lambda_powertools.utilities.idempotency.exceptions import IdempotencyPersistenceLayerError
from aws_lambda_powertools.utilities.parser import parse
from botocore.exceptions import ClientError
from pydantic import BaseModel, ValidationError

from spotcr_functions.cloud import CLIENT_CONFIG, Throttled, is_throttle
from spotcr_functions.config import Settings
from spotcr_functions.deps import Deps
from spotcr_functions.observability import emit_metric, logger

Model = TypeVar("Model", bound=BaseModel)
Handler = TypeVar("Handler", bound=Callable[..., Any])


@cache
def _deps(settings: Settings) -> Deps:
    return Deps.from_settings(settings, metric=emit_metric)


def deps() -> Deps:
    return _deps(Settings.from_env())


@cache
def _persistence(table_name: str) -> DynamoDBPersistenceLayer:
    return DynamoDBPersistenceLayer(table_name=table_name, boto_config=CLIENT_CONFIG)


def throttles_named(handler: Handler) -> Handler:
    """A throttle that outlasted the SDK's retries leaves the handler as `Throttled`: the error name the state
    machine's Retry waits out (a bare ClientError would be caught as a failed recovery)."""

    @functools.wraps(handler)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return handler(*args, **kwargs)
        except ClientError as error:
            if is_throttle(error):
                raise Throttled(str(error)) from error
            raise

    return run  # type: ignore[return-value]


def once(
    deps: Deps, event: dict[str, Any], context: Any, process: Callable[[dict[str, Any]], dict[str, Any]]
) -> dict[str, Any]:
    """Run `process` once per EC2 event: its detail-type and detail are the key, so redelivered copies match."""
    config = IdempotencyConfig(event_key_jmespath='["detail-type", detail]', raise_on_no_idempotency_key=True)
    if context is not None and hasattr(context, "get_remaining_time_in_millis"):
        config.register_lambda_context(context)

    handled: list[dict[str, Any]] = []

    def run(event: dict[str, Any]) -> dict[str, Any]:
        handled.append(process(event))
        return handled[-1]

    guarded = idempotent_function(
        data_keyword_argument="event",
        persistence_store=_persistence(deps.settings.idempotency_table),
        config=config,
    )(run)
    try:
        return guarded(event=event)
    except IdempotencyPersistenceLayerError as error:
        if not handled:
            raise
        # The event was handled; only recording that failed (a throttled write past its retries). Failing now would
        # have Lambda retry it into the record left in progress (AlreadyInProgress until the invocation's timeout
        # passes), for nothing: the work is done, and a copy delivered later is handled again as the duplicate it is.
        logger.warning("event handled; recording it as handled failed", error=str(error)[:500])
        return handled[-1]


def parse_or_none(event: Any, model: type[Model]) -> Model | None:
    """NTH style: an event that is not the expected kind is ignored with a log line, never retried."""
    try:
        return parse(event=event, model=model)
    except (ValidationError, ValueError, TypeError) as error:
        logger.warning("event ignored: does not match", model=model.__name__, error=str(error)[:500])
        return None
