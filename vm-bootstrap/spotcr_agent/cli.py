"""`spotcr-agent`: the commands SSM runs on a job VM, the bootstrap, and the daemon.

Every command prints one JSON line with its result. Exit codes: 0 ok, 1 failure, 2 bad input,
3 stale generation (a newer generation of the job has taken over).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from spotcr_contracts.commands import CHECKPOINT_ID_PATTERN, RESTORE_ATTEMPTS, parse_orders
from spotcr_contracts.results import CheckpointResult, CommandFailed, RestoreResult, StatusResult
from spotcr_contracts.settings import agent_options
from spotcr_contracts.tags import RUN_ID_PATTERN, InvalidJobTags

from . import agentlog, nodeport
from . import config as agent_config
from .agent import Agent, WrongJob, base_job_env
from .events import EventBridgePublisher
from .imds import Imds, ImdsError, reclaim_time, spot_instance_action
from .nodes import CheckpointFailed, NodeError
from .probe import ProbeError
from .runner import InvalidJobSpec
from .state import StaleGeneration

log = logging.getLogger("spotcr_agent")

OK, FAILED, BAD_INPUT, STALE = 0, 1, 2, 3


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _generation(value: str) -> int:
    if not value.isdigit() or len(value) > 10:
        raise argparse.ArgumentTypeError(f"generation must be a whole number, got {value[:32]!r}")
    return int(value)


def _sequence(value: str) -> int:
    if not re.fullmatch(r"[0-9]{1,10}", value):
        raise argparse.ArgumentTypeError(f"sequence must be a whole number of at most 10 digits, got {value[:32]!r}")
    return int(value)


def _checkpoint_id(value: str) -> str:
    if not re.fullmatch(CHECKPOINT_ID_PATTERN, value):
        raise argparse.ArgumentTypeError(f"checkpoint id {value[:64]!r} does not match {CHECKPOINT_ID_PATTERN}")
    return value


def _run_id(value: str) -> str:
    if value and not re.fullmatch(RUN_ID_PATTERN, value):
        raise argparse.ArgumentTypeError(f"run id {value[:64]!r} does not match {RUN_ID_PATTERN}")
    return value


def parser() -> argparse.ArgumentParser:
    root = _Parser(prog="spotcr-agent", description=__doc__)
    commands = root.add_subparsers(dest="command", required=True, parser_class=_Parser)

    bootstrap = commands.add_parser("bootstrap", help="read the job from IMDS, prepare storage, write agent.json")
    # The deployment's settings, as the user data passes them (spotcr_contracts.settings.VmSettings).
    for flag, true_or_false, description in agent_options():
        choices = ("", "true", "false") if true_or_false else None
        bootstrap.add_argument(flag, default="", choices=choices, help=description)
    bootstrap.add_argument("--ebs-volume-id", default="", help="EBS volume to mount (default: the one data volume)")
    bootstrap.add_argument("--scratch-dir", default="", help="local dir for periodic dumps (default <state>/scratch)")
    bootstrap.add_argument("--report-failure", metavar="STEP", default="", help="only publish that STEP failed")
    bootstrap.add_argument(
        "--ssm-wait-seconds", type=float, default=600.0, help="how long to wait for this instance's SSM Agent"
    )

    commands.add_parser("daemon", help="the service: run or await the job, watch it, final dump on interruption")

    checkpoint = commands.add_parser("checkpoint", help="take a periodic or final checkpoint")
    checkpoint.add_argument("--job", required=True)
    checkpoint.add_argument("--generation", required=True, type=_generation)
    checkpoint.add_argument("--kind", required=True, choices=("periodic", "final"))
    checkpoint.add_argument("--run", type=_run_id, default="", help="the run it is for; another run's is refused")
    checkpoint.add_argument(
        "--sequence", type=_sequence, default=None, help="the control plane's sequence of this dump order (its rank)"
    )

    final_dump = commands.add_parser("final-dump", help="take the final checkpoint this instance's order names")
    final_dump.add_argument("--orders", required=True, help="a wave's orders (FINAL_DUMP); this instance's is taken")

    restore = commands.add_parser("restore", help="restore the job from a committed checkpoint")
    restore.add_argument("--job", required=True)
    restore.add_argument("--generation", required=True, type=_generation)
    restore.add_argument("--checkpoint", type=_checkpoint_id, default=None)
    restore.add_argument("--run", type=_run_id, default="", help="the run it is for; another run's is refused")
    restore.add_argument("--attempt", choices=("", *RESTORE_ATTEMPTS), default="", help="the workflow's attempt")
    restore.add_argument(
        "--sequence", type=_sequence, default=None, help="the control plane's sequence of this restore order"
    )

    release = commands.add_parser("release", help="release the job's storage (unmount EBS) so it can move")
    release.add_argument("--job", required=True)
    release.add_argument("--generation", required=True, type=_generation)
    release.add_argument("--run", type=_run_id, default="", help="the run it is for; another run's is refused")

    status = commands.add_parser("status", help="print the agent's view of the job")
    status.add_argument("--job", required=True)

    probe = commands.add_parser("probe", help="measure each storage's write/read rates and the checkpoint pipeline")
    probe.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="STORAGE=PATH|s3=BUCKET",
        help="what to probe (repeatable); none: the bucket, mounted storage and scratch dir of agent.json",
    )
    probe.add_argument("--streams", default="1,4", help="parallel streams per configuration, comma-separated")
    probe.add_argument("--block-kib", default="64,1024", help="block sizes in KiB, comma-separated")
    probe.add_argument("--size-mib", default="8", help="MiB each stream writes per configuration")
    probe.add_argument("--pipeline-mib", default="16", help="MiB of synthetic images through the store; 0 skips")
    probe.add_argument("--instance-type", default="", help="label of the results (default: from IMDS, else local)")
    return root


def _print(result: Mapping[str, Any]) -> None:
    _write(json.dumps(result, separators=(",", ":"), default=str))


def _say(result: CheckpointResult | RestoreResult | StatusResult | CommandFailed) -> None:
    """Print a command's one result line (spotcr_contracts.results), which the control plane reads from SSM."""
    _write(result.to_line())


