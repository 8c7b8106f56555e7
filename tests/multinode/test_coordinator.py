"""The coordinated checkpoint's order and failure rule, with nodes that record what they were asked (no VMs)."""

import json
import re
import threading

import pytest
from spotcr_agent.nodes import CheckpointFailed, JobManifest, NodePart, coordinated_checkpoint, read_manifest
from spotcr_agent.store.backends import DirectoryBackend


class RecordingNode:
    """A node that records each step in one shared log, and fails the step named in `fails`."""

    def __init__(self, index, log, guard, fails=""):
        self.index = index
        self.address = f"198.18.7.{index + 2}"
        self.log = log
        self.guard = guard
        self.fails = fails
        self.is_locked = False
        self.before_dump = lambda: None  # a test's hook, to hold a dump in the middle

    def _step(self, step):
        with self.guard:
            self.log.append((step, self.index))
        if step == self.fails:
            raise OSError(f"node {self.index} cannot {step}")

    def lock(self):
        self._step("lock")
        self.is_locked = True

    def dump(self, kind):
        self.before_dump()
        self._step("dump")
        self.dumped = f"170000000000{self.index}-g1-s4-{kind}"

    def commit(self):
        self._step("commit")
        return self.dumped

    def unlock(self):
        self._step("unlock")
        self.is_locked = False


def nodes(count, fails=None):
    log: list[tuple[str, int]] = []
    guard = threading.Lock()
    return [RecordingNode(i, log, guard, (fails or {}).get(i, "")) for i in range(count)], log


def checkpoint(job_nodes, serial, kind="periodic", commit=None):
    committed: list[JobManifest] = []
    manifest = coordinated_checkpoint(
        job_nodes,
        job_id="job-1",
        run_id="r-1",
        generation=1,
        sequence=4,
        kind=kind,
        commit=commit or committed.append,
        serial=serial,
        clock=lambda: 1_700_000_000.5,
    )
    return manifest, committed


def steps(log):
    return [step for step, _ in log]


def test_no_node_dumps_before_every_node_is_locked_nor_is_unlocked_before_every_node_dumped(tmp_path):
    # Given three nodes
    job_nodes, log = nodes(3)
    # When a periodic checkpoint is coordinated
    manifest, committed = checkpoint(job_nodes, tmp_path / "serial")
    # Then every lock comes before any dump, and every dump before any unlock; the commits come after the unlocks
    assert steps(log) == ["lock"] * 3 + ["dump"] * 3 + ["unlock"] * 3 + ["commit"] * 3
    assert {index for _, index in log} == {0, 1, 2}
    # And one manifest names every node's part, in node order, under one id of the order's generation and sequence
    assert committed == [manifest]
    assert manifest.checkpoint_id == "1700000000500-g1-s4-periodic"
    parts = tuple(NodePart(i, f"198.18.7.{i + 2}", f"170000000000{i}-g1-s4-periodic") for i in range(3))
    assert manifest.nodes == parts


def test_a_final_dump_leaves_every_node_locked_for_the_restore(tmp_path):
    job_nodes, log = nodes(2)
    checkpoint(job_nodes, tmp_path / "serial", kind="final")
    assert steps(log) == ["lock", "lock", "dump", "dump", "commit", "commit"]
    assert all(node.is_locked for node in job_nodes)


@pytest.mark.parametrize("step", ["lock", "dump"])
def test_a_node_that_fails_fails_the_checkpoint_on_all_and_a_periodic_dump_unlocks_every_node(step, tmp_path):
    # Given node 1 of three fails a step
    job_nodes, log = nodes(3, fails={1: step})
    # When the checkpoint is coordinated
    with pytest.raises(CheckpointFailed, match=f"node 1 failed to {step}: node 1 cannot {step}") as failed:
        checkpoint(job_nodes, tmp_path / "serial", commit=lambda manifest: pytest.fail("a failed one committed"))
    # Then no manifest exists, every node is unlocked, and no node dumped after a failed lock
    assert (failed.value.index, failed.value.step) == (1, step)
    assert not any(node.is_locked for node in job_nodes)
    assert steps(log)[-3:] == ["unlock"] * 3
    if step == "lock":
        assert "dump" not in steps(log)


