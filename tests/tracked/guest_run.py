"""Runs inside the Debian-kernel VM (tests/tracked/vm.py): the agent's tracked path end to end, with the real CRIU.

`python -m tests.tracked.guest_run OUT.json MEGABYTES STEPS`. One job (jobs/dirty.py) is checkpointed by the agent as
on a job VM: a full periodic dump first (the path of kernels without tracking, for comparison), then two periodic
checkpoints with tracking (pre-dump + incremental dump; the first starts a chain, the second builds on it), then
the final dump, incremental on the second. The job's VM is then lost (its work dir, state and scratch removed)
and a second agent restores the final checkpoint; the job runs to its end. OUT.json gets each checkpoint's outcome
and figures, the restore, and the job's outputs, for the test to compare with an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from spotcr_agent.agent import Agent, base_job_env
from spotcr_agent.config import AgentConfig
from spotcr_agent.criu import MEM_DIRTY_TRACK, Criu
from spotcr_agent.store import CheckpointStore

from tests.support import wait_for

# Outside the VM-local dirs (/tmp, /var/tmp, /dev/shm), which the agent carries whole with every checkpoint: the
# store, the agent's state and the work dir are on the job's storage or the agent's own on a real VM.
ROOT = Path("/run/spotcr-tracked")
JOB = Path(__file__).with_name("jobs") / "dirty.py"
HOT_PERCENT = 5
STEP_TIMEOUT_S = 240


class Events:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def publish(self, event: Any) -> bool:
        self.events.append({"type": event.DETAIL_TYPE, **event.detail()})
        return True


def agent_for(name: str, generation: int, mode: str, command: tuple[str, ...], events: Events) -> Agent:
    config = AgentConfig(
        job_id="job-1",
        instance_id=f"i-{name}",
        storage="efs",
        generation=generation,
        mode=mode,
        workdir=ROOT / "work",
        state_dir=ROOT / name / "state",
        scratch_dir=ROOT / name / "scratch",
        mount_point=ROOT / "store",
        command=command,
        keep_checkpoints=10,
    )
    config.mount_point.mkdir(parents=True, exist_ok=True)
    store = CheckpointStore.for_directory(config.mount_point, config.job_id)
    return Agent(config=config, publisher=events, job_env=base_job_env(os.environ), store_factory=lambda _: store)


def page_bytes(store: CheckpointStore, checkpoint_id: str) -> dict[str, int]:
    """Bytes of CRIU's page images per image directory of a checkpoint: images/ (its own dump), images/parent/..."""
    sizes: dict[str, int] = {}
    for entry in store.load(checkpoint_id).files:
        directory, _, name = entry.path.rpartition("/")
        if name.startswith("pages-") and directory.startswith("images"):
            sizes[directory] = sizes.get(directory, 0) + entry.size
    return sizes


def allow(steps: int) -> None:
    path = ROOT / "work" / "allow"
    path.with_suffix(".tmp").write_text(str(steps))
    path.with_suffix(".tmp").rename(path)


def progressed(steps: int) -> Any:
    def check() -> bool:
        path = ROOT / "work" / "progress.log"
        return path.exists() and len(path.read_text().splitlines()) >= steps

    return check


def main(megabytes: int, steps: int) -> dict[str, Any]:
    shutil.rmtree(ROOT, ignore_errors=True)
    ROOT.mkdir(parents=True)
    command = (sys.executable, str(JOB), str(megabytes), str(steps), str(HOT_PERCENT))
    result: dict[str, Any] = {
        "kernel": os.uname().release,
        "criu_check": Criu().supports(MEM_DIRTY_TRACK),
        "megabytes": megabytes,
        "hot_percent": HOT_PERCENT,
    }
    events = Events()
    primary = agent_for("vm1", 1, "run", command, events)
    primary.ready()
    (ROOT / "work").mkdir(parents=True, exist_ok=True)
    allow(2)
    primary.start_job()
    wait_for(progressed(2), "the job's first steps", timeout=STEP_TIMEOUT_S)
    checkpoints = []
    # A full dump, as on a kernel without tracking: the figures to compare with.
    primary.criu._features[MEM_DIRTY_TRACK] = False
    checkpoints.append(("full periodic", primary.checkpoint("periodic", 1)))
    del primary.criu._features[MEM_DIRTY_TRACK]
    allow(4)
    wait_for(progressed(4), "steps 3-4", timeout=STEP_TIMEOUT_S)
    checkpoints.append(("tracked periodic, fresh chain", primary.checkpoint("periodic", 1)))
    allow(6)
    wait_for(progressed(6), "steps 5-6", timeout=STEP_TIMEOUT_S)
    checkpoints.append(("tracked periodic, on the chain", primary.checkpoint("periodic", 1)))
    allow(8)
    wait_for(progressed(8), "steps 7-8", timeout=STEP_TIMEOUT_S)
    checkpoints.append(("incremental final", primary.checkpoint("final", 1)))
    store = primary.store()
    assert isinstance(store, CheckpointStore)
    result["checkpoints"] = [
        {
            "step": step,
            **outcome.to_json(),
            "page_bytes": page_bytes(store, outcome.checkpoint_id),
        }
        for step, outcome in checkpoints
    ]
    result["events"] = events.events

    # The job's VM is lost: only the store remains.
    for gone in ("work", "vm1"):
        shutil.rmtree(ROOT / gone)
    backup = agent_for("vm2", 2, "restore", command, events)
    backup.ready()
    t0 = time.monotonic()
    restored = backup.restore(2)
    result["restore"] = {**restored.to_json(), "wall_seconds": round(time.monotonic() - t0, 2)}
    allow(steps)
    deadline = time.monotonic() + 240
    exit_code = None
    while exit_code is None and time.monotonic() < deadline:
        exit_code = backup.watch_job()
        time.sleep(0.05)
    result["exit_code"] = exit_code
    result["restored"] = {
        "progress": (ROOT / "work" / "progress.log").read_text(),
        "stdout": (ROOT / "work" / ".spotcr" / "stdout.log").read_text(),
    }
    return result


if __name__ == "__main__":
    target = Path(sys.argv[1])
    try:
        document = main(int(sys.argv[2]), int(sys.argv[3]))
    except Exception as error:
        import traceback

        document = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    target.write_text(json.dumps(document, indent=1, default=str))
    sys.exit(0 if "error" not in document else 1)
