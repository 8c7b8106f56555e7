"""DynamoDB: one request at a time, since DynamoDB applies each item write whole. moto checks a write's condition,
then applies its actions to the stored item in place, one by one. Its server serves each request in a thread of
its own, so without this a read could see half a write (an ended job's status without its exit code), and two
conditional writes could both pass the same condition (two ends of one job)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from rehearsal.localaws import wrap

# Re-entrant: a request served in-process by a handler already inside one (none today) must not wait for itself.
_ONE_AT_A_TIME = threading.RLock()


def atomic_requests(patches: contextlib.ExitStack) -> None:
    """Until `patches` closes, each DynamoDB request is served whole before the next one starts."""
    from moto.dynamodb.responses import DynamoHandler

    def make(original: Any) -> Any:
        def call_action(handler: Any) -> Any:
            with _ONE_AT_A_TIME:
                return original(handler)

        return call_action

    wrap(patches, DynamoHandler, "call_action", make)
