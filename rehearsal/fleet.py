"""What moto's EC2 Fleet lacks, done as AWS does: the instances a fleet launches from a launch template carry the
template's `aws:ec2launchtemplate:id` and `aws:ec2launchtemplate:version` tags, as RunInstances' instances do
(spotcr's TerminateInstances grant requires the first). The patch is undone when `launch_template_tags` exits."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock


def tagging(create_fleet: Callable[..., Any]) -> Callable[..., Any]:
    """moto's FleetsBackend.create_fleet, with the launch template's tags on the instances the fleet launched."""

    def create_fleet_tagged(backend: Any, *args: Any, **kwargs: Any) -> Any:
        fleet = create_fleet(backend, *args, **kwargs)
        instances = [request.instance for request in fleet.spot_requests if getattr(request, "instance", None)]
        instances += [launched["instance"] for launched in fleet.on_demand_instances]
        for spec in fleet.launch_specs[:1]:  # spotcr's fleets have one launch template
            template_spec = spec.launch_template_spec or {}
            template = backend.get_launch_template(template_id=template_spec["LaunchTemplateId"])
            version = template.get_version(template_spec.get("Version", "$Default")).number
            tags = {"aws:ec2launchtemplate:id": template.id, "aws:ec2launchtemplate:version": str(version)}
            for instance in instances:
                instance.add_tags(tags)
        return fleet

    return create_fleet_tagged


@contextlib.contextmanager
def launch_template_tags() -> Iterator[None]:
    from moto.ec2.models.fleets import FleetsBackend

    with mock.patch.object(FleetsBackend, "create_fleet", tagging(FleetsBackend.create_fleet)):
        yield
