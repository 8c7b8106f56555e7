"""IAM in the local AWS: the synthesized stack's roles, resolved to the local resources, enforced on every call that
is not the deployer's (rehearsal/iam/enforce.py evaluates each one)."""

from __future__ import annotations

from collections.abc import Mapping

from spotcr_contracts.commands import COMMANDS, document_setting
from spotcr_contracts.settings import FunctionSettings

from rehearsal.iam import enforce, principals
from rehearsal.localaws import ACCOUNT, REGION

# The stack as deployed with efs=true: the EFS grants too.
STACK_CONTEXT = {"efs": "true"}


def local(
    settings: FunctionSettings,
    *,
    function_prefix: str,
    job_role: str,
    store_role: str,
    file_system_id: str,
    fis_role: str = "",
) -> principals.Local:
    """Where the stack's resources are in the local AWS: those the functions' `settings` name, and the roles."""
    names = {
        "RegistryJobs": settings.jobs_table,
        "RegistryIdempotency": settings.idempotency_table,
        "RegistryFailureTopic": settings.failure_topic_arn,
        "RegistryAgentBus": settings.event_bus_name,
        "StorageCheckpoints": settings.checkpoint_bucket,
        "StorageEfs": file_system_id,
        "VmLaunchJobLaunchTemplate": settings.launch_template_id,
        "VmLaunchJobRole": job_role,
        "StoreAccessStoreRole": store_role,
        "WorkflowRecovery": settings.recovery_state_machine_arn.rsplit(":", 1)[-1],
        **{
            f"VmLaunchDocument{command.replace('-', '')}": getattr(settings, document_setting(command))
            for command in COMMANDS
        },
    }
    if fis_role:
        names["FaultInjectionRole"] = fis_role
    return principals.Local(REGION, ACCOUNT, names, function_prefix)


def stack_roles(where: principals.Local) -> principals.StackRoles:
    """The stack's roles, resolved to the local resources."""
    return principals.stack_roles(where, principals.template(STACK_CONTEXT))


def enforcer(
    roles: principals.StackRoles, trusted: Mapping[str, str], where: principals.Local | None = None
) -> enforce.Enforcer:
    """Each function's role (its handler's key), the state machine's (its engine's key), and sessions of any stack
    role that STS vends; `trusted` keys (whoever deploys the stack, as CloudFormation would) are not evaluated.
    With `where`, the stack's resource policies (buckets, Lambda permissions) are evaluated too."""
    keys = {enforce.function_key(name): role.principal() for name, role in roles.functions.items()}
    keys[enforce.STEP_FUNCTIONS_ENGINE_KEY] = roles.workflow.principal()
    return enforce.Enforcer(
        keys=keys,
        trusted=trusted,
        roles={role.arn: role.principal() for role in roles.all()},
        state=enforce.MotoState(ACCOUNT, REGION),
        resource_policies=principals.resource_policies(where, principals.template(STACK_CONTEXT)) if where else {},
    )