def _write(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s spotcr-agent %(levelname)s %(message)s"
    )
    agentlog.install()
    try:
        args = parser().parse_args(list(argv))
        if args.command == "bootstrap":
            from .bootstrap import bootstrap

            return bootstrap(args, environ, _print)
        if args.command == "probe":
            return _probe(args, environ)
        config = agent_config.load(environ)
        agent = Agent(
            config=config,
            publisher=EventBridgePublisher(config.event_bus, config.region),
            job_env=base_job_env(dict(environ)),
        )
        return _run(agent, args)
    except StaleGeneration as error:
        _say(CommandFailed(str(error), stale=True))
        return STALE
    except (UsageError, agent_config.ConfigError, WrongJob, InvalidJobSpec, InvalidJobTags, ProbeError) as error:
        _say(CommandFailed(str(error)))
        return BAD_INPUT
    except Exception as error:
        _say(CommandFailed(str(error)))
        return FAILED


def _run(agent: Agent, args: argparse.Namespace) -> int:
    if args.command == "daemon":
        from . import daemon

        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        daemon.run(agent, Imds(agent.config.imds_endpoint), stop)
        return OK
    if args.command == "final-dump":
        args = _own_order(agent, args.orders)
    agent.check_job(args.job, getattr(args, "run", ""))
    if args.command == "checkpoint":
        return _checkpoint(agent, args)
    if args.command == "restore":
        return _restore(agent, args)
    if args.command == "release":
        _print({"ok": True, "released": agent.release(args.generation)})
    else:
        _say(agent.status())
    return OK


