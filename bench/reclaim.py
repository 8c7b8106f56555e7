"""Mass reclaim: N jobs warned within seconds, all recovered by one control plane at once.

`python -m bench reclaim --jobs 100` registers N jobs on the local AWS with the real handlers and ASL (the workflow
tests' ControlPlane), their VMs played by simulated agents (rehearsal/simagent.py: a final dump takes --dump-s, a
backup's boot --boot-s, a restore --restore-s; each agent polls IMDS for the notice as the real one does), warns
every one within --warn-within-s, and reports per job the warning to the final dump's beginning (the first of the
agent's IMDS poll and the final-dump command), to the command itself, to the backup's launch, and to the job
running again (p50, p99, max), then the wave's end state, the local AWS's own queue, and the CPU each function's
invocations used on the one interpreter they share. Writes bench/results/reclaim-<N>.json and .md.
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_COMMAND_P99_S = 1.0  # issue 27's: warning to the final-dump command
# A warning's handler before its SendCommand: idempotency PutItem, the by-instance Query, the consistent GetItem,
# the fencing UpdateItem, the outbox's UpdateItem (recovery.on_interruption_warning).
REQUESTS_BEFORE_COMMAND = 5
WARNING_FUNCTION = "interruption"  # spotcr_functions.catalog: the warning's handler, which sends the command
STEPS = {
    "to_final_dump_begun": "warning -> final dump begins (IMDS poll or command)",
    "to_final_dump_command": "warning -> final-dump command",
    "to_backup_launched": "warning -> backup launched",
    "to_running_again": "warning -> job running again",
}


def _environment() -> None:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_SESSION_TOKEN": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "POWERTOOLS_METRICS_NAMESPACE": "spotcr",
        "POWERTOOLS_LOG_LEVEL": "WARNING",
    }.items():
        os.environ[name] = value
    os.environ.pop("AWS_ENDPOINT_URL", None)
    os.environ.pop("AWS_PROFILE", None)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from moto import mock_aws
    from spotcr_contracts.settings import FunctionSettings
    from spotcr_functions.config import ENV

    from rehearsal import controlplane, wave
    from rehearsal.localaws.throttle import Limits
    from rehearsal.simagent import AgentTiming, SimulatedAgents

    def progress(line: str) -> None:
        print(f"  {line}", file=sys.stderr)

    deployed: dict[str, Any] = {setting.name: setting.default for setting in dataclasses.fields(FunctionSettings)}
    timing = AgentTiming(dump_s=args.dump_s, boot_s=args.boot_s, restore_s=args.restore_s)
    # Handlers print their EMF metrics to stdout: keep them out of the figures.
    with (
        mock_aws(config=controlplane.MOTO_CONFIG),
        contextlib.redirect_stdout(io.StringIO()),
        controlplane.ControlPlane(deployed["final_dump_wait_s"], deployed["restore_wait_s"]) as plane,
        controlplane.event_queue() as queue,
        SimulatedAgents(queue, timing) as agents,
    ):
        # The deployed default, not the workflow tests' 30 s: a wave's backups queue behind each other's launches.
        os.environ[ENV["backup_ready_wait_s"]] = str(deployed["backup_ready_wait_s"])
        began = time.time()
        instances = wave.register(plane, args.jobs)
        progress(f"{args.jobs} jobs registered in {time.time() - began:.1f} s")
        result = wave.run_wave(
            plane,
            agents,
            instances,
            warn_within_s=args.warn_within_s,
            timeout_s=args.timeout_s,
            limits=Limits.aws() if args.limits == "aws" else None,
            progress=progress,
        )
    return {
        "jobs": args.jobs,
        "agent_timing_s": {
            "final_dump": timing.dump_s,
            "backup_boot": timing.boot_s,
            "restore": timing.restore_s,
            "notice_poll": timing.notice_poll_s,
        },
        "warned_over_s": round(result.warned_over_s, 3),
        "wave_seconds": round(result.seconds, 1),
        **{step: {k: round(v, 3) for k, v in wave.spread(getattr(result, step)).items()} for step in STEPS},
        "recovered": len(result.recovered),
        "without_final_dump": result.without_final_dump,
        "failed": result.failed,
        "stuck": result.stuck,
        "live_copies": result.live_copies,
        "leaks": result.leaks,
        "agent_errors": result.agent_errors,
        "clean": result.clean(),
        "limits": args.limits,
        "throttles": result.throttles,
        "local_aws_queue": {k: round(v, 4) for k, v in result.local_aws_queue.items()},
        "window_cpu_s": round(result.window_cpu_s, 2),
        "function_cpu": {
            name: {k: round(v, 4) for k, v in figures.items()} for name, figures in result.function_cpu.items()
        },
    }


def _machine() -> dict[str, Any]:
    from bench.pipeline import describe_machine

    machine = describe_machine()
    machine.pop("criu", None)  # no CRIU runs here: every VM of the wave is simulated
    return machine


def _report(figures: dict[str, Any]) -> list[str]:
    jobs = figures["jobs"]
    p99 = figures["to_final_dump_begun"].get("p99", float("inf"))
    command_p99 = figures["to_final_dump_command"].get("p99", float("inf"))
    verdict = "met" if command_p99 < TARGET_COMMAND_P99_S else "MISSED"
    lines = [
        f"# Mass reclaim: {jobs} jobs warned within {figures['warned_over_s']:.1f} s",
        "",
        f"Measured {figures['at']} on {figures['machine']['cpus']} cores ({figures['machine']['cpu']}), load average "
        f"{', '.join(f'{x:.1f}' for x in figures['machine']['load_before'])} before; the local AWS is moto in-process "
        "(one request at a time), every VM a simulated agent (final dump "
        f"{figures['agent_timing_s']['final_dump']:g} s, backup boot {figures['agent_timing_s']['backup_boot']:g} s, "
        f"restore {figures['agent_timing_s']['restore']:g} s; the agent polls IMDS for the notice every "
        f"{figures['agent_timing_s']['notice_poll']:g} s).",
        "",
        "| per job | p50 | p99 | max |",
        "|---|---|---|---|",
    ]
    for step, label in STEPS.items():
        spread = figures[step]
        cells = [f"{spread[k]:.2f} s" if k in spread else "-" for k in ("p50", "p99", "max")]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    lines += [
        "",
        f"- warning to the final-dump command p99 {command_p99:.2f} s (target under {TARGET_COMMAND_P99_S:g} s:"
        f" {verdict}); the agent's own IMDS poll began the dump p99 {p99:.2f} s after the warning, and the command"
        " answers with that dump",
        f"- recovered {figures['recovered']} of {jobs}; failed {len(figures['failed'])}; stuck {len(figures['stuck'])};"
        f" two live copies {len(figures['live_copies'])}; leaked {len(figures['leaks'])};"
        f" agent answers refused {len(figures['agent_errors'])}",
        f"- restored from their final dump: {figures['recovered'] - len(figures['without_final_dump'])} of"
        f" {figures['recovered']} recovered (the others from an older checkpoint: their final-dump command"
        " never reached them)",
        f"- the whole wave, first warning to the last workflow's end: {figures['wave_seconds']:.0f} s",
    ]
    queue = figures.get("local_aws_queue") or {}
    if queue:
        lines.append(
            f"- the local AWS's own queue in the wave's first {queue['window_s']:g} s: {queue['requests']:.0f} requests"
            f" served one at a time, each waiting for its turn {queue['mean_wait_s'] * 1000:.0f} ms on average"
            f" (p50 {queue['p50_wait_s'] * 1000:.0f} ms, p99 {queue['p99_wait_s'] * 1000:.0f} ms). A warning's"
            f" handler makes {REQUESTS_BEFORE_COMMAND} requests before its final-dump command (idempotency,"
            " the job by instance, the fencing write, the outbox), so that queue alone, which AWS does not have,"
            f" takes about {REQUESTS_BEFORE_COMMAND * queue['mean_wait_s']:.1f} s of it"
        )
        lines.append(
            f"- this one Python process (the local AWS, every handler, every simulated agent) used"
            f" {figures['window_cpu_s']:.1f} s of CPU in those {queue['window_s']:g} s: its one interpreter runs one"
            " thread at a time, so at about 1 s a second every request waits for the others"
        )
    lines += _function_lines(figures)
    lines += _throttle_lines(figures)
    for name in ("failed", "stuck", "live_copies", "leaks", "agent_errors", "without_final_dump"):
        if figures[name]:
            lines.append(f"- {name}: {json.dumps(figures[name])[:2000]}")
    return lines


def _function_lines(figures: dict[str, Any]) -> list[str]:
    """The Lambda invocations begun in the queue's window, by the CPU they used: what one interpreter had to serve."""
    used = figures.get("function_cpu") or {}
    window = (figures.get("local_aws_queue") or {}).get("window_s")
    if not used or not window:
        return []
    lines = [
        "",
        f"Lambda invocations begun in the wave's first {window:g} s, by the CPU each used on its thread (its handler,"
        " and the in-process local AWS serving that handler's requests; each runs in a Lambda environment of its own"
        " in AWS):",
        "",
        "| function | invocations | CPU s | per invocation (p50) |",
        "|---|---|---|---|",
    ]
    for name, row in used.items():
        lines.append(f"| {name} | {row['invocations']:.0f} | {row['cpu_s']:.2f} | {row['p50_s'] * 1000:.0f} ms |")
    warning = used.get(WARNING_FUNCTION)
    if warning:
        lines += [
            "",
            f"- the {warning['invocations']:.0f} warnings' own handlers took {warning['cpu_s']:.1f} s of CPU over"
            f" the {figures['warned_over_s']:.1f} s the warnings came in ({warning['p50_s'] * 1000:.0f} ms each), on"
            " the one interpreter that also runs every workflow and serves at most 1 s of CPU a second",
        ]
    return lines


