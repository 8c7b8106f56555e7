"""The nodes benchmark's agent on a bare VM (bench/nodes.py runs it with `vm.run`): the real agent with the node's
agent.json, its store a directory on the node's storage, its events dropped.

Ops: `start` the node's share; `serve KEY PEERS UNLOCKED STOP_FILE`: the agents' port until STOP_FILE exists;
`checkpoint KIND SEQUENCE`: this VM's own dump, a single-VM job's (the baseline). Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from spotcr_agent import nodeport
from spotcr_agent.agent import Agent, base_job_env
from spotcr_agent.config import load
from spotcr_agent.store import CheckpointStore


class _Quiet:
    def publish(self, event: object) -> bool:
        return True


def main(op: str, *args: str) -> dict[str, Any]:
    config = load(os.environ)
    store = CheckpointStore.for_directory(config.mount_point, config.job_id, run_id=config.run_id)
    agent = Agent(config, _Quiet(), base_job_env(os.environ), store_factory=lambda _: store)
    if op == "start":
        return {"pid": agent.start_job()}
    if op == "serve":
        key, peers, unlocked, stop = args
        address = config.nodes[config.node_index]
        actions = nodeport.agent_actions(agent, address, peers, unlocked)
        with nodeport.NodePort(address, nodeport.PORT, nodeport.Gate(bytes.fromhex(key)), actions):
            while not Path(stop).exists():
                time.sleep(0.05)
        return {}
    if op == "checkpoint":
        outcome = agent.checkpoint(args[0], config.generation, int(args[1]))
        return {"seconds": outcome.seconds, "frozen_seconds": outcome.frozen_seconds, "bytes": outcome.bytes_total}
    raise SystemExit(f"unknown op {op}")


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
