"""One agent operation inside a bare VM: `python -m tests.agent.vm_agent OP [ARGS]`; prints one JSON line.

The agent reads /etc/spotcr/agent.json as on a job VM, and publishes its events to /etc/spotcr/events.jsonl,
so the test reads what it published.
"""

import json
import os
import sys
import time
from pathlib import Path

from spotcr_agent.agent import Agent, base_job_env
from spotcr_agent.config import DEFAULT_CONFIG_PATH, AgentConfig, load
from spotcr_agent.store import CheckpointStore

EVENTS = DEFAULT_CONFIG_PATH.parent / "events.jsonl"
ROOT = Path(__file__).parents[2]
WORKDIR = "/var/lib/spotcr/work/job-1"


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


class JobVM:
    """A bare VM with the agent's config in /etc/spotcr, driven through tests/agent/vm_agent.py."""

    def __init__(self, vm, generation=1, mode="run", **config):
        self.vm = vm
        values = {"job_id": "job-1", "instance_id": vm.instance_id, "storage": "efs", "generation": generation}
        AgentConfig(**values, mode=mode, **config).write(vm.dir("etc") / "agent.json")

    def agent(self, *op, check=True):
        argv = ["env", f"PYTHONPATH={ROOT}:{ROOT / 'functions'}:{ROOT / 'vm-bootstrap'}"]
        result = self.vm.run([*argv, sys.executable, "-m", "tests.agent.vm_agent", *op], timeout_s=180)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(op)} on {self.vm.instance_id} failed: {result.stdout}{result.stderr}")
        return json.loads(result.stdout.strip().splitlines()[-1])

    @property
    def workdir(self):
        return self.vm.host_path(WORKDIR)

    def progress(self):
        path = self.workdir / "progress.log"
        return path.read_text().splitlines() if path.exists() else []

    def events(self, detail_type):
        path = self.vm.dir("etc") / "events.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [event for event in map(json.loads, lines) if event["type"] == detail_type]


def reference_run(vm, command):
    """What an uninterrupted run writes, on a fresh VM of its own."""
    script = f'mkdir -p {WORKDIR} && cd {WORKDIR} && exec "$@"'
    result = vm.run(["sh", "-c", script, "reference", *command], timeout_s=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return vm.host_path(WORKDIR)


if __name__ == "__main__":
    try:
        print(json.dumps({"ok": True, **main(*sys.argv[1:])}))
    except Exception as error:
        print(json.dumps({"ok": False, "error": str(error), "type": type(error).__name__}))
        sys.exit(1)
