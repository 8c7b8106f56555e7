"""EC2: a resource's own tags read from its entry in moto's tag books, not by a scan of every tag in the account.

moto answers `resource.get_tags()` (each instance of a DescribeInstances answer, each tag filter it applies) with
describe_tags filtered by the resource's id, which walks every tag of every resource: a listing of n instances
costs n^2, and in a wave of a hundred jobs the local AWS serves one request at a time (rehearsal/controlplane.py),
an artefact AWS does not have. The answer is the same list, in the same order (tests/localaws/test_ec2_tags.py).
Entered into the caller's ExitStack, and undone when it closes."""

from __future__ import annotations

import contextlib
from typing import Any

from rehearsal.localaws import wrap

_PATTERN = frozenset("*?[")  # an id with these is a filter pattern in describe_tags: moto's own path then


def own_tags(patches: contextlib.ExitStack) -> None:
    from moto.ec2.models.core import TaggedEC2Resource
    from moto.ec2.utils import EC2_PREFIX_TO_RESOURCE, get_prefix

    def make(original: Any) -> Any:
        def get_tags(resource: Any) -> list[dict[str, str]]:
            resource_id = resource.id
            if not resource_id or not isinstance(resource_id, str) or _PATTERN & set(resource_id):
                return list(original(resource))
            tags = resource.ec2_backend.tags.get(resource_id, {})
            kind = EC2_PREFIX_TO_RESOURCE.get(get_prefix(resource_id), "")
            return [
                {"resource_id": resource_id, "key": key, "value": value, "resource_type": kind}
                for key, value in tags.items()
            ]

        return get_tags

    wrap(patches, TaggedEC2Resource, "get_tags", make)