def test_a_commit_that_fails_fails_the_checkpoint_after_the_nodes_ran_on(tmp_path):
    # Given node 2 of three whose images cannot be stored
    job_nodes, log = nodes(3, fails={2: "commit"})
    # When a periodic checkpoint is coordinated, then it fails naming the node, and no manifest exists
    with pytest.raises(CheckpointFailed, match="node 2 failed to commit: node 2 cannot commit"):
        checkpoint(job_nodes, tmp_path / "serial", commit=lambda manifest: pytest.fail("a failed one committed"))
    # And every node was unlocked before the commits: the job ran on while the images went to the store
    assert steps(log) == ["lock"] * 3 + ["dump"] * 3 + ["unlock"] * 3 + ["commit"] * 3
    assert not any(node.is_locked for node in job_nodes)


def test_a_failed_final_dump_leaves_the_nodes_locked_for_the_recovery(tmp_path):
    job_nodes, _ = nodes(2, fails={0: "dump"})
    with pytest.raises(CheckpointFailed, match="node 0 failed to dump"):
        checkpoint(job_nodes, tmp_path / "serial", kind="final")
    assert all(node.is_locked for node in job_nodes)


def test_a_job_manifest_is_written_whole_and_read_back(tmp_path):
    job_nodes, _ = nodes(2)
    manifest, _ = checkpoint(
        job_nodes, tmp_path / "serial", commit=lambda manifest: manifest.write(DirectoryBackend(tmp_path))
    )
    path = tmp_path / "jobs/job-1/runs/r-1/nodes/1700000000500-g1-s4-periodic.json"
    assert json.loads(path.read_text())["nodes"][1]["address"] == "198.18.7.3"
    assert read_manifest(DirectoryBackend(tmp_path), "job-1", "r-1", manifest.checkpoint_id) == manifest
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_a_job_manifest_names_nodes_0_to_n_minus_1_and_at_least_two(tmp_path):
    part = NodePart(0, "198.18.7.2", "1700000000000-g1-s4-periodic")
    with pytest.raises(ValueError, match=re.escape("nodes 0..N-1 in order, N >= 2; got [0]")):
        JobManifest("job-1", "r-1", "1700000000500-g1-s4-periodic", (part,))
    with pytest.raises(ValueError, match=re.escape("got [1, 0]")):
        JobManifest("job-1", "r-1", "x", (NodePart(1, "a", "b"), part))
    with pytest.raises(ValueError, match="not a job manifest"):
        JobManifest.from_json({"job_id": "job-1", "nodes": []})
    with pytest.raises(ValueError, match="kind must be one of periodic, final"):
        checkpoint(nodes(2)[0], tmp_path / "serial", kind="pre-dump")


def test_a_final_dump_ordered_during_a_periodic_one_waits_for_it_and_leaves_the_nodes_locked(tmp_path):
    # Given a periodic checkpoint held in the middle of node 1's dump
    job_nodes, log = nodes(2)
    dumping, go_on = threading.Event(), threading.Event()

    def hold():
        dumping.set()
        go_on.wait(10)

    job_nodes[1].before_dump = hold
    periodic = threading.Thread(target=checkpoint, args=(job_nodes, tmp_path / "serial"))
    periodic.start()
    assert dumping.wait(10)
    # When node 1 is warned and the final dump is ordered meanwhile
    job_nodes[1].before_dump = lambda: None
    final = threading.Thread(target=checkpoint, args=(job_nodes, tmp_path / "serial"), kwargs={"kind": "final"})
    final.start()
    # Then it waits for the periodic one (a second lock now would be unlocked by the periodic one's end)
    final.join(timeout=0.3)
    assert final.is_alive() and steps(log) == ["lock", "lock", "dump"]
    # And once that ends, it runs whole and leaves every node locked for the restore
    go_on.set()
    periodic.join(10)
    final.join(10)
    periodic_steps = ["lock"] * 2 + ["dump"] * 2 + ["unlock"] * 2 + ["commit"] * 2
    assert steps(log) == periodic_steps + ["lock"] * 2 + ["dump"] * 2 + ["commit"] * 2
    assert all(node.is_locked for node in job_nodes)
