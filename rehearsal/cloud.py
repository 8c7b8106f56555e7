"""A local AWS in one process: moto on loopback, plus what moto does not do, done as AWS does it.

moto serves EC2, S3, DynamoDB, SSM, EventBridge, SNS, Lambda and Step Functions (executing the
real ASL). The rehearsal adds, in-process and only here:
- Lambda: invoking a function calls its real handler from the catalog, with the stack's settings;
- EventBridge: rules built from the catalog deliver matching events to their Lambda targets, and
  the scheduled rule fires on a compressed interval;
- SSM Run Command: the document's agent command runs inside the target local VM, once that VM's
  SSM agent stand-in registered (rehearsal/localaws/ssm.py: SendCommand refuses others with InvalidInstanceId);
- Lambda function URLs: the store-credentials URL (AuthType AWS_IAM) has a stand-in on the VMs' network that
  checks the SigV4 signature and the caller's and the function's policies (rehearsal/store_credentials.py) and
  calls the real handler;
- EC2: RunInstances boots local VMs, TerminateInstances ends them, volumes are loop devices, and
  instance state-change events are emitted as AWS emits them;
- FIS: StartExperiment of an `aws:ec2:send-spot-instance-interruptions` template does what FIS does to its
  target spot instances: the rebalance recommendation (when the duration is above two minutes) and the
  interruption notice on the VM's IMDS and as EC2 events, then the termination (`fis_notice_s` stands for
  FIS's two minutes);
- CloudFormation: a stack named like the rehearsal's resources whose outputs are the real stack's, so the
  `spotcr` command reads it with `--stack` as it reads a deployed one.
What the workflow tests' control plane (rehearsal/controlplane.py) does too is in rehearsal/localaws, shared.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import json
import logging
import os
import secrets
import sys
import threading
import time
import traceback
import urllib.request
import uuid
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from unittest import mock

import boto3
from spotcr_contracts import fis as fis_templates
from spotcr_contracts.commands import COMMANDS, PROBE, Command, document_output, document_setting
from spotcr_contracts.settings import VmSettings
from spotcr_functions import catalog
from spotcr_functions.config import ENV, Settings

from infra.agent_bundle import BOOTSTRAP_SCRIPT, render_user_data
from rehearsal import account as local_account
from rehearsal import asset
from rehearsal import store_credentials as local_store_credentials
from rehearsal.iam import enforce, principals
from rehearsal.iam import requests as iam_requests
from rehearsal.iam.policy import Principal, Request
from rehearsal.localaws import (
    ACCOUNT,
    REGION,
    addresses,
    awslambda,
    dynamodb,
    ec2_tags,
    fis,
    fleet,
    s3,
    stack,
    stepfunctions,
    tags_of,
    wrap,
)
from rehearsal.localaws import iam as local_iam
from rehearsal.localaws import ssm as local_ssm
from rehearsal.localaws import throttle as rate_limits
from rehearsal.localaws.iam import STACK_CONTEXT
from rehearsal.storage import LoopVolumes
from rehearsal.timeline import Timeline
from rehearsal.vm import LocalVM, VmError, VmNetwork, prepare_host

PREFIX = "spotcr-rehearsal"
SSM_OUTPUT_LIMIT = 24_000  # SSM keeps the first 24,000 characters of a command's output
EVENT_RETRIES = 2  # EventBridge's asynchronous Lambda invocation retries twice
ASSET_BUCKET = f"cdk-hnb659fds-assets-{ACCOUNT}-{REGION}"  # CDK's bootstrap bucket: `cdk deploy` publishes assets there


class LocalCloud:
    """Start with `start()` (or as a context manager); every boto3 client in this process then uses it."""

    def __init__(
        self,
        *,
        run_dir: Path,
        timeline: Timeline,
        schedule_every_s: float = 5.0,
        shared_storage: Path | None = None,
        workflow_waits: dict[str, int] | None = None,
        on_event: Callable[[dict[str, Any]], None] | None = None,
        boot_commands: list[list[str]] | None = None,
        agent_command: list[str] | None = None,
        with_workflow: bool = True,
        fis_notice_s: float = 120.0,
        with_agent_asset: bool = False,
    ) -> None:
        self.run_dir = run_dir
        self.timeline = timeline
        self.schedule_every_s = schedule_every_s
        self.shared_storage = shared_storage
        self.workflow_waits = workflow_waits or {}
        self.on_event = on_event
        self.boot_commands = boot_commands
        self.agent_command = agent_command
        self.with_workflow = with_workflow
        self.fis_notice_s = fis_notice_s
        # True: the stack's launch template names a published agent asset (the rehearsal's VMs install it at boot).
        self.with_agent_asset = with_agent_asset
        self.agent_asset_url = ""  # the asset the stack's latest launch template version names
        # The fault suite's hook (tests/faults): called as (action, bucket, key) before S3 serves a request; it may
        # raise StoreFault (an outage), or act at that exact point (kill an agent mid-upload).
        self.store_fault: Callable[[str, str, str], None] | None = None
        # Also the fault suite's: called as (instance_id, agent argv) just before a command runs in its VM.
        self.on_command: Callable[[str, list[str]], None] | None = None
        self.endpoint = ""
        self.vm_endpoint = ""  # the same server, where the VMs reach it: the host end of their network
        self.network: VmNetwork | None = None
        self._vm_listener: Any = None
        self._store_credentials: Any = None
        self.store_credentials_url = ""  # the store-credentials function URL stand-in, on the VMs' network
        self.store_credentials_granted: dict[str, int] = {}  # instance id -> store sessions the URL vended to it
        self.file_system_id = ""  # the stack's EFS (moto): access points only; efs VMs mount shared_storage
        self.subnet_id = ""  # the stack's job subnet: the VM network's (created with the stack)
        self.vms: dict[str, LocalVM] = {}
        self.volumes = LoopVolumes(run_dir / "volumes")
        self.managed_instances = local_ssm.ManagedInstances(ACCOUNT)
        self.account = local_account.Account()  # what moto lacks of the account's settings (spotcr preflight)
        # Every patch of moto, of the environment and of moto's configuration: closing it undoes them all.
        self._patches = contextlib.ExitStack()
        self.names = {
            "jobs_table": f"{PREFIX}-jobs",
            "idempotency_table": f"{PREFIX}-idempotency",
            "event_bus_name": f"{PREFIX}-agent",
            "checkpoint_bucket": f"{PREFIX}-checkpoints",
            # As the stack names it: its functions' grants name the state machine's ARN.
            "state_machine": principals.state_machine_name(principals.template(STACK_CONTEXT)),
            "topic": f"{PREFIX}-failures",
            "launch_template": f"{PREFIX}-job-vm",
            "job_role": f"{PREFIX}-job",
            "store_role": f"{PREFIX}-job-store",
            "fis_role": f"{PREFIX}-fis",  # the stack's FaultInjectionRole: FIS acts as it in experiments
        }
        self.settings: Settings | None = None  # the functions' settings, as the stack sets them
        self.settings_env: dict[str, str] = {}
        self.functions = awslambda.Functions(f"{PREFIX}-")
        self._documents: dict[str, Command] = {}
        self._delivery = ThreadPoolExecutor(max_workers=8, thread_name_prefix="eventbridge")
        self._commands = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ssm")
        self._stop = threading.Event()
        self._scheduler: threading.Thread | None = None
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        # moto's books of which volume is attached where (an instance's block-device mapping): its server serves
        # requests on threads of their own, and a termination's clean-up (_terminated) runs on another. Moto's
        # TerminateInstances lists the mapping, then reads each entry: a detach between the two failed it with a
        # KeyError (HTTP 500), where EC2 terminates an instance whatever its volumes are doing. Re-entrant: a
        # termination detaches its volumes through the hooked DetachVolume.
        self._volume_books = threading.RLock()
        self._saved_stdout: Any = None
        self._functions_log: Any = None
        self.enforcer: enforce.Enforcer | None = None
        self._job_policies: tuple[Mapping[str, Any], ...] | None = None  # the job role's, as deployed now
        self.stack_outputs: dict[str, str] = {}  # the CloudFormation stack's outputs, as `spotcr` reads them
        self.agent_asset = ("", "")  # where the stack's agent asset is (bucket, key): the job role may read it there

    def __enter__(self) -> LocalCloud:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def client(self, service: str) -> Any:
        return boto3.client(service, region_name=REGION, endpoint_url=self.endpoint)

    def throttle(self, limits: rate_limits.Limits, **time: Any) -> rate_limits.Meter:
        """AWS's rate limits on every call from here until stop() (rehearsal.localaws.throttle; off unless asked):
        `time` may give the throttle's `clock` and `sleep`."""
        return rate_limits.install(self._patches, limits, **time)

    def start(self) -> None:
        """Start it; a start that fails undoes what it did, so no patch of it outlives it in the process (a test
        after it would meet a cloud that is not running)."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        from moto.core.config import default_user_config

        prepare_host()
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        # Powertools warns on every invocation that publishes no metric; the rehearsal's output is its progress lines.
        warnings.filterwarnings("ignore", message="No application metrics to publish")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        moto_config = {"stepfunctions": {"execute_state_machine": True}, "lambda": {"use_docker": False}}
        self._patches.enter_context(mock.patch.dict(default_user_config, moto_config))
        self._patches.enter_context(mock.patch.dict(os.environ))  # what the cloud sets is unset by stop()
        os.environ["MOTO_EC2_LOAD_DEFAULT_AMIS"] = "false"  # loading moto's public images takes seconds
        host, port = _moto_server().get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.network = VmNetwork.create()
        self._vm_listener = _listen_for_vms(self.network.gateway, port)
        self.vm_endpoint = f"http://{self.network.gateway}:{port}"
        # moto's backends live in the process: start from an empty account, as after a fresh deploy.
        reset = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")  # noqa: S310 (loopback http)
        urllib.request.urlopen(reset).close()  # noqa: S310 (http to the server just started)
        os.environ.update(
            {
                "MOTO_PORT": str(port),  # moto's Step Functions calls Lambda at localhost:$MOTO_PORT
                "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_SESSION_TOKEN": "testing",
                "AWS_DEFAULT_REGION": REGION,
                "AWS_REGION": REGION,
                "POWERTOOLS_TRACE_DISABLED": "true",
                "POWERTOOLS_SERVICE_NAME": "spotcr",
                "POWERTOOLS_LOG_LEVEL": os.environ.get("POWERTOOLS_LOG_LEVEL", "WARNING"),
            }
        )
        # Handlers log and publish metrics on stdout, as in Lambda; here that is the run's functions.log.
        self._functions_log = (self.run_dir / "functions.log").open("a", buffering=1)
        self._saved_stdout = sys.stdout
        _STDOUT.target = self._functions_log
        sys.stdout = _STDOUT
        # moto's own log (workflow engine errors included) goes to the run's cloud.log, also after stop():
        # executions still in flight when a run is cut short keep logging there, not on the terminal.
        moto_logger = logging.getLogger("moto")
        for handler in [h for h in moto_logger.handlers if getattr(h, "spotcr_rehearsal", False)]:
            moto_logger.removeHandler(handler)
            handler.close()
        cloud_log = logging.FileHandler(self.run_dir / "cloud.log")
        cloud_log.spotcr_rehearsal = True  # type: ignore[attr-defined]
        moto_logger.addHandler(cloud_log)
        moto_logger.propagate = False
        self._install_hooks()
        self._patches.enter_context(local_account.serve(self.account))
        self._create_stack()
        # From here on every call but the deployer's is evaluated against the synthesized stack's IAM.
        self.enforcer = self._enforcer()
        self._patches.enter_context(enforce.enforced(self.enforcer))
        self._store_credentials = local_store_credentials.serve(
            self.network.gateway,
            account=ACCOUNT,
            region=REGION,
            store=principals.store_credentials_address(self._local(), principals.template(STACK_CONTEXT)),
            enforcer=self.enforcer,
            handler=self._vend_store_credentials,
        )
        self.store_credentials_url = f"http://{self.network.gateway}:{self._store_credentials.server_address[1]}/"
        self._scheduler = threading.Thread(target=self._run_schedule, name="schedule", daemon=True)
        self._scheduler.start()

    def spawn(self, target: Callable[..., Any], *args: Any, name: str) -> None:
        """Run `target` in a thread of this cloud's own: `stop` waits for it, so nothing it does (a termination,
        an event) reaches the cloud that a later test starts in the same process."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def sleep(self, seconds: float) -> bool:
        """Wait `seconds`; False if the cloud stopped meanwhile (the caller then does nothing more)."""
        return not self._stop.wait(seconds)

    def stop(self) -> None:
        self._stop.set()
        for vm in list(self.vms.values()):
            vm.terminate()
        self._join_threads(timeout_s=30)
        if self._store_credentials is not None:
            self._store_credentials.shutdown()
            self._store_credentials.server_close()
            self._store_credentials = None
        if self._vm_listener is not None:
            self._vm_listener.shutdown()
            self._vm_listener.server_close()
            self._vm_listener = None
        if self.network is not None:
            self.network.close()
        self._commands.shutdown(wait=False, cancel_futures=True)
        self._delivery.shutdown(wait=False, cancel_futures=True)
        self.volumes.release_all()
        self._patches.close()
        if self._saved_stdout is not None:
            # Loggers made meanwhile hold the redirecting stream: it writes to the real stdout again.
            _STDOUT.target = self._saved_stdout
            sys.stdout = self._saved_stdout
            self._saved_stdout = None
            self._functions_log.close()

    @property
    def vm_env(self) -> dict[str, str]:
        """What any local VM's processes see: the cloud's endpoint on their network and its region. No credentials:
        a VM that is no EC2 instance has no instance profile (`instance_env` is a job VM's)."""
        return {"AWS_ENDPOINT_URL": self.vm_endpoint, "AWS_DEFAULT_REGION": REGION, "AWS_REGION": REGION}

    def as_cli_user(self) -> contextlib.AbstractContextManager[None]:
        """Calls made inside are the `spotcr` user's: its own key, holding only infra/user_policy.py's policy."""
        return enforce.acting_as(enforce.CLI_USER_KEY)

    def instance_env(self, instance_id: str) -> dict[str, str]:
        """What a job VM's processes see: `vm_env` and credentials of its own, the instance profile role's session
        for this instance (on AWS from its IMDS), as IAM names it and with the context AWS gives it."""
        assert self.enforcer is not None and self._job_policies is not None, (
            "instances launch only while the cloud runs"
        )
        key = enforce.access_key(f"instance:{instance_id}")
        session = f"arn:aws:sts::{ACCOUNT}:assumed-role/{self.names['job_role']}/{instance_id}"
        instance_arn = f"arn:aws:ec2:{REGION}:{ACCOUNT}:instance/{instance_id}"
        principal = Principal(session, self._job_policies)
        secret = secrets.token_hex(20)  # its own: what AWS checks a signature with (the function URL stand-in)
        self.enforcer.add_key(key, principal, {"ec2:SourceInstanceARN": instance_arn}, secret)
        return {**self.vm_env, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}

    def _create_stack(self) -> None:
        """The resources `cdk deploy` creates, built from the same definitions infra/ uses."""
        names = self.names
        s3 = self.client("s3")
        s3.create_bucket(Bucket=names["checkpoint_bucket"])
        stack.create_registry(self.client("dynamodb"), names["jobs_table"], names["idempotency_table"])
        self.client("events").create_event_bus(Name=names["event_bus_name"])
        topic_arn = self.client("sns").create_topic(Name=names["topic"])["TopicArn"]
        documented = (*COMMANDS.values(), PROBE)  # PROBE: the stack's probe document, for `spotcr probe`
        document_names = stack.create_documents(self.client("ssm"), f"{PREFIX}-", documented)
        self._documents = {document_names[command.name]: command for command in documented}
        ec2 = self.client("ec2")
        image_id = ec2.register_image(Name=f"{PREFIX}-job-vm", Architecture="x86_64")["ImageId"]
        template_id = ec2.create_launch_template(
            LaunchTemplateName=names["launch_template"],
            LaunchTemplateData={
                "ImageId": image_id,
                "InstanceType": "c5.large",
                "MetadataOptions": {"HttpTokens": "required", "InstanceMetadataTags": "enabled"},
                "UserData": self._job_vm_user_data(self._publish_agent_asset("deployment 1")),
            },
        )["LaunchTemplate"]["LaunchTemplateId"]
        self.image_id = image_id
        # The stack's job subnet is the VM network's: an instance's address in EC2's books is its VM's, and a node's
        # address moves only within it, as in a VPC.
        assert self.network is not None, "the VM network comes first"
        vpc_id = ec2.create_vpc(CidrBlock=str(self.network.subnet))["Vpc"]["VpcId"]
        self.subnet_id = ec2.create_subnet(
            VpcId=vpc_id, CidrBlock=str(self.network.subnet), AvailabilityZone=f"{REGION}a"
        )["Subnet"]["SubnetId"]
        local_account.create_spot_role(self.client("iam"))  # the stack's SpotServiceLinkedRole
        role_arn = self.client("iam").create_role(
            RoleName=f"{PREFIX}-role", AssumeRolePolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": []})
        )["Role"]["Arn"]
        iam = self.client("iam")
        for name in (names["job_role"], names["store_role"]):
            iam.create_role(
                RoleName=name, AssumeRolePolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": []})
            )
        state_machine_arn = f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:{names['state_machine']}"
        # The stack's EFS as deployed with efs=true: efs jobs get an access point each (the VMs mount a shared dir).
        self.file_system_id = self.client("efs").create_file_system(CreationToken=PREFIX, Encrypted=True)[
            "FileSystemId"
        ]
        settings = Settings(
            jobs_table=names["jobs_table"],
            idempotency_table=names["idempotency_table"],
            recovery_state_machine_arn=state_machine_arn,
            event_bus_name=names["event_bus_name"],
            failure_topic_arn=topic_arn,
            checkpoint_bucket=names["checkpoint_bucket"],
            launch_template_id=template_id,
            launch_template_version="1",
            checkpoint_document=document_names["checkpoint"],
            final_dump_document=document_names["final-dump"],
            restore_document=document_names["restore"],
            release_document=document_names["release"],
            status_document=document_names["status"],
            store_role_arn=f"arn:aws:iam::{ACCOUNT}:role/{names['store_role']}",
            job_role_name=names["job_role"],
            file_system_id=self.file_system_id,
            subnet_ids=(self.subnet_id,),
            # The tag value the stack's grants require on the volumes and snapshots spotcr creates.
            stack_name=principals.function_setting(principals.template(STACK_CONTEXT), ENV["stack_name"]),
        )
        waits: dict[str, Any] = dict(self.workflow_waits)  # Settings' numbers by field name
        self.settings = replace(settings, **waits)
        self.settings_env = self.settings.to_env()
        os.environ.update(self.settings_env)
        lambda_client = self.client("lambda")
        function_arns: dict[str, str] = {}
        for function in catalog.FUNCTIONS:
            arn = lambda_client.create_function(
                FunctionName=self.functions.prefix + function.name,
                Runtime="python3.12",
                Role=role_arn,
                Handler=function.handler,
                Code={"ZipFile": _placeholder_zip()},
                Timeout=function.timeout_s,
                MemorySize=function.memory_mb,
                Environment={"Variables": self.settings_env},
            )["FunctionArn"]
            function_arns[function.name] = arn
        if self.with_workflow:
            self.client("stepfunctions").create_state_machine(
                name=names["state_machine"],
                definition=stack.recovery_definition(function_arns, document_names, topic_arn),
                roleArn=role_arn,
            )
        self._create_stack_outputs(template_id, state_machine_arn)
        events = self.client("events")
        for function in catalog.FUNCTIONS:
            for rule in function.rules:
                rule_name = f"{PREFIX}-{rule.name}"
                bus = names["event_bus_name"] if rule.agent_bus else "default"
                if rule.schedule_minutes is not None:
                    events.put_rule(
                        Name=rule_name, ScheduleExpression=f"rate({rule.schedule_minutes} minute)", EventBusName=bus
                    )
                else:
                    pattern = rule.pattern_for(state_machine_arn)
                    events.put_rule(Name=rule_name, EventPattern=json.dumps(pattern), EventBusName=bus)
                events.put_targets(
                    Rule=rule_name,
                    EventBusName=bus,
                    Targets=[{"Id": function.name, "Arn": function_arns[function.name]}],
                )

    def _local(self) -> principals.Local:
        """Where the stack's resources are in this cloud."""
        assert self.settings is not None, "the stack is created first"
        return local_iam.local(
            self.settings,
            function_prefix=self.functions.prefix,
            job_role=self.names["job_role"],
            store_role=self.names["store_role"],
            file_system_id=self.file_system_id,
            fis_role=self.names["fis_role"],
        )

    def _enforcer(self) -> enforce.Enforcer:
        """IAM as the synthesized stack grants it, in this cloud (rehearsal.localaws.iam), with its resource
        policies, the job VMs' role and the `spotcr` user's."""
        where = self._local()
        roles = local_iam.stack_roles(where)
        # The rehearsal itself: it deploys the stack as CloudFormation would, plays the user and AWS's services.
        enforcer = local_iam.enforcer(roles, trusted={"testing": "the rehearsal"}, where=where)
        enforcer.add_key(enforce.CLI_USER_KEY, principals.cli_user(ACCOUNT, PREFIX, REGION, self.stack_outputs))
        # Each job VM signs as its own session of the job role (instance_env).
        self._job_policies = roles.job.policies
        self.agent_asset = principals.agent_asset(roles.job)
        if self.agent_asset_url:  # published here under its own hash: the grant names the asset deployed
            bucket, key = self.agent_asset
            self._job_policies = _asset_granted(self._job_policies, f"s3://{bucket}/{key}", self.agent_asset_url)
        return enforcer

    def _create_stack_outputs(self, template_id: str, state_machine_arn: str) -> None:
        """The stack's FIS experiment templates, and a CloudFormation stack whose outputs name what `spotcr` reads."""
        fis = self.client("fis")
        outputs = {
            "CheckpointBucket": self.names["checkpoint_bucket"],
            "JobTable": self.names["jobs_table"],
            "AgentEventBus": self.names["event_bus_name"],
            "LaunchTemplateId": template_id,
            "LaunchTemplateVersion": self.settings_env[ENV["launch_template_version"]],
            "RecoveryStateMachineArn": state_machine_arn,
        }
        for command in COMMANDS.values():
            outputs[document_output(command.name)] = self.settings_env[ENV[document_setting(command.name)]]
        outputs["ProbeDocument"] = f"{PREFIX}-{PROBE.name}"
        outputs["EfsFileSystemId"] = self.file_system_id
        outputs["JobSubnets"] = self.subnet_id
        for kind, output in fis_templates.OUTPUTS.items():
            created = fis.create_experiment_template(
                clientToken=str(uuid.uuid4()),
                **fis_templates.template(kind, f"arn:aws:iam::{ACCOUNT}:role/{self.names['fis_role']}"),
            )
            outputs[output] = created["experimentTemplate"]["id"]
        self.client("cloudformation").create_stack(StackName=PREFIX, TemplateBody=json.dumps(_stack_template(outputs)))
        self.stack_outputs = outputs

    def upgrade_stack(self, deployment: str) -> str:
        """What `cdk deploy` of a changed agent does: the new asset published under its own key, a new launch
        template version naming it ($Default stays 1: CloudFormation never moves it), the functions' settings and the
        stack's output naming that version (a Lambda configuration update), and the job role's read of the old asset
        gone (CDK grants it per asset). `deployment` is written into the asset; returns the new version."""
        old = self.agent_asset_url
        user_data = self._job_vm_user_data(self._publish_agent_asset(deployment))
        ec2, template_id = self.client("ec2"), self.settings_env[ENV["launch_template_id"]]
        latest = ec2.describe_launch_template_versions(LaunchTemplateId=template_id, Versions=["$Latest"])
        data = {**latest["LaunchTemplateVersions"][0]["LaunchTemplateData"], "UserData": user_data}
        created = ec2.create_launch_template_version(LaunchTemplateId=template_id, LaunchTemplateData=data)
        version = str(created["LaunchTemplateVersion"]["VersionNumber"])
        assert self.settings is not None, "the stack is created first"
        self.settings = replace(self.settings, launch_template_version=version)
        self.settings_env = self.settings.to_env()
        os.environ.update(self.settings_env)  # the in-process handlers read their settings at each invocation's edge
        lambda_client = self.client("lambda")
        for function in catalog.FUNCTIONS:
            lambda_client.update_function_configuration(
                FunctionName=self.functions.prefix + function.name, Environment={"Variables": self.settings_env}
            )
        cloudformation = self.client("cloudformation")
        stack = cloudformation.describe_stacks(StackName=PREFIX)["Stacks"][0]
        outputs = {output["OutputKey"]: output["OutputValue"] for output in stack.get("Outputs", [])}
        outputs["LaunchTemplateVersion"] = version
        cloudformation.update_stack(StackName=PREFIX, TemplateBody=json.dumps(_stack_template(outputs)))
        self.stack_outputs = outputs
        if self.enforcer is not None:  # the user's policy names what the stack's outputs name
            self.enforcer.add_key(enforce.CLI_USER_KEY, principals.cli_user(ACCOUNT, PREFIX, REGION, outputs))
        if old and self._job_policies is not None:
            self._job_policies = _asset_granted(self._job_policies, old, self.agent_asset_url)
        return version

    def _publish_agent_asset(self, deployment: str) -> str:
        """The agent asset, published as `cdk deploy` publishes it before it creates or updates the stack."""
        if self.with_agent_asset:
            self.agent_asset_url = asset.publish(self.client("s3"), ASSET_BUCKET, deployment)
        return self.agent_asset_url

    def _job_vm_user_data(self, asset_url: str) -> str:
        """The launch template's user data: bootstrap.sh naming the agent asset as infra/ renders it (what the
        rehearsal's boot passes itself is left empty), or bootstrap.sh as is when the stack has no asset."""
        script = BOOTSTRAP_SCRIPT.read_text()
        if asset_url:
            values = VmSettings(
                agent_asset_url=asset_url,
                bucket=self.names["checkpoint_bucket"],
                event_bus=self.names["event_bus_name"],
                store_credentials_url=self.store_credentials_url,
            )
            script = render_user_data(script, values.placeholders())
        return base64.b64encode(script.encode()).decode()

    def _install_hooks(self) -> None:
        from moto.events.models import EventsBackend, Rule
        from moto.ssm.models import SimpleSystemManagerBackend

        cloud = self
        patches = self._patches
        self.functions.serve(patches)
        dynamodb.atomic_requests(patches)
        dynamodb.wire_form_values(patches)
        stepfunctions.keep_failure_cause(patches)
        stepfunctions.lambda_errors_named(patches)
        stepfunctions.parse_once(patches)
        fleet.launch_template_tags(patches)
        fleet.idempotent_launches(patches)
        ec2_tags.own_tags(patches)
        addresses.reassigned_addresses(patches)

        def send_to_targets(original: Any) -> Any:
            def hooked(rule: Any, event: dict[str, Any], transform_input: bool = True) -> None:
                lambda_targets = [t["Arn"] for t in rule.targets if ":lambda:" in t["Arn"]]
                if not lambda_targets:
                    original(rule, event, transform_input)
                elif rule.event_pattern.matches_event(event) and rule.state == "ENABLED":
                    for arn in lambda_targets:
                        cloud._delivery.submit(cloud._deliver, arn, event)

            return hooked

        wrap(patches, Rule, "send_to_targets", send_to_targets)

        def put_events(original: Any) -> Any:
            def hooked(backend: Any, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
                result = original(backend, entries)
                for entry, outcome in zip(entries, result, strict=False):
                    if "EventId" in outcome and cloud.on_event is not None:
                        cloud.on_event(entry)
                return result

            return hooked

        wrap(patches, EventsBackend, "put_events", put_events)

        def send_command(original: Any) -> Any:
            def hooked(backend: Any, *args: Any, **kwargs: Any) -> Any:
                return cloud._send_command(original, backend, *args, **kwargs)

            return hooked

        wrap(patches, SimpleSystemManagerBackend, "send_command", send_command)
        local_ssm.install(patches, self.managed_instances)
        local_ssm.to_instance_ids_only(patches)
        self._install_ec2_hooks()
        fis.interrupt_spot_instances(self._patches, self._start_fis_interrupt, self._fis_may_interrupt)
        s3.verify_checksums(self._patches)
        s3.inject_faults(self._patches, lambda: self.store_fault)

    def _join_threads(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if late := [t.name for t in threads if t.is_alive()]:
            logging.getLogger(__name__).warning("local cloud stopped with threads still running: %s", late)

    def _fis_may_interrupt(self, experiment: Any, instance_ids: list[str]) -> bool:
        """FIS acts as the experiment's role: it finds the targets (DescribeInstances), then interrupts each."""
        assert self.enforcer is not None, "experiments start only while the cloud runs"
        role = self.enforcer.roles.get(experiment.role_arn)
        if role is None:
            self.timeline.say(f"! FIS: the experiment's role {experiment.role_arn} is no role of the stack")
            return False
        interrupt = iam_requests.Call(
            "ec2", "SendSpotInstanceInterruptions", {"InstanceIds": instance_ids}, REGION, ACCOUNT
        )
        requests = [Request("ec2:DescribeInstances", "*")]
        if instance_ids:
            requests += iam_requests.requests_for(interrupt, enforce.MotoState(ACCOUNT, REGION))
        decision = self.enforcer.authorize_as(role, ACCOUNT, requests)
        if not decision.allowed:
            self.timeline.say(f"! FIS experiment {experiment.id} failed: {decision.reason}")
        return decision.allowed

    def _start_fis_interrupt(self, instance_id: str, duration_s: float) -> None:
        self.spawn(self._fis_interrupt, instance_id, duration_s, name=f"fis-{instance_id}")

    def _fis_interrupt(self, instance_id: str, duration_s: float) -> None:
        """What FIS's send-spot-instance-interruptions does to one instance, with its two minutes as fis_notice_s."""
        notice = self.fis_notice_s
        vm = self.vms.get(instance_id)
        if duration_s > 120:
            if vm is not None:
                vm.imds.rebalance = {"noticeTime": _now()}
            self.timeline.say(f"FIS: rebalance recommendation for {instance_id}")
            self.emit_ec2(catalog.REBALANCE_RECOMMENDATION, instance_id, {})
            if self._stop.wait((duration_s - 120) * notice / 120):
                return
        action_time = datetime.now(UTC).timestamp() + notice
        if vm is not None:
            when = datetime.fromtimestamp(action_time, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            vm.imds.instance_action = {"action": "terminate", "time": when}
        self.timeline.point(instance_id, "warning", f"FIS: spot interruption warning for {instance_id}")
        self.emit_ec2(catalog.INTERRUPTION_WARNING, instance_id, {"instance-action": "terminate"})
        if not self._stop.wait(notice):
            self.client("ec2").terminate_instances(InstanceIds=[instance_id])

    def _install_ec2_hooks(self) -> None:
        from moto.ec2.models import EC2Backend

        cloud = self
        patches = self._patches

        def run_instances(original: Any) -> Any:
            def hooked(backend: Any, *args: Any, **kwargs: Any) -> Any:
                reservation = original(backend, *args, **kwargs)
                for instance in reservation.instances:
                    cloud._launch(backend, instance)
                return reservation

            return hooked

        wrap(patches, EC2Backend, "run_instances", run_instances)

        def terminate_instances(original: Any) -> Any:
            def hooked(backend: Any, instance_ids: list[str]) -> Any:
                with cloud._volume_books:
                    result = original(backend, instance_ids)
                for instance, previous in result:
                    if previous.name != "terminated":  # terminating it again changes nothing, as on EC2
                        cloud.spawn(cloud._terminated, backend, instance.id, name=f"terminated-{instance.id}")
                return result

            return hooked

        wrap(patches, EC2Backend, "terminate_instances", terminate_instances)

        def assign_private_ip_addresses(original: Any) -> Any:
            def hooked(backend: Any, eni_id: str, private_ip_addresses: list[str] | None = None, *args: Any) -> Any:
                # EC2 moved the addresses to this interface (localaws.addresses checked the move as EC2 does): the
                # VM network now delivers them to its VM.
                eni = original(backend, eni_id, private_ip_addresses, *args)
                vm = cloud.vms.get(eni.instance.id) if eni.instance is not None else None
                for address in private_ip_addresses or []:
                    if vm is not None and cloud.network is not None and vm.host_interface:
                        cloud._await_gone_holder(backend, address, vm)
                        cloud.network.move(address, vm.host_interface)
                return eni

            return hooked

        wrap(patches, EC2Backend, "assign_private_ip_addresses", assign_private_ip_addresses)

        def attach_volume(original: Any) -> Any:
            def hooked(backend: Any, volume_id: str, instance_id: str, *args: Any, **kwargs: Any) -> Any:
                with cloud._volume_books:
                    attachment = original(backend, volume_id, instance_id, *args, **kwargs)
                vm = cloud.vms.get(instance_id)
                # Only volumes attached to a running local VM get a loop device (moto's root volumes do not).
                if attachment is not None and vm is not None:
                    vm.attach_device(volume_id, cloud.volumes.device(volume_id, attachment.volume.size))
                    cloud.timeline.point(
                        instance_id, "attach", f"storage: volume {volume_id} attached to {instance_id}"
                    )
                return attachment

            return hooked

        wrap(patches, EC2Backend, "attach_volume", attach_volume)

        def detach_volume(original: Any) -> Any:
            def hooked(backend: Any, volume_id: str, instance_id: str | None, *args: Any, **kwargs: Any) -> Any:
                volume = backend.get_volume(volume_id)
                # DetachVolume may omit InstanceId (moto requires it): the volume's current attachment names it.
                with cloud._volume_books:
                    owner = instance_id or (volume.attachment.instance.id if volume.attachment else None)
                    attachment = original(backend, volume_id, owner, *args, **kwargs)
                vm = cloud.vms.get(owner or "")
                if vm is not None:
                    vm.detach_device(volume_id)
                return attachment

            return hooked

        wrap(patches, EC2Backend, "detach_volume", detach_volume)

    def _await_gone_holder(self, backend: Any, address: str, to: LocalVM, timeout_s: float = 30.0) -> None:
        """EC2 deletes a terminated instance's interface with it: the VM of a terminated instance that held the
        address leaves the network (its clean-up runs beside), waited for here. A live holder is left to `move`,
        which refuses it."""
        assert self.network is not None
        deadline = time.monotonic() + timeout_s
        while (holder := self.network.holder(address)) and holder != to.host_interface:
            held_by = next((v for v in list(self.vms.values()) if v.host_interface == holder), None)
            terminated = held_by is not None and backend.get_instance(held_by.instance_id).state == "terminated"
            if not terminated or time.monotonic() > deadline:
                return
            time.sleep(0.1)

    def call_handler(self, name: str, payload: Any) -> Any:
        """Run the stack's function `name` (as deployed: PREFIX-<catalog name>) in this process, as Lambda would."""
        return self.functions.call(self.functions.catalog_name(name), payload)

    def _deliver(self, function_arn: str, event: dict[str, Any]) -> None:
        """EventBridge's asynchronous invocation of a rule's Lambda target, with its retries."""
        name = function_arn.rsplit(":function:", maxsplit=1)[-1]
        for attempt in range(EVENT_RETRIES + 1):
            if self._stop.is_set():
                return
            try:
                self.call_handler(name, event)
                return
            except Exception as error:
                self.timeline.say(
                    f"! {name} failed on {event.get('detail-type')} (attempt {attempt + 1}): "
                    f"{type(error).__name__}: {error}"
                )
                with (self.run_dir / "handler-errors.log").open("a") as log:
                    log.write(f"{name} {json.dumps(event)}\n{traceback.format_exc()}\n")
                time.sleep(1 + attempt)

    def _run_schedule(self) -> None:
        """Fire the scheduled rules on a compressed interval (a minute becomes `schedule_every_s`)."""
        from moto.events.models import events_backends

        while not self._stop.wait(self.schedule_every_s):
            backend = events_backends[ACCOUNT][REGION]
            for bus in list(backend.event_buses.values()):
                for rule in list(bus.rules.values()):
                    if not rule.scheduled_expression or rule.state != "ENABLED":
                        continue
                    event = {
                        "version": "0",
                        "id": str(uuid.uuid4()),
                        "detail-type": "Scheduled Event",
                        "source": "aws.events",
                        "account": ACCOUNT,
                        "time": _now(),
                        "region": REGION,
                        "resources": [rule.arn],
                        "detail": {},
                    }
                    for target in rule.targets:
                        if ":lambda:" in target["Arn"]:
                            self._delivery.submit(self._deliver, target["Arn"], event)

    def emit_ec2(self, detail_type: str, instance_id: str, detail: dict[str, Any]) -> None:
        """An AWS service event on the default bus, as EC2 sends it."""
        self.client("events").put_events(
            Entries=[
                {
                    "Source": "aws.ec2",
                    "DetailType": detail_type,
                    "Detail": json.dumps({"instance-id": instance_id, **detail}),
                    "Resources": [f"arn:aws:ec2:{REGION}:{ACCOUNT}:instance/{instance_id}"],
                }
            ]
        )

    def _launch(self, backend: Any, instance: Any) -> None:
        instance_id = instance.id
        tags = tags_of(backend, instance_id)
        role = "backup" if tags.get("spotcr:mode") == "restore" else "primary"
        generation = tags.get("spotcr:generation", "0")
        self.timeline.label(instance_id, f"{role} g{generation}\n{instance_id[:12]}")
        user_data = base64.b64decode(str(instance.user_data)) if instance.user_data else b""
        assert self.network is not None, "instances launch only while the local cloud runs"
        # EC2 gives the instance its private address at launch; here the VM network does, and moto's books say so.
        address = self.network.reserve()
        interface = instance.nics[0]
        interface.private_ip_address = address
        interface.private_ip_addresses = [{"Primary": True, "PrivateIpAddress": address}]
        vm = LocalVM(
            instance_id=instance_id,
            instance_type=instance.instance_type,
            availability_zone=instance.placement.zone or f"{REGION}a",
            user_data=user_data,
            tags=lambda: tags_of(backend, instance_id),
            root=self.run_dir / "vms",
            cloud_env=self.instance_env(instance_id),
            network=self.network,
            shared_storage=self.shared_storage,
            boot_commands=self.boot_commands,
            agent_command=self.agent_command,
            address=address,
        )
        with self._lock:
            self.vms[instance_id] = vm
        self.timeline.point(
            instance_id,
            "launch",
            f"{role} VM {instance_id} launched ({instance.instance_type}, generation {generation})",
        )
        self.spawn(self._boot, vm, name=f"boot-{instance_id}")

    def _boot(self, vm: LocalVM) -> None:
        self.emit_ec2(catalog.STATE_CHANGE, vm.instance_id, {"state": "pending"})
        try:
            vm.boot()
        except VmError as error:
            self.timeline.say(f"! {error}")
            return
        vm.running_at = self.timeline.now()
        self.timeline.say(f"{vm.instance_id} running at {vm.address} (its own network, /tmp, /dev/shm and /proc)")
        self.emit_ec2(catalog.STATE_CHANGE, vm.instance_id, {"state": "running"})

    def _vend_store_credentials(self, event: dict[str, Any]) -> dict[str, Any]:
        response: dict[str, Any] = self.call_handler(f"{PREFIX}-store-credentials", event)
        if response.get("statusCode") == 200:
            instance_id = event["requestContext"]["authorizer"]["iam"]["userArn"].rsplit("/", 1)[-1]
            with self._lock:
                self.store_credentials_granted[instance_id] = self.store_credentials_granted.get(instance_id, 0) + 1
        return response

    def _terminated(self, backend: Any, instance_id: str) -> None:
        vm = self.vms.get(instance_id)
        self.managed_instances.lost(instance_id)
        self.emit_ec2(catalog.STATE_CHANGE, instance_id, {"state": "shutting-down"})
        if vm is not None:
            vm.terminate()
        with self._volume_books:
            for volume in list(backend.volumes.values()):
                attachment = volume.attachment
                if attachment is not None and attachment.instance.id == instance_id:
                    # Terminating an instance detaches its data volumes.
                    volume.attachment = None
                    attachment.instance.block_device_mapping.pop(attachment.device, None)
        self.timeline.point(instance_id, "terminated", f"{instance_id} terminated")
        self.emit_ec2(catalog.STATE_CHANGE, instance_id, {"state": "terminated"})

    def _send_command(self, original: Any, backend: Any, *args: Any, **kwargs: Any) -> Any:
        """SendCommand: checked as SSM checks it, then run in each target VM while the caller polls."""
        from moto.core.exceptions import JsonRESTError

        document_name = kwargs.get("document_name") or (args[1] if len(args) > 1 else None)
        parameters = kwargs.get("parameters") or {}
        command_definition = self._documents.get(document_name or "")
        argv: list[str] = []
        if command_definition is not None:
            try:
                argv = command_definition.agent_argv({k: v[0] for k, v in parameters.items() if v})
            except ValueError as error:
                raise JsonRESTError("InvalidParameters", str(error)) from error
        self.managed_instances.refuse_unregistered(kwargs.get("instance_ids") or [])
        command = original(backend, *args, **kwargs)
        if command_definition is None:
            return command
        command.status = "InProgress"
        command.status_details = "InProgress"
        for invocation in command.invocations:
            invocation.update({"Status": "InProgress", "StatusDetails": "InProgress", "ResponseCode": -1})
            self._commands.submit(self._run_command, command, invocation, argv)
        return command

    def _run_command(self, command: Any, invocation: dict[str, Any], argv: list[str]) -> None:
        instance_id = invocation["InstanceId"]
        vm = self.vms.get(instance_id)
        try:
            if vm is None or vm.terminated:
                raise VmError(f"{instance_id} is not running")
            if self.on_command is not None:
                self.on_command(instance_id, argv)
            result = vm.run(argv, timeout_s=float(command.timeout_seconds))
            status = "Success" if result.returncode == 0 else "Failed"
            invocation.update(
                {
                    "ResponseCode": result.returncode,
                    "StandardOutputContent": result.stdout[:SSM_OUTPUT_LIMIT],
                    "StandardErrorContent": result.stderr[:SSM_OUTPUT_LIMIT],
                }
            )
        except VmError:
            status = "Undeliverable"
        except Exception as error:
            status = "Failed"
            invocation["StandardErrorContent"] = f"{type(error).__name__}: {error}"
        invocation.update({"Status": status, "StatusDetails": status, "ExecutionEndDateTime": _now()})
        with (self.run_dir / "commands.log").open("a") as log:
            log.write(
                f"{_now()} {instance_id} {' '.join(argv[1:])} -> {status} {invocation.get('ResponseCode')}\n"
                f"{invocation.get('StandardOutputContent', '')}{invocation.get('StandardErrorContent', '')}\n"
            )
        statuses = {i["Status"] for i in command.invocations}
        if "InProgress" not in statuses:
            command.status = "Success" if statuses == {"Success"} else "Failed"
            command.status_details = command.status
        self.emit_command_ended(
            instance_id, command.command_id, command.document_name, status, command.requested_date_time
        )

    def emit_command_ended(
        self, instance_id: str, command_id: str, document_name: str, status: str, requested: datetime
    ) -> None:
        """SSM's "EC2 Command Invocation Status-change Notification" for one instance, as AWS documents it
        (tests/events/ssm/command-invocation-status-change.json): it says where to look, never the output."""
        self.client("events").put_events(
            Entries=[
                {
                    "Source": "aws.ssm",
                    "DetailType": catalog.COMMAND_INVOCATION_STATUS_CHANGE,
                    "Detail": json.dumps(
                        local_ssm.command_ended_detail(instance_id, command_id, document_name, status, requested)
                    ),
                    "Resources": [f"arn:aws:ec2:{REGION}:{ACCOUNT}:instance/{instance_id}"],
                }
            ]
        )


class _Redirect(io.TextIOBase):
    """A stdout that writes wherever `target` points, so loggers bound to it follow the redirection."""

    def __init__(self) -> None:
        self.target: Any = sys.stdout

    def write(self, text: str) -> int:
        return int(self.target.write(text))

    def flush(self) -> None:
        self.target.flush()


_STDOUT = _Redirect()


def _asset_granted(
    policies: tuple[Mapping[str, Any], ...], old_url: str, new_url: str
) -> tuple[Mapping[str, Any], ...]:
    """The job role's policies with its read of the agent asset at `old_url` moved to `new_url` (s3:// URLs), as the
    stack's update grants the asset it publishes (CDK grants per asset)."""

    def arn(url: str) -> str:
        return "arn:aws:s3:::" + url.removeprefix("s3://")

    return tuple(
        json.loads(json.dumps(policy).replace(f'"{arn(old_url)}"', f'"{arn(new_url)}"')) for policy in policies
    )


@functools.cache
def _moto_server() -> Any:
    """One server per process: handlers cache their clients (as warm Lambdas do), so the endpoint must not move."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    return server


def _listen_for_vms(address: str, port: int) -> Any:
    """The moto server's app also on the VMs' network (it stays on loopback: Step Functions calls localhost)."""
    from moto.moto_server.werkzeug_app import MotoRequestHandler
    from werkzeug.serving import make_server

    server = make_server(address, port, _moto_server()._server.app, True, request_handler=MotoRequestHandler)
    threading.Thread(target=server.serve_forever, name="moto-for-vms", daemon=True).start()
    return server


def _stack_template(outputs: dict[str, str]) -> dict[str, Any]:
    """The rehearsal's CloudFormation stack: one resource, and the real stack's outputs for `spotcr --stack`."""
    return {
        "Resources": {
            "Marker": {
                "Type": "AWS::SSM::Parameter",
                "Properties": {"Name": f"/{PREFIX}/stack", "Type": "String", "Value": "rehearsal"},
            }
        },
        "Outputs": {name: {"Value": value} for name, value in outputs.items()},
    }


def _placeholder_zip() -> bytes:
    """Lambda wants a code package; the rehearsal runs the handlers from the checkout instead."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("README.txt", "spotcr rehearsal: handlers run in-process from functions/\n")
    return buffer.getvalue()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@contextlib.contextmanager
def local_cloud(**kwargs: Any) -> Iterator[LocalCloud]:
    cloud = LocalCloud(**kwargs)
    cloud.start()
    try:
        yield cloud
    finally:
        cloud.stop()