def _throttle_lines(figures: dict[str, Any]) -> list[str]:
    """Per API: calls, throttled, and the retries that got through (throttles the callers' retries absorbed)."""
    if figures["limits"] == "none":
        return ["- no rate limits applied (--limits none)"]
    meter = figures["throttles"]
    lines = [
        "",
        "AWS's default rate limits applied (rehearsal/localaws/throttle.py); per API that met a limit:",
        "",
        "| API | calls | throttled | retries that got through |",
        "|---|---|---|---|",
    ]
    for api in sorted(meter["throttled"]):
        lines.append(
            f"| {api} | {meter['calls'].get(api, 0)} | {meter['throttled'][api]} | {meter['retried'].get(api, 0)} |"
        )
    if not meter["throttled"]:
        lines.append("| (none) | | | |")
    lines += [
        "",
        f"- Lambda invocations that waited for concurrency: {sum(meter['lambda_queued'].values())};"
        f" state transitions delayed: {meter['delayed_state_transitions']}",
    ]
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench reclaim", description=__doc__)
    parser.add_argument("--jobs", type=int, default=100, help="jobs in the wave (default 100)")
    parser.add_argument("--warn-within-s", type=float, default=5.0, help="every warning within this (default 5 s)")
    parser.add_argument("--dump-s", type=float, default=3.0, help="a simulated final dump's seconds (default 3)")
    parser.add_argument("--boot-s", type=float, default=2.0, help="a backup's boot to AgentReady (default 2 s)")
    parser.add_argument("--restore-s", type=float, default=2.0, help="a simulated restore's seconds (default 2)")
    parser.add_argument(
        "--limits", choices=("aws", "none"), default="aws", help="AWS's default rate limits (default) or none"
    )
    parser.add_argument("--timeout-s", type=float, default=900.0, help="a workflow still running then is stuck")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be 1 or more, not {args.jobs}")
    _environment()
    logging.getLogger("moto").setLevel(logging.CRITICAL)  # an execution's error is in the wave's end state
    machine = _machine()
    figures = _run(args)
    figures = {"at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine, **figures}
    figures["machine"]["load_after"] = os.getloadavg()
    report = _report(figures)
    print("\n".join(report))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"reclaim-{args.jobs}.json").write_text(json.dumps(figures, indent=2) + "\n")
    (RESULTS / f"reclaim-{args.jobs}.md").write_text("\n".join(report) + "\n")
    return 0 if figures["clean"] else 1
