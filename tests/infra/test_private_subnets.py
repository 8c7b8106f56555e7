"""Private subnets: a job VM boots and runs with no route to the internet (issue 21, defect 4).

Function URLs are reachable over the internet only, so with `private_subnets` the store credentials come from a
private API Gateway API (AWS_IAM) that only the job VMs' role may call, only through the stack's execute-api VPC
endpoint; and every other AWS service a job VM calls has its endpoint in the job subnets.
"""

from __future__ import annotations

import json
import re
from typing import Any

from infra.network import VPC_ENDPOINTS
from tests.infra.conftest import REPO_ROOT, Synth

# Besides the services the agent's own clients call (build-artifact.sh keeps their botocore models), SSM Agent's
# message channels and the private API; sts only serves credential chains a VM with an instance role never uses.
SSM_AGENT_SERVICES = {"ssm", "ssmmessages", "ec2messages"}


def _agent_services() -> set[str]:
    script = (REPO_ROOT / "vm-bootstrap" / "build-artifact.sh").read_text()
    return set(re.search(r'AGENT_SERVICES="([^"]+)"', script).group(1).split()) - {"sts"}  # type: ignore[union-attr]


def _service(endpoint: dict[str, Any]) -> str:
    _, parts = endpoint["Properties"]["ServiceName"]["Fn::Join"]
    return str(parts[-1]).removeprefix(".")


def _endpoints(synth: Synth) -> dict[str, dict[str, Any]]:
    return {_service(e): e["Properties"] for e in synth.of_type("AWS::EC2::VPCEndpoint").values()}


def _subnet_refs(synth: Synth) -> list[Any]:
    return sorted(({"Ref": k} for k in synth.of_type("AWS::EC2::Subnet")), key=json.dumps)


def test_the_private_vpc_has_no_route_to_the_internet(private_synth: Synth) -> None:
    assert not private_synth.of_type("AWS::EC2::InternetGateway")
    assert not private_synth.of_type("AWS::EC2::NatGateway")
    assert not private_synth.of_type("AWS::EC2::Route")  # route tables hold only their local route
    subnets = private_synth.of_type("AWS::EC2::Subnet").values()
    assert len(subnets) == 2 and not any(s["Properties"].get("MapPublicIpOnLaunch") for s in subnets)


def test_every_service_a_job_vm_calls_has_an_endpoint_in_the_job_subnets(private_synth: Synth) -> None:
    endpoints = _endpoints(private_synth)
    assert set(endpoints) == _agent_services() | SSM_AGENT_SERVICES | {"execute-api"}
    # S3 (SSM Agent's package, the agent asset, checkpoints) through the gateway, on every job subnet's route table
    s3 = endpoints.pop("s3")
    assert s3["VpcEndpointType"] == "Gateway"
    route_tables = private_synth.of_type("AWS::EC2::SubnetRouteTableAssociation").values()
    assert sorted(s3["RouteTableIds"], key=json.dumps) == sorted(
        (a["Properties"]["RouteTableId"] for a in route_tables), key=json.dumps
    )
    [group_id] = [k for k in private_synth.of_type("AWS::EC2::SecurityGroup") if k.startswith("NetworkEndpoint")]
    for service, endpoint in endpoints.items():
        # The service's usual name resolves to the endpoint, so nothing on the VM is configured differently
        assert endpoint["VpcEndpointType"] == "Interface" and endpoint["PrivateDnsEnabled"] is True, service
        assert sorted(endpoint["SubnetIds"], key=json.dumps) == _subnet_refs(private_synth), service
        assert endpoint["SecurityGroupIds"] == [{"Fn::GetAtt": [group_id, "GroupId"]}], service
    # The endpoints answer HTTPS from job VMs only
    assert "SecurityGroupIngress" not in private_synth.resources[group_id]["Properties"]
    [ingress] = [
        rule["Properties"]
        for rule in private_synth.of_type("AWS::EC2::SecurityGroupIngress").values()
        if rule["Properties"]["GroupId"] == {"Fn::GetAtt": [group_id, "GroupId"]}
    ]
    assert (ingress["FromPort"], ingress["ToPort"], ingress["IpProtocol"]) == (443, 443, "tcp")
    assert ingress["SourceSecurityGroupId"]["Fn::GetAtt"][0].startswith("NetworkJobSecurityGroup")
    assert len(endpoints) == len(VPC_ENDPOINTS)