def _own_order(agent: Agent, orders: str) -> argparse.Namespace:
    """A FINAL_DUMP command's order for this instance, as the checkpoint command's arguments."""
    try:
        mine = [o for o in parse_orders(orders) if o.instance_id == agent.config.instance_id]
    except ValueError as error:
        raise UsageError(str(error)) from error
    if len(mine) != 1:
        raise UsageError(f"the final-dump command holds {len(mine)} orders for {agent.config.instance_id}, not one")
    [order] = mine
    return argparse.Namespace(
        command="checkpoint",
        job=order.job_id,
        run=order.run_id,
        generation=order.generation,
        kind="final",
        sequence=order.sequence,
    )


def _reclaim_at(agent: Agent) -> float | None:
    """When EC2 takes this VM back, if its notice is up (a final-dump order may come before the daemon's poll)."""
    try:
        return reclaim_time(spot_instance_action(Imds(agent.config.imds_endpoint)))
    except ImdsError as error:
        log.warning("reading the spot interruption notice failed: %s", error)
        return None


def _checkpoint(agent: Agent, args: argparse.Namespace) -> int:
    """One result line (what the control plane reads from SSM's GetCommandInvocation: the only source it takes a
    committed checkpoint from) naming the job, run, generation and kind of the order it answers. Exit 0 only when
    committed. A failure says whether the job is stopped for good on this VM (a failed final dump) or has ended."""
    order = {"job_id": args.job, "run_id": args.run, "generation": args.generation, "kind": args.kind}
    if agent.config.nodes:
        return _coordinated_checkpoint(agent, args, order)
    try:
        outcome = agent.checkpoint(args.kind, args.generation, args.sequence, reclaim_at=lambda: _reclaim_at(agent))
    except Exception as error:
        state = agent.state.read()
        stale = isinstance(error, StaleGeneration)
        # A job that has ended is answered with its exit as the status command says it (Agent.watch_job committed
        # its result or gave it up first), so the control plane may end the job from this answer alone.
        ended = state.job_status == "exited"
        exit_fields = ("exit_code", "result", "result_error", "result_missing")
        failed = CheckpointResult(
            ok=False,
            **order,
            error=str(error)[:4000],
            job_stopped=state.job_status == "stopped",
            stale=stale,
            **{name: getattr(state, name) for name in exit_fields if ended},
        )
        _say(failed)
        return STALE if stale else FAILED
    committed = CheckpointResult(
        ok=True,
        **order,
        checkpoint_id=outcome.checkpoint_id,
        dump_generation=outcome.generation,
        already_taken=outcome.already_taken,
        seconds=outcome.seconds,
        frozen_seconds=outcome.frozen_seconds,
        bytes_total=outcome.bytes_total,
        bytes_uploaded=outcome.bytes_uploaded,
        gpu_memory_bytes=outcome.gpu_memory_bytes,
        memory_tracking=outcome.memory_tracking,
        scratch=outcome.scratch,
        predicted_final_seconds=outcome.predicted_final_seconds,
        next_interval_s=outcome.next_interval_s,
        deadline_risk=outcome.deadline_risk,
    )
    _say(committed)
    return OK


def _coordinated_checkpoint(agent: Agent, args: argparse.Namespace, order: Mapping[str, Any]) -> int:
    """A multi-node job's dump order, which goes to node 0 only: its agent takes the coordinated checkpoint over
    every node's port (nodeport.coordinate); the result line names the job manifest's id. Another node refuses."""
    if agent.config.node_index != 0:
        raise UsageError(f"node {agent.config.node_index} of a multi-node job: dumps are ordered to node 0")
    try:
        manifest = nodeport.coordinate(agent, args.kind, args.generation, args.sequence)
    except (CheckpointFailed, NodeError) as error:
        _say(CheckpointResult(ok=False, **order, error=str(error)[:4000]))
        return FAILED
    _say(CheckpointResult(ok=True, **order, checkpoint_id=manifest.checkpoint_id, dump_generation=args.generation))
    return OK


