"""The agent service: starts the job (run mode) or waits for a restore, watches it, and takes the final
dump as soon as IMDS announces the spot interruption (the SSM command may race it: one dump either way). A node
of a multi-node job serves the agents' port instead, and leaves the final dump to node 0's coordinator.

In run mode the job starts only on the instance the control plane registered for the run: once the instance
carries `spotcr:run` (read from IMDS, which shows tag changes). An instance refused (the job's name runs
elsewhere) gets `spotcr:error` instead and never starts the job.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading

from spotcr_contracts import tags

from . import nodeport, nodes, storage
from .agent import Agent
from .deadline import NOTICE_DETECTION_S
from .imds import ImdsError, Metadata, instance_tags, reclaim_time, spot_instance_action

log = logging.getLogger(__name__)

POLL_S = NOTICE_DETECTION_S  # the final dump begins at most this long after the notice


def run(agent: Agent, metadata: Metadata, stop: threading.Event, poll_s: float = POLL_S) -> None:
    storage.keep_efs_credentials(agent.config, stop)
    with contextlib.ExitStack() as serving:
        if agent.config.nodes:  # a multi-node job: the coordinator (node 0's agent) drives this node over its port
            address = agent.config.nodes[agent.config.node_index]
            backup = agent.config.mode == "restore"
            if backup:
                # A backup takes over a node's address locked: the other nodes' connections get nothing from it
                # (never a reset) until its share is restored; the coordinated restore unlocks it.
                nodes.lock(address, ",".join(a for a in agent.config.nodes if a != address))
            nodes.hold_address(address, lambda: metadata.get("meta-data/local-ipv4") or "", route=not backup)
            serving.enter_context(nodeport.serve(agent))
        _watch(agent, metadata, stop, poll_s)


def _watch(agent: Agent, metadata: Metadata, stop: threading.Event, poll_s: float) -> None:
    agent.ready()
    # Node 0 runs the job's command; another node's share is what node 0's MPI launcher starts there through its
    # agent (docs/design/multinode.md), never the command itself.
    waiting = agent.config.mode == "run" and agent.config.node_index == 0
    interrupted = pruned = False
    while True:
        if waiting:
            waiting = not _start_when_registered(agent, metadata)
        # Once the run has run here (started, or restored on a backup whose primary went before it could; a job
        # that already ended counts), the job name's earlier runs are pruned, off the loop that watches for the
        # interruption notice (Agent.delete_earlier_runs has the same guard).
        if not pruned and agent.state.read().job_status != "none":
            pruned = True
            threading.Thread(target=agent.delete_earlier_runs, name="spotcr-earlier-runs", daemon=True).start()
        if not interrupted:
            interrupted = _check_interruption(agent, metadata)
        agent.watch_job()
        if stop.wait(poll_s):
            return


def _start_when_registered(agent: Agent, metadata: Metadata) -> bool:
    """Start the job once this instance is the run's registered one; True when nothing is left to wait for."""
    run_id = agent.run_id()
    if run_id:  # booted with its run's tag, or started the job before this restart (it never starts twice)
        agent.start_job(run_id)
        return True
    try:
        found = instance_tags(metadata)
    except ImdsError as error:
        log.warning("reading this instance's tags failed: %s", error)
        return False
    if tags.ERROR in found:
        log.error("spotcr refused this instance (%s): the job is not started here", found[tags.ERROR])
        return True
    if tags.RUN in found:
        if not re.fullmatch(tags.RUN_ID_PATTERN, found[tags.RUN]):
            log.error("%s=%r is not a run spotcr minted: the job is not started here", tags.RUN, found[tags.RUN][:32])
            return True
        agent.start_job(found[tags.RUN])
        return True
    return False


def _check_interruption(agent: Agent, metadata: Metadata) -> bool:
    try:
        action = spot_instance_action(metadata)
    except ImdsError as error:
        log.warning("polling the spot interruption notice failed: %s", error)
        return False
    if action is None:
        return False
    if agent.config.nodes:
        # One node's own dump would leave its share's connections out of step with the others': node 0 takes the
        # job's coordinated final dump at the control plane's order (docs/design/multinode.md).
        log.warning("spot interruption notice: %s; node 0 coordinates the final dump", action.strip())
        return True
    log.warning("spot interruption notice: %s; taking the final dump", action.strip())
    job_status = agent.state.read().job_status  # not agent.status(): that also reads the store, before the dump
    if job_status == "none" and agent.config.mode == "restore":
        # A backup warned while it restores: the final dump is taken as soon as the restored job runs.
        log.info("the job is not restored yet; the final dump waits for it")
        return False
    if job_status != "running":
        log.info("no job runs here (%s); nothing to dump", job_status)
        return True
    try:
        agent.checkpoint("final", agent.served_generation(), reclaim_at=lambda: reclaim_time(action))
    except Exception as error:
        log.error("final dump after the interruption notice failed: %s", error)
    return True
