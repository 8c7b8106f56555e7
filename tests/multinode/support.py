"""What the multi-node tests share: the ping-pong job of two nodes and a node driven through its VM's agent."""

import sys
from pathlib import Path

PINGPONG = str(Path(__file__).parent / "jobs" / "pingpong.py")
PORT = 7100
IN_VM = [sys.executable, "-c"]


def expected_progress(steps):
    """What both nodes of an uninterrupted ping-pong run write to progress.log."""
    total, lines = 1, []
    for step in range(steps):
        total = (total * 1000003 + step) % (1 << 61)
        lines.append(f"step {step} {total}")
    return lines


def serve(steps, step_seconds=0.1):
    return (sys.executable, PINGPONG, "serve", str(PORT), str(steps), str(step_seconds))


def dial(address, steps, step_seconds=0.1):
    return (sys.executable, PINGPONG, "dial", address, str(PORT), str(steps), str(step_seconds))


def unlock(vm):
    result = vm.run([*IN_VM, "from spotcr_agent import nodes; nodes.unlock()"])
    assert result.returncode == 0, result.stderr


class AgentNode:
    """A node as the coordinator drives it (spotcr_agent.nodes.Node): its agent on a bare VM (tests.agent.vm_agent),
    reached with `vm.run` where EC2's coordinator would use the agents' port."""

    def __init__(self, index, job, generation=1):
        self.index = index
        self.job = job
        self.address = job.vm.address
        self.generation = generation
        self.before_dump = self.after_dump = lambda: None  # a test's hooks, to force an interleaving

    def lock(self):
        network = self.job.vm.network
        arguments = f"{self.address!r}, {str(network.subnet)!r}, {network.gateway!r}"
        code = f"from spotcr_agent import nodes; nodes.lock({arguments})"
        result = self.job.vm.run([*IN_VM, code])
        if result.returncode != 0:
            raise RuntimeError(result.stderr.strip())

    def dump(self, kind):
        self.before_dump()
        try:
            self.dumped = self.job.agent("checkpoint", kind, str(self.generation))["checkpoint_id"]
        finally:
            self.after_dump()

    def commit(self):
        return self.dumped  # the agent's own checkpoint command commits before it answers

    def unlock(self):
        unlock(self.job.vm)

    def locked(self):
        result = self.job.vm.run([*IN_VM, "from spotcr_agent import nodes; print(nodes.locked())"])
        assert result.returncode == 0, result.stderr
        return result.stdout.strip() == "True"
