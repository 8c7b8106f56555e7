"""DynamoDB: one request at a time, since DynamoDB applies each item write whole. moto checks a write's condition,
then applies its actions to the stored item in place, one by one. Its server serves each request in a thread of
its own, so without this a read could see half a write (an ended job's status without its exit code), and two
conditional writes could both pass the same condition (two ends of one job).

Also: moto's items leave its backend already in DynamoDB's wire form, and `wire_form_values` lets a plain one
(or a map or list of plain ones) through as it is rather than walking it through every member of the AttributeValue
shape."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from rehearsal.localaws import wrap

# AttributeValue members whose value moto's backend already holds as DynamoDB's JSON carries it: strings, numbers as
# strings, booleans, lists of strings. B and BS are base64 on the wire, M and L hold AttributeValues of their own.
_PLAIN = frozenset({"S", "N", "BOOL", "NULL", "SS", "NS"})

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


def wire_form_values(patches: contextlib.ExitStack) -> None:
    """Until `patches` closes, moto's JSON serializer copies a plain AttributeValue ({"S": "..."}, {"N": "1"}, ...),
    or a map or list holding only plain ones, into the response as it is. Its walk of each one through the shape's
    ten members, each looked up by a model picker, was most of a GetItem's time (4 ms of about 5 here), and in a
    wave of a hundred jobs the local AWS serves one request at a time (rehearsal/controlplane.py): an artefact AWS
    does not have. The bytes sent are the same (tests/localaws/test_dynamodb.py); binary values, and the maps and
    lists holding them, take moto's own path."""
    from moto.core.serialize import BaseJSONSerializer

    def make(original: Any) -> Any:
        def serialize(serializer: Any, serialized: Any, value: Any, shape: Any, key: str) -> None:
            if shape.name == "AttributeValue" and key and _wire_form(value):
                serializer._default_serialize(serialized, value, shape, key)
                return
            original(serializer, serialized, value, shape, key)

        return serialize

    wrap(patches, BaseJSONSerializer, "_serialize_type_structure", make)


def _wire_form(value: Any) -> bool:
    """A plain AttributeValue, or a map or list of nothing but plain ones (at any depth)."""
    if not isinstance(value, dict) or len(value) != 1:
        return False
    [(kind, inner)] = value.items()
    if kind in _PLAIN:
        return inner is not None
    if kind == "M":
        return isinstance(inner, dict) and all(_wire_form(member) for member in inner.values())
    if kind == "L":
        return isinstance(inner, list) and all(_wire_form(member) for member in inner)
    return False
