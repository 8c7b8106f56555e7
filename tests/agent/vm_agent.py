"""One agent operation inside a LocalVM: `python -m tests.agent.vm_agent CONFIG OP [ARGS]`; prints one JSON line.

Events go to events.jsonl beside CONFIG, so the test reads what the agent published.
"""

import json
import os
import sys
import time
from pathlib import Path

from spotcr_agent.agent import Agent, base_job_env
from spotcr_agent.config import AgentConfig
from spotcr_agent.store import CheckpointStore


class FilePublisher:
    def __init__(self, path):
        self.path = path

    def publish(self, event):
        with open(self.path, "a") as out:
            out.write(json.dumps({"type": event.DETAIL_TYPE, **event.detail()}) + "\n")
        return True


def main(config_path, op, *args):
    config = AgentConfig.from_json(json.loads(Path(config_path).read_text()))
    store = CheckpointStore.for_directory(config.mount_point, config.job_id)
    agent = Agent(
        config=config,
        publisher=FilePublisher(Path(config_path).parent / "events.jsonl"),
        job_env=base_job_env(os.environ),
        store_factory=lambda _: store,
    )
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
