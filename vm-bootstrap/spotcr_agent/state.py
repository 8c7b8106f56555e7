"""The agent's state on the VM, shared by the daemon and the commands SSM runs as separate processes.

One JSON file guarded by `fcntl.flock`: every read-modify-write happens under the lock, so two
triggers for one interruption (an SSM command and the IMDS poll) agree on who takes the final dump.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

LOCK_POLL_S = 0.1


class StaleGeneration(RuntimeError):
    """A command for an older generation than this VM serves: fenced off."""

    def __init__(self, requested: int, served: int) -> None:
        super().__init__(
            f"generation {requested} is stale: this VM serves generation {served}; "
            "a newer generation of the job has taken over"
        )
        self.requested = requested
        self.served = served


@dataclass
class FinalDump:
    """The one final dump of a generation: who takes it and what it produced."""

    status: str  # running | done | failed
    owner_pid: int
    result: dict[str, Any] = field(default_factory=dict)


@dataclass
class AgentState:
    job_id: str = ""
    run_id: str = ""  # the run of the job this VM serves (spotcr:run), set when it starts or restores the job
    generation: int = 0  # the generation this VM serves (fencing token)
    sequence: int | None = None  # the highest order sequence this VM was given (Agent.fence); None: never one
    job_pid: int = 0  # host PID of the job's PID 1; 0 when no job runs here
    job_start_time: int = 0
    # none | running | exited | checkpointed | stopped (killed after its final dump failed: never resumed here)
    job_status: str = "none"
    exit_code: int | None = None
    last_checkpoint: str | None = None
    result: str = ""  # where the ended job's work dir was committed as its result
    result_error: str = ""  # why it could not be; with `result`, empty until the commit was tried
    result_missing: str = ""  # the declared result files (spotcr:result) the job did not leave, comma-separated
    # The final dumps of the job's run on this VM, by the generation that asked (JSON keys are strings).
    final_dumps: dict[str, FinalDump] = field(default_factory=dict)
    # The newest periodic dumps' figures (deadline.Sample), from which the final dump's time is predicted.
    dump_samples: list[dict[str, Any]] = field(default_factory=list)

    def final_dump(self) -> FinalDump | None:
        """The final dump that stops this run of the job, whichever trigger and generation asked for it: the
        IMDS notice asks at the generation this VM serves, the warning's SSM command at the next one."""
        for final in reversed(self.final_dumps.values()):
            if final.status in ("running", "done"):
                return final
        return next(reversed(self.final_dumps.values()), None)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AgentState:
        finals = {k: FinalDump(**v) for k, v in data.pop("final_dumps", {}).items()}
        return cls(final_dumps=finals, **data)


class StateFile:
    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self.path = state_dir / "state.json"
        self._lock_path = state_dir / "state.lock"

    @contextlib.contextmanager
    def locked(self) -> Iterator[AgentState]:
        """The state under an exclusive lock; changes made to it are saved when the block ends cleanly."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = self._read()
            before = state.to_json()
            yield state
            if state.to_json() != before:
                self._write(state)

    def read(self) -> AgentState:
        with self.locked() as state:
            return state

    def _read(self) -> AgentState:
        try:
            return AgentState.from_json(json.loads(self.path.read_text()))
        except FileNotFoundError:
            return AgentState()

    def _write(self, state: AgentState) -> None:
        tmp = self.path.with_name(f".state.{os.getpid()}.tmp")
        with open(tmp, "w") as out:
            json.dump(state.to_json(), out, indent=2)
            out.flush()
            os.fsync(out.fileno())
        tmp.replace(self.path)


def admit(state: AgentState, generation: int) -> None:
    """Fencing: refuse an older generation, adopt a newer one."""
    if generation < state.generation:
        raise StaleGeneration(generation, state.generation)
    state.generation = generation


@contextlib.contextmanager
def exclusive(path: Path, while_held: Callable[[], None] | None = None) -> Iterator[None]:
    """Held while CRIU dumps or restores: two CRIU runs on one job never overlap. `while_held` is called every
    LOCK_POLL_S while another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:
        if while_held is None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        while while_held is not None and not _took(lock):
            while_held()
            time.sleep(LOCK_POLL_S)
        yield


def _took(lock: IO[str]) -> bool:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