def _restore(agent: Agent, args: argparse.Namespace) -> int:
    """Blocks until the restore is done or failed; its one result line (what the control plane reads from SSM's
    GetCommandInvocation) names the job, run, generation and attempt it answers. Exit 0 only when restored."""
    order = {"job_id": args.job, "run_id": args.run, "generation": args.generation, "attempt": args.attempt}
    if agent.config.nodes:
        return _coordinated_restore(agent, args, order)
    try:
        outcome = agent.restore(args.generation, args.checkpoint, args.attempt, args.sequence)
    except Exception as error:
        stale = isinstance(error, StaleGeneration)
        _say(RestoreResult(ok=False, **order, error=str(error), stale=stale))
        return STALE if stale else FAILED
    restored = RestoreResult(
        ok=True,
        **order,
        checkpoint_id=outcome.checkpoint_id,
        seconds=outcome.seconds,
        pid=outcome.pid,
        skipped=outcome.skipped,
        running_seconds=outcome.running_seconds,
        lazy=outcome.lazy,
    )
    _say(restored)
    return OK


def _coordinated_restore(agent: Agent, args: argparse.Namespace, order: Mapping[str, Any]) -> int:
    """A multi-node job's restore order, which goes to node 0 only: its agent restores every node's part of the
    coordinated checkpoint over their ports, then unlocks them (nodeport.coordinate_restore). Another node refuses."""
    if agent.config.node_index != 0:
        raise UsageError(f"node {agent.config.node_index} of a multi-node job: restores are ordered to node 0")
    if not args.checkpoint:
        raise UsageError("a multi-node job's restore names its coordinated checkpoint")
    started = time.monotonic()
    try:
        manifest = nodeport.coordinate_restore(agent, args.generation, args.checkpoint, args.sequence)
    except (CheckpointFailed, NodeError, OSError, ValueError) as error:
        _say(RestoreResult(ok=False, **order, error=str(error)[:4000]))
        return FAILED
    seconds = round(time.monotonic() - started, 3)
    _say(RestoreResult(ok=True, **order, checkpoint_id=manifest.checkpoint_id, seconds=seconds))
    return OK


def _probe(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    """Probe the targets given, or on a job VM what its agent.json names; needs no job."""
    import tempfile
    from pathlib import Path

    from . import probe

    settings = probe.ProbeSettings(
        streams=probe.parse_list("--streams", args.streams),
        block_kib=probe.parse_list("--block-kib", args.block_kib),
        size_mib=probe.parse_list("--size-mib", args.size_mib)[0],
        pipeline_mib=probe.parse_list("--pipeline-mib", args.pipeline_mib)[0],
    )
    instance_type = args.instance_type
    on_job: dict[str, Any] = {}
    if args.target:
        targets = [probe.parse_target(t) for t in args.target]
        scratch = Path(tempfile.gettempdir())
    else:
        config = agent_config.load(environ)
        targets = probe.config_targets(config.storage, config.bucket, config.mount_point, config.scratch_dir)
        scratch = config.scratch_dir
        if config.storage == "s3" and config.store_credentials_url:
            from .state import StateFile
            from .storage import store_session

            # The run this VM serves, as Agent.run_id has it: its credentials write under that run only.
            run_id = StateFile(config.state_dir).read().run_id or config.run_id
            on_job = {"s3_job": config.job_id, "s3_run": run_id, "s3_session": store_session(config)}
        if not instance_type:
            try:
                instance_type = (Imds(config.imds_endpoint).get("meta-data/instance-type") or "").strip()
            except ImdsError as error:
                log.warning("instance type unknown: %s", error)
    results = probe.probe(targets, settings, instance_type=instance_type or "local", scratch=scratch, **on_job)
    _print(probe.summary(results))
    return OK
