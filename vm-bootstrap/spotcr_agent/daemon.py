"""The agent service: starts the job (run mode) or waits for a restore, watches it, and takes the final
dump as soon as IMDS announces the spot interruption (the SSM command may race it: one dump either way)."""

from __future__ import annotations

import logging
import threading

from .agent import Agent
from .imds import ImdsError, Metadata, spot_instance_action

log = logging.getLogger(__name__)

POLL_S = 1.0


def run(agent: Agent, metadata: Metadata, stop: threading.Event, poll_s: float = POLL_S) -> None:
    agent.ready()
    if agent.config.mode == "run":
        agent.start_job()
    interrupted = False
    while True:
        if not interrupted:
            interrupted = _check_interruption(agent, metadata)
        agent.watch_job()
        if stop.wait(poll_s):
            return


def _check_interruption(agent: Agent, metadata: Metadata) -> bool:
    try:
        action = spot_instance_action(metadata)
    except ImdsError as error:
        log.warning("polling the spot interruption notice failed: %s", error)
        return False
    if action is None:
        return False
    log.warning("spot interruption notice: %s; taking the final dump", action.strip())
    status = agent.status()
    if status["job_status"] == "none" and agent.config.mode == "restore":
        # A backup warned while it restores: the final dump is taken as soon as the restored job runs.
        log.info("the job is not restored yet; the final dump waits for it")
        return False
    if status["job_status"] != "running":
        log.info("no job runs here (%s); nothing to dump", status["job_status"])
        return True
    try:
        agent.checkpoint("final", agent.served_generation())
    except Exception as error:
        log.error("final dump after the interruption notice failed: %s", error)
    return True
