"""One agent operation inside a bare VM: `python -m tests.agent.vm_agent OP [ARGS]`; prints one JSON line.

The agent reads /etc/spotcr/agent.json as on a job VM, and publishes its events to /etc/spotcr/events.jsonl,
so the test reads what it published.
"""

import json
import os
import sys
import time

from spotcr_agent.agent import Agent, base_job_env
from spotcr_agent.config import DEFAULT_CONFIG_PATH, load
from spotcr_agent.store import CheckpointStore

EVENTS = DEFAULT_CONFIG_PATH.parent / "events.jsonl"


class FilePublisher:
    def publish(self, event):
        with open(EVENTS, "a") as out:
            out.write(json.dumps({"type": event.DETAIL_TYPE, **event.detail()}) + "\n")
        return True


def main(op, *args):
    config = load(os.environ)
    store = CheckpointStore.for_directory(config.mount_point, config.job_id)
    agent = Agent(config, FilePublisher(), base_job_env(os.environ), store_factory=lambda _: store)
    if op == "start":
        agent.ready()
        return {"pid": agent.start_job()}
    if op == "checkpoint":
        return agent.checkpoint(args[0], int(args[1])).to_json()
    if op == "restore":
        return agent.restore(int(args[0])).to_json()
    if op == "wait-exit":
        deadline = time.monotonic() + float(args[0])
        while time.monotonic() < deadline:
            code = agent.watch_job()
            if code is not None:
                return {"exit_code": code}
            time.sleep(0.05)
        return {"exit_code": None}
    raise SystemExit(f"unknown op {op}")


if __name__ == "__main__":
    try:
        print(json.dumps({"ok": True, **main(*sys.argv[1:])}))
    except Exception as error:
        print(json.dumps({"ok": False, "error": str(error), "type": type(error).__name__}))
        sys.exit(1)
