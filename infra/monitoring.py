"""Operations: the dashboard and the alarms that page through the failure topic."""

from __future__ import annotations

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_cloudwatch_actions as actions
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct
from spotcr_contracts.tags import SPOT_NOTICE_S
from spotcr_functions.observability import Metric

from infra.control_plane import METRICS_NAMESPACE, SERVICE_NAME, Functions, Registry
from infra.settings import Settings

PERIOD = Duration.minutes(5)


def spotcr_metric(name: Metric, statistic: str = "Sum") -> cloudwatch.Metric:
    return cloudwatch.Metric(
        namespace=METRICS_NAMESPACE,
        metric_name=name.value,
        dimensions_map={"service": SERVICE_NAME},
        statistic=statistic,
        period=PERIOD,
    )


class Monitoring(Construct):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        settings: Settings,
        registry: Registry,
        functions: Functions,
        state_machine: sfn.StateMachine,
    ) -> None:
        super().__init__(scope, construct_id)
        notify = actions.SnsAction(registry.failure_topic)
        self.alarms: list[cloudwatch.Alarm] = []

        def alarm(alarm_id: str, metric: cloudwatch.IMetric, description: str) -> cloudwatch.Alarm:
            created = cloudwatch.Alarm(
                self,
                alarm_id,
                metric=metric,
                threshold=1,
                evaluation_periods=1,
                comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
                alarm_description=description,
            )
            created.add_alarm_action(notify)
            self.alarms.append(created)
            return created

        alarm(
            "RecoveryFailed",
            spotcr_metric(Metric.RECOVERIES_FAILED),
            "A job could not be restored on a backup VM: it is stopped and waits for you (see spotcr:error).",
        )
        alarm(
            "RecoveryExecutionFailed",
            state_machine.metric_failed(period=PERIOD, statistic="Sum"),
            "The recovery workflow failed, timed out or was aborted.",
        )
        alarm(
            "FinalDumpAtRisk",
            spotcr_metric(Metric.FINAL_DUMPS_AT_RISK),
            "A job's final dump is predicted not to fit the two-minute notice even at the shortest checkpoint "
            "interval: an interruption may lose its work since the last checkpoint (see final_dump_risk).",
        )
        alarm(
            "CheckpointsOverdue",
            spotcr_metric(Metric.CHECKPOINTS_OVERDUE),
            "A running job missed its periodic checkpoint: more work than its interval is at risk.",
        )
        for name, function in functions.functions.items():
            alarm(
                f"FunctionErrors-{name}",
                function.metric_errors(period=PERIOD, statistic="Sum"),
                f"The spotcr {name} function failed; its events go to the dead-letter queue after retries.",
            )
        alarm(
            "DeadLetters",
            registry.dead_letters.metric_approximate_number_of_messages_visible(period=PERIOD, statistic="Maximum"),
            "An event or invocation failed every retry and sits in the dead-letter queue.",
        )

        self.dashboard = cloudwatch.Dashboard(self, "Dashboard", dashboard_name=f"{settings.stack_name}-operations")
        self.dashboard.add_widgets(
            cloudwatch.GraphWidget(
                title="Recoveries",
                left=[spotcr_metric(Metric.RECOVERIES_SUCCEEDED), spotcr_metric(Metric.RECOVERIES_FAILED)],
                width=8,
            ),
            cloudwatch.GraphWidget(
                title="Recovery and lost work (seconds)",
                left=[
                    spotcr_metric(Metric.RECOVERY_SECONDS, "Average"),
                    spotcr_metric(Metric.RESTORE_SECONDS, "Average"),
                    spotcr_metric(Metric.LOST_WORK_SECONDS, "Average"),
                    spotcr_metric(Metric.INTERRUPTION_TO_DUMP_SECONDS, "Average"),
                ],
                width=8,
            ),
            cloudwatch.GraphWidget(
                title="Dumps: seconds (periodic and final) and final dump bytes",
                left=[
                    spotcr_metric(Metric.CHECKPOINT_SECONDS, "Average"),
                    spotcr_metric(Metric.FINAL_DUMP_SECONDS, "Average"),
                ],
                right=[spotcr_metric(Metric.FINAL_DUMP_BYTES)],
                width=8,
            ),
        )
        self.dashboard.add_widgets(
            cloudwatch.GraphWidget(
                title="Deadline: predicted final dump (seconds, worst) and jobs whose final dump cannot fit",
                left=[
                    spotcr_metric(Metric.PREDICTED_FINAL_DUMP_SECONDS, "Maximum"),
                    spotcr_metric(Metric.FINAL_DUMP_SECONDS, "Maximum"),
                ],
                right=[spotcr_metric(Metric.FINAL_DUMPS_AT_RISK)],
                left_annotations=[
                    cloudwatch.HorizontalAnnotation(value=SPOT_NOTICE_S, label="the notice"),
                ],
                width=24,
            ),
        )
        self.dashboard.add_widgets(
            cloudwatch.GraphWidget(
                title="Failures",
                left=[
                    spotcr_metric(Metric.CHECKPOINTS_FAILED),
                    spotcr_metric(Metric.CHECKPOINTS_OVERDUE),
                    state_machine.metric_failed(period=PERIOD, statistic="Sum"),
                ],
                width=12,
            ),
            cloudwatch.GraphWidget(
                title="Function errors",
                left=[fn.metric_errors(period=PERIOD, statistic="Sum") for fn in functions.functions.values()],
                width=12,
            ),
            cloudwatch.AlarmStatusWidget(title="Alarms", alarms=list(self.alarms), width=24),
        )