def test_store_credentials_come_from_a_private_api_only_job_vms_reach_through_the_endpoint(
    private_synth: Synth,
) -> None:
    # No function URL: it would be reachable over the internet only
    assert not private_synth.of_type("AWS::Lambda::Url")
    [(api_id, api)] = private_synth.of_type("AWS::ApiGateway::RestApi").items()
    [endpoint_id] = [k for k in private_synth.of_type("AWS::EC2::VPCEndpoint") if "ExecuteApi" in k]
    properties = api["Properties"]
    assert properties["EndpointConfiguration"] == {"Types": ["PRIVATE"], "VpcEndpointIds": [{"Ref": endpoint_id}]}
    allow, deny = properties["Policy"]["Statement"]
    # Only the job VMs' role may invoke it, and nobody but through the stack's execute-api endpoint
    assert allow["Effect"] == "Allow" and allow["Action"] == "execute-api:Invoke"
    role_id, _ = allow["Principal"]["AWS"]["Fn::GetAtt"]
    assert role_id.startswith("VmLaunchJobRole")
    assert (deny["Effect"], deny["Principal"], deny["Resource"]) == ("Deny", {"AWS": "*"}, "execute-api:/*")
    assert deny["Condition"] == {"StringNotEquals": {"aws:SourceVpce": {"Ref": endpoint_id}}}
    # Its one method: GET with AWS_IAM (SigV4), proxied to the store-credentials function
    [method] = private_synth.of_type("AWS::ApiGateway::Method").values()
    assert (method["Properties"]["HttpMethod"], method["Properties"]["AuthorizationType"]) == ("GET", "AWS_IAM")
    integration = method["Properties"]["Integration"]
    assert integration["Type"] == "AWS_PROXY"
    assert "Functionsstorecredentials" in json.dumps(integration["Uri"])
    # Only that API's stage may invoke the function (no console test-invoke permission)
    permissions = [
        p["Properties"]
        for p in private_synth.of_type("AWS::Lambda::Permission").values()
        if p["Properties"]["Principal"] == "apigateway.amazonaws.com"
    ]
    assert len(permissions) == 1 and api_id in json.dumps(permissions[0]["SourceArn"])
    # The job VMs are told the API's address as they were told the URL, and so is the user
    data = next(iter(private_synth.of_type("AWS::EC2::LaunchTemplate").values()))["Properties"]["LaunchTemplateData"]
    user_data = json.dumps(data["UserData"])
    assert f'STORE_CREDENTIALS_URL=\\"https://", {{"Ref": "{api_id}"}}, ".execute-api.' in user_data
    output = private_synth.template.to_json()["Outputs"]["StoreCredentialsUrl"]["Value"]
    assert {"Ref": api_id} in output["Fn::Join"][1]


def test_an_existing_vpcs_private_subnets_get_the_endpoints_on_their_route_tables(private_custom_synth: Synth) -> None:
    assert not private_custom_synth.of_type("AWS::EC2::VPC")
    assert not private_custom_synth.of_type("AWS::EC2::Subnet")
    endpoints = _endpoints(private_custom_synth)
    assert endpoints["s3"]["RouteTableIds"] == ["rtb-0aaaaaaaaaaaaaaa1", "rtb-0bbbbbbbbbbbbbbb2"]
    assert endpoints["execute-api"]["SubnetIds"] == ["subnet-0aaaaaaaaaaaaaaa1", "subnet-0bbbbbbbbbbbbbbb2"]
    assert all(e["VpcId"] == "vpc-0123456789abcdef0" for e in endpoints.values())
    assert not private_custom_synth.of_type("AWS::Lambda::Url")
    assert len(private_custom_synth.of_type("AWS::ApiGateway::RestApi")) == 1


def test_public_subnets_keep_the_function_url_and_add_no_endpoint(default_synth: Synth) -> None:
    assert len(default_synth.of_type("AWS::Lambda::Url")) == 1
    assert not default_synth.of_type("AWS::EC2::VPCEndpoint")
    assert not default_synth.of_type("AWS::ApiGateway::RestApi")
