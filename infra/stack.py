"""The spotcr stack: composes one construct per concern and wires their names together."""

from __future__ import annotations

from pathlib import Path

from aws_cdk import CfnOutput, Fn, Stack
from constructs import Construct
from spotcr_contracts import commands, fis
from spotcr_contracts.settings import FunctionSettings
from spotcr_functions import catalog

from infra import grants
from infra.control_plane import FunctionEnvironment, Functions, Registry
from infra.fault_injection import FaultInjection
from infra.monitoring import Monitoring
from infra.network import Network
from infra.probe import ProbeDocument
from infra.settings import Settings
from infra.spot_role import SpotServiceLinkedRole
from infra.storage import Storage
from infra.store_access import StoreAccess
from infra.vm_launch import BOOTSTRAP_SCRIPT, VmLaunch
from infra.workflow import RECOVERY_ASL, Workflow, recovery_state_machine_name, state_machine_arn


class SpotcrStack(Stack):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        settings: Settings,
        bootstrap_script: Path = BOOTSTRAP_SCRIPT,
        recovery_asl: Path = RECOVERY_ASL,
    ) -> None:
        super().__init__(
            scope,
            construct_id,
            stack_name=settings.stack_name,
            description="spotcr: run long jobs on EC2 Spot without losing work (CRIU checkpoints, automatic recovery)",
        )
        network = Network(self, "Network", settings=settings)
        SpotServiceLinkedRole(self, "SpotServiceLinkedRole")
        storage = Storage(self, "Storage", settings=settings, network=network)
        registry = Registry(self, "Registry", settings=settings)
        vm = VmLaunch(
            self,
            "VmLaunch",
            settings=settings,
            network=network,
            storage=storage,
            agent_bus=registry.agent_bus,
            bootstrap_script=bootstrap_script,
        )
        probe = ProbeDocument(self, "Probe", settings=settings)
        store_access = StoreAccess(
            self, "StoreAccess", bucket=storage.bucket, file_system=storage.file_system, key=storage.checkpoint_key
        )
        recovery_arn = state_machine_arn(self, recovery_state_machine_name(settings))
        documents = {name: document.ref for name, document in vm.documents.items()}
        targets = grants.GrantTargets(
            jobs_table_arn=registry.jobs_table.table_arn,
            jobs_index_names=registry.jobs_index_names,
            idempotency_table_arn=registry.idempotency_table.table_arn,
            document_names=documents,
            launch_template_id=vm.launch_template.launch_template_id or "",
            job_role_arn=vm.job_role.role_arn,
            state_machine_arn=recovery_arn,
            failure_topic_arn=registry.failure_topic.topic_arn,
            failure_topic_key_arn=registry.topic_key.key_arn,
            checkpoint_bucket_name=storage.bucket.bucket_name,
            job_spec_buckets=settings.job_spec_buckets,
            stack=self,
            store_role_arn=store_access.role.role_arn,
            file_system_arn=storage.file_system.file_system_arn if storage.file_system else "",
            ebs_kms_key_arn=settings.ebs_kms_key_arn or "",
        )
        job_subnets = [subnet.subnet_id for subnet in network.subnets]
        function_settings = FunctionSettings(
            jobs_table=registry.jobs_table.table_name,
            idempotency_table=registry.idempotency_table.table_name,
            recovery_state_machine_arn=recovery_arn,
            event_bus_name=registry.agent_bus.event_bus_name,
            failure_topic_arn=registry.failure_topic.topic_arn,
            checkpoint_bucket=storage.bucket.bucket_name,
            launch_template_id=targets.launch_template_id,
            launch_template_version=vm.launch_template.latest_version_number,
            checkpoint_document=documents["checkpoint"],
            final_dump_document=documents["final-dump"],
            restore_document=documents["restore"],
            release_document=documents["release"],
            status_document=documents["status"],
            subnet_ids=tuple(job_subnets),
            keep_finished_volumes=settings.keep_finished_volumes,
            store_role_arn=store_access.role.role_arn,
            job_role_name=vm.job_role.role_name,
            file_system_id=storage.file_system.file_system_id if storage.file_system else "",
            pending_timeout_minutes=settings.pending_timeout_minutes,
            stack_name=settings.stack_name,
            checkpoint_key_arn=storage.checkpoint_key.key_arn if storage.checkpoint_key else "",
        )
        functions = Functions(
            self,
            "Functions",
            settings=settings,
            registry=registry,
            environment=FunctionEnvironment(function_settings),
            grant_targets=targets,
        )
        store_url = store_access.serve(
            functions.functions["store-credentials"], vm.job_role, network.endpoints.get("ExecuteApi")
        )
        vm.store_credentials_url.value = store_url

        def substitution(kind: str) -> str:
            category, _, name = kind.partition(":")
            by_kind = {
                "table:jobs": registry.jobs_table.table_name,
                "table:idempotency": registry.idempotency_table.table_name,
                "topic:failure": registry.failure_topic.topic_arn,
                "launch-template": targets.launch_template_id,
                "bus": registry.agent_bus.event_bus_name,
                "bucket": storage.bucket.bucket_name,
                "subnets": Fn.join(",", job_subnets),
                "security-group": network.job_security_group.security_group_id,
            }
            if kind in by_kind:
                return by_kind[kind]
            if category == "function" and name in functions.functions:
                return functions.functions[name].function_arn
            if category == "document" and name in documents:
                return documents[name]
            raise ValueError(f"unknown workflow substitution kind {kind!r}")

        workflow = Workflow(
            self,
            "Workflow",
            settings=settings,
            substitution_values=substitution,
            step_function_arns=[functions.functions[f.name].function_arn for f in catalog.FUNCTIONS if f.workflow_step],
            grant_targets=targets,
            asl_path=recovery_asl,
        )
        Monitoring(
            self,
            "Monitoring",
            settings=settings,
            registry=registry,
            functions=functions,
            state_machine=workflow.state_machine,
        )

        faults = FaultInjection(self, "FaultInjection", settings=settings)

        outputs = {
            "CheckpointBucket": storage.bucket.bucket_name,
            "JobTable": registry.jobs_table.table_name,
            "AgentEventBus": registry.agent_bus.event_bus_name,
            "LaunchTemplateId": targets.launch_template_id,
            "LaunchTemplateVersion": function_settings.launch_template_version,
            "RecoveryStateMachineArn": workflow.state_machine.state_machine_arn,
            "JobInstanceProfile": vm.instance_profile.instance_profile_name,
            "JobSubnets": Fn.join(",", job_subnets),
            "JobSecurityGroup": network.job_security_group.security_group_id,
            "FailureTopicArn": registry.failure_topic.topic_arn,
            "DeadLetterQueueUrl": registry.dead_letters.queue_url,
            "StoreCredentialsUrl": store_url,
        }
        for name, document in documents.items():
            outputs[commands.document_output(name)] = document
        outputs["ProbeDocument"] = probe.document.ref
        for kind, template in faults.templates.items():
            outputs[fis.OUTPUTS[kind]] = template.ref
        if storage.checkpoint_key is not None:
            outputs["CheckpointKeyArn"] = storage.checkpoint_key.key_arn
        if storage.file_system is not None:
            outputs["EfsFileSystemId"] = storage.file_system.file_system_id
        if storage.lustre is not None:
            outputs["FsxDnsName"] = storage.lustre.dns_name
            outputs["FsxMountName"] = storage.lustre.mount_name
        for name, value in outputs.items():
            CfnOutput(self, name, value=value)
