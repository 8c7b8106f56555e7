"""One agent operation inside a bare VM: `python -m tests.agent.vm_agent OP [ARGS]`; prints one JSON line.

The agent reads /etc/spotcr/agent.json as on a job VM, and publishes its events to /etc/spotcr/events.jsonl,
so the test reads what it published. SPOTCR_TEST_STORE picks its store (the directory store on the job's
storage by default; `s3:BUCKET`; `streaming-breaks`), SPOTCR_TEST_FAULT a fault (`full-disk`).
The test side drives it with JobVM.
"""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from spotcr_agent import agentlog, carry, daemon, memsample, nodeport
from spotcr_agent.agent import Agent, base_job_env
from spotcr_agent.config import DEFAULT_CONFIG_PATH, AgentConfig, load
from spotcr_agent.store import CheckpointStore, DirectoryBackend, StoreError

EVENTS = DEFAULT_CONFIG_PATH.parent / "events.jsonl"
ROOT = Path(__file__).parents[2]
WORKDIR = "/var/lib/spotcr/work/job-1"
RUN_ID = "r-00000000000000a1"


class FilePublisher:
    def publish(self, event):
        with open(EVENTS, "a") as out:
            out.write(json.dumps({"type": event.DETAIL_TYPE, **event.detail()}) + "\n")
        return True


class FakeMetadata:
    """IMDS as a dict of paths; a missing path reads as 404."""

    def __init__(self, values=None):
        self.values = dict(values or {})

    def get(self, path):
        return self.values.get(path.rstrip("/"))


SPOT_NOTICE = {"meta-data/spot/instance-action": '{"action":"terminate","time":"2026-11-21T20:40:00Z"}'}


class StreamingBreaks(CheckpointStore):
    """A store whose upload breaks off while CRIU still writes the final dump (a network blip)."""

    def commit(self, image_dir, meta, extra_files=None, still_writing=None, inherited=None, *, keep_going=None):
        if still_writing is not None:
            raise StoreError("connection reset while streaming the final dump")
        return super().commit(image_dir, meta, extra_files, inherited=inherited, keep_going=keep_going)


def _store(config):
    kind = os.environ.get("SPOTCR_TEST_STORE", "")
    if kind.startswith("s3:"):
        return CheckpointStore.for_s3(kind.removeprefix("s3:"), config.job_id, run_id=config.run_id)
    if kind == "streaming-breaks":
        return StreamingBreaks(DirectoryBackend(config.mount_point), config.job_id, run_id=config.run_id)
    return CheckpointStore.for_directory(config.mount_point, config.job_id, run_id=config.run_id)


def _full_disk(entries, dest):
    raise OSError(28, "No space left on device")


