"""What moto's EC2 Fleet lacks, done as AWS does:
- the instances a fleet launches from a launch template carry the template's `aws:ec2launchtemplate:id` and
  `aws:ec2launchtemplate:version` tags, as RunInstances' instances do (spotcr's TerminateInstances grant requires
  the first);
- a launch EC2 refuses (no capacity, a quota) is reported as AWS reports it: RunInstances fails with the code; an
  instant fleet lists the override in its Errors and tries its next one (moto 5 reports no Errors and always takes
  the first override);
- a launch repeated with its ClientToken launches nothing more: EC2 answers as it did the first time ("Ensuring
  idempotency of Amazon EC2 API requests"); moto launches again (a step retried after its launch went through
  then had two backups, which AWS never gives it).
Each patch is entered into the caller's ExitStack, and undone when it closes."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from rehearsal.localaws import wrap

# (instance type, subnet id, market) of a launch -> the error code EC2 refuses it with; None: it launches.
Refusal = Callable[[str, str, str], str | None]


def idempotent_launches(patches: contextlib.ExitStack) -> None:
    """moto's CreateFleet and RunInstances, each answering a repeated ClientToken with its first answer."""
    from moto.ec2.responses.fleets import Fleets
    from moto.ec2.responses.instances import InstanceResponse

    answered: dict[tuple[str, str, str], Any] = {}
    lock = threading.Lock()

    def once_per_token(action: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def launch(response: Any) -> Any:
                token = response._get_param("ClientToken")
                if not token:
                    return original(response)
                key = (response.current_account, action, str(token))
                with lock:  # one launch per token, even for two calls at once
                    if key not in answered:
                        answered[key] = original(response)
                    return answered[key]

            return launch

        return make

    wrap(patches, Fleets, "create_fleet", once_per_token("CreateFleet"))
    wrap(patches, InstanceResponse, "run_instances", once_per_token("RunInstances"))


def launch_template_tags(patches: contextlib.ExitStack) -> None:
    """moto's CreateFleet, with the launch template's tags on the instances the fleet launched."""
    from moto.ec2.models.fleets import FleetsBackend

    def tagging(create_fleet: Callable[..., Any]) -> Callable[..., Any]:
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

    wrap(patches, FleetsBackend, "create_fleet", tagging)


def refuse_launches(patches: contextlib.ExitStack, refusal: Refusal) -> list[tuple[str, str, str]]:
    """EC2 refuses the launches `refusal` names, until `patches` closes. Returns every launch tried, in order:
    (instance type, subnet id, market)."""
    from moto.ec2.exceptions import EC2ClientError
    from moto.ec2.models.fleets import Fleet
    from moto.ec2.models.instances import InstanceBackend
    from moto.ec2.responses.fleets import Fleets

    tried: list[tuple[str, str, str]] = []

    def run_instances(original: Any) -> Any:
        def refused(backend: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("lifecycle") != "spot":  # a fleet's spot instance was decided in create_spot_requests
                market = "spot" if kwargs.get("instance_market_options") else "on-demand"
                tried.append((str(kwargs.get("instance_type")), str(kwargs.get("subnet_id")), market))
                code = refusal(*tried[-1])
                if code:
                    raise EC2ClientError(code, f"{code} (as documented)")
            return original(backend, *args, **kwargs)

        return refused

    def create_spot_requests(original: Any) -> Any:
        def next_override(fleet: Any, weight: float) -> Any:
            specs, fleet.errors = fleet.launch_specs, []
            for spec in specs:
                tried.append((str(spec.instance_type), str(spec.subnet_id), "spot"))
                code = refusal(*tried[-1])
                if code is None:
                    fleet.launch_specs = [spec]
                    try:
                        return original(fleet, weight)
                    finally:
                        fleet.launch_specs = specs
                launched = {"LaunchTemplateSpecification": spec.launch_template_spec, "Overrides": spec.overrides}
                error = {"ErrorCode": code, "ErrorMessage": f"{code} (as documented)", "Lifecycle": "spot"}
                fleet.errors.append({"LaunchTemplateAndOverrides": launched, **error})
            return fleet.spot_requests

        return next_override

    def create_fleet(original: Any) -> Any:
        def with_errors(response: Any) -> Any:
            result = original(response)
            body: Any = result.result
            fleet = response.ec2_backend.get_fleet(body["FleetId"])
            if getattr(fleet, "errors", None):
                body["Errors"] = fleet.errors
            return result

        return with_errors

    wrap(patches, InstanceBackend, "run_instances", run_instances)
    wrap(patches, Fleet, "create_spot_requests", create_spot_requests)
    wrap(patches, Fleets, "create_fleet", create_fleet)
    return tried