def _two_triggers(agent, generation):
    """The SSM command (a separate process) and the IMDS poll both ask for the final dump at once."""
    argv = ["checkpoint", "--job", agent.config.job_id, "--generation", generation, "--kind", "final"]
    ssm = subprocess.Popen(
        [sys.executable, "-m", "spotcr_agent", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    poll = threading.Thread(target=daemon._check_interruption, args=(agent, FakeMetadata(SPOT_NOTICE)))
    poll.start()
    out, err = ssm.communicate(timeout=120)
    poll.join(timeout=120)
    final = agent.state.read().final_dump()
    return {
        "ssm_exit": ssm.returncode,
        "ssm_stderr": err.decode(),
        "reported": json.loads(out) if ssm.returncode == 0 else None,
        "final_status": final.status,
        "final_result": final.result,
        "watch": agent.watch_job(),
    }


def _service(agent, notice, until_exit, seconds=60.0):
    """The agent service loop (daemon.run); with until_exit, until the job's exit is reported (at most `seconds`),
    else one round."""
    stop = threading.Event()
    if not until_exit:
        stop.set()
        daemon.run(agent, FakeMetadata(SPOT_NOTICE if notice else None), stop, 0.05)
        return {}
    loop = threading.Thread(target=daemon.run, args=(agent, FakeMetadata(SPOT_NOTICE if notice else None), stop, 0.05))
    loop.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and '"JobExited"' not in (EVENTS.read_text() if EVENTS.exists() else ""):
        time.sleep(0.05)
    stop.set()
    loop.join()
    return {}


def main(op, *args):
    agentlog.install()  # as the agent's own entry point does (spotcr_agent.cli.main)
    config = load(os.environ)
    store = _store(config)
    if os.environ.get("SPOTCR_TEST_FAULT") == "full-disk":
        carry.copy_files = _full_disk  # copying the VM-local files at the freeze breaks (a full scratch disk)
    agent = Agent(config, FilePublisher(), base_job_env(os.environ), store_factory=lambda _: store)
    if op == "start":
        agent.ready()
        return {"pid": agent.start_job()}
    if op == "checkpoint":
        return agent.checkpoint(args[0], int(args[1])).to_json()
    if op == "restore":  # restore GENERATION [CHECKPOINT_ID]
        return agent.restore(int(args[0]), *args[1:2]).to_json()
    if op == "wait-exit":
        deadline = time.monotonic() + float(args[0])
        while time.monotonic() < deadline:
            code = agent.watch_job()
            if code is not None:
                return {"exit_code": code}
            time.sleep(0.05)
        return {"exit_code": None}
    if op == "status":
        return json.loads(agent.status().to_line())
    if op == "memory-changed":  # memory-changed CHECKPOINT_ID: the job's memory sampled at that dump, read again
        share = memsample.changed_since(config.state_dir, args[0])
        return {"sampled": share.sampled, "changed": share.changed} if share else {"sampled": 0}
    if op == "checkpoint-ids":
        return {"ids": agent.store().checkpoint_ids()}
    if op == "two-triggers":
        return _two_triggers(agent, args[0])
    if op == "service":  # service [until-exit|once] [notice] [SECONDS]
        seconds = [float(a) for a in args if a.replace(".", "", 1).isdigit()]
        return _service(agent, notice="notice" in args, until_exit="until-exit" in args, seconds=(seconds or [60])[0])
    if op == "coordinate":  # coordinate KIND GENERATION SEQUENCE: node 0's agent, as a dump order has it do
        return nodeport.coordinate(agent, args[0], int(args[1]), int(args[2])).to_json()
    if op == "coordinate-restore":  # coordinate-restore GENERATION CHECKPOINT SEQUENCE: node 0's agent, a restore order
        return nodeport.coordinate_restore(agent, int(args[0]), args[1], int(args[2])).to_json()
    if op == "serve-node":  # serve-node ADDRESS PEERS UNLOCKED KEY_HEX STOP_FILE: the agents' port, until STOP_FILE
        address, peers, unlocked, key, stop = args
        actions = nodeport.agent_actions(agent, address, peers, unlocked)
        with nodeport.NodePort(address, nodeport.PORT, nodeport.Gate(bytes.fromhex(key)), actions):
            while not Path(stop).exists():
                time.sleep(0.05)
        return {}
    raise SystemExit(f"unknown op {op}")


class JobVM:
    """A bare VM with the agent's config in /etc/spotcr, driven through tests/agent/vm_agent.py."""

    def __init__(self, vm, generation=1, mode="run", agent_env=None, **config):
        self.vm = vm
        self.agent_env = dict(agent_env or {})  # e.g. SPOTCR_TEST_STORE, SPOTCR_TEST_FAULT (see the module's doc)
        values = {"job_id": "job-1", "instance_id": vm.instance_id, "storage": "efs", "generation": generation}
        config.setdefault("run_id", RUN_ID)  # the run the control plane registered (spotcr:run)
        AgentConfig(**values, mode=mode, **config).write(vm.dir("etc") / "agent.json")

    def agent(self, *op, check=True):
        argv = ["env", f"PYTHONPATH={ROOT}:{ROOT / 'functions'}:{ROOT / 'vm-bootstrap'}"]
        argv += [f"{name}={value}" for name, value in self.agent_env.items()]
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
        return [event for event in self.all_events() if event["type"] == detail_type]

    def all_events(self):
        """Every event the agent on this VM published, in order."""
        path = self.vm.dir("etc") / "events.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines]


# command -> (progress.log, stdout): the same for every run of a deterministic job
_REFERENCES: dict[tuple[str, ...], tuple[str, str]] = {}


def reference_output(boot, command):
    """(progress.log, stdout) of an uninterrupted run, on a VM of its own (`boot()` gives one), once a session."""
    if command not in _REFERENCES:
        vm = boot()
        script = f'mkdir -p {WORKDIR} && cd {WORKDIR} && exec "$@"'
        result = vm.run(["sh", "-c", script, "reference", *command], timeout_s=120)
        assert result.returncode == 0, result.stdout + result.stderr
        _REFERENCES[command] = ((vm.host_path(WORKDIR) / "progress.log").read_text(), result.stdout)
    return _REFERENCES[command]


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
