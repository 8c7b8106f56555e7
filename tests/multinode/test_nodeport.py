"""The agents' port (spotcr_agent.nodeport): node 0's agent drives the other nodes' locks and dumps over it, and a
node answers only requests signed with its run's launch key, fresh and never seen before."""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from spotcr_agent import nodeport, nodes
from spotcr_agent.nodeport import SIGNATURE, Gate, NodePort, RemoteNode

KEY = secrets.token_bytes(32)
NOW = 1_800_000_000.0


class RecordingAgent:
    """A node's agent that records the steps it was asked for (the coordinator's order is what is tested here;
    tests/multinode/test_coordinated_checkpoint_criu.py dumps real shares)."""

    def __init__(self, index: int, steps: list[str], fail: str = "") -> None:
        self.index = index
        self.steps = steps
        self.fail = fail
        self.bodies: list[Mapping[str, Any]] = []

    def actions(self) -> dict[str, nodeport.Action]:
        return {name: self._step(name) for name in ("lock", "dump", "commit", "unlock")}

    def _step(self, name: str) -> nodeport.Action:
        def step(body: Mapping[str, Any]) -> Mapping[str, Any]:
            self.steps.append(f"{name} {self.index}")
            self.bodies.append(body)
            if name == self.fail:
                raise RuntimeError(f"node {self.index} cannot {name}")
            if name == "dump":
                self.kind = body["kind"]
            if name == "commit":
                return {"checkpoint_id": f"1800000000000-g{body['generation']}-s{body['sequence']}-{self.kind}"}
            return {}

        return step


@pytest.fixture
def port() -> Iterator[tuple[NodePort, list[str]]]:
    steps: list[str] = []
    with NodePort("127.0.0.1", 0, Gate(KEY), RecordingAgent(1, steps).actions()) as served:
        yield served, steps


def _post(served: NodePort, action: str, body: bytes, headers: Mapping[str, str]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"http://{served.address}:{served.port}/v1/{action}", data=body, method="POST", headers=dict(headers)
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_signed_request_is_answered(port: tuple[NodePort, list[str]]) -> None:
    served, steps = port
    node = RemoteNode(1, "127.0.0.1", KEY, port=served.port, order={"generation": 3, "sequence": 7})
    node.lock()
    node.dump("final")
    assert node.commit() == "1800000000000-g3-s7-final"
    assert steps == ["lock 1", "dump 1", "commit 1"]


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        ("another key", "bad signature"),
        ("no signature", "unsigned request"),
        ("another action", "bad signature"),
        ("another body", "bad signature"),
    ],
)
def test_a_request_not_signed_for_what_it_asks_is_refused(
    port: tuple[NodePort, list[str]], tamper: str, reason: str
) -> None:
    served, steps = port
    body = json.dumps({"kind": "final", "generation": 1, "sequence": 1}).encode()
    headers = nodeport.signed_headers(secrets.token_bytes(32) if tamper == "another key" else KEY, "unlock", body)
    if tamper == "no signature":
        del headers[SIGNATURE]
    action = "dump" if tamper == "another action" else "unlock"
    sent = b'{"kind": "periodic"}' if tamper == "another body" else body
    status, answer = _post(served, action, sent, headers)
    assert (status, answer["ok"]) == (401, False)
    assert reason in answer["error"]
    assert steps == []


def test_a_stale_request_is_refused() -> None:
    # Given a node whose clock says NOW, and a request signed with the right key 61 s earlier
    steps: list[str] = []
    with NodePort("127.0.0.1", 0, Gate(KEY, clock=lambda: NOW), RecordingAgent(1, steps).actions()) as served:
        node = RemoteNode(1, "127.0.0.1", KEY, port=served.port, clock=lambda: NOW - nodeport.MAX_SKEW_S - 1)

        # When it reaches the node, then it is refused and nothing is done
        with pytest.raises(nodes.NodeError, match=r"node 1 \(127.0.0.1\) refused lock: stale request"):
            node.lock()
    assert steps == []


def test_a_replayed_request_is_refused(port: tuple[NodePort, list[str]]) -> None:
    # Given a signed lock request that was answered
    served, steps = port
    headers = nodeport.signed_headers(KEY, "lock", b"{}")
    assert _post(served, "lock", b"{}", headers)[0] == 200

    # When the same request comes again within the window, then it is refused and the lock is not taken twice
    status, answer = _post(served, "lock", b"{}", headers)
    assert (status, "replayed request" in answer["error"]) == (401, True)
    assert steps == ["lock 1"]


def test_the_gate_forgets_nonces_only_once_their_date_is_stale() -> None:
    now = [NOW]
    gate = Gate(KEY, clock=lambda: now[0])
    headers = nodeport.signed_headers(KEY, "lock", b"{}", clock=lambda: NOW)
    gate.check("lock", headers, b"{}")
    now[0] += 2 * nodeport.MAX_SKEW_S + 1
    # Past the window the request is stale before its nonce is looked at: forgetting the nonce lets nothing in
    with pytest.raises(nodeport.Refused, match="stale request"):
        gate.check("lock", headers, b"{}")


def test_an_unknown_action_is_named(port: tuple[NodePort, list[str]]) -> None:
    served, _ = port
    status, answer = _post(served, "restore", b"{}", nodeport.signed_headers(KEY, "restore", b"{}"))
    assert (status, answer["error"]) == (404, "no action 'restore': commit, dump, lock, unlock")


def test_a_launch_key_shorter_than_32_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 32 bytes"):
        Gate(b"short")


@contextlib.contextmanager
def _serving(agents: list[RecordingAgent]) -> Iterator[list[NodePort]]:
    """Each agent behind a port of its own on loopback."""
    ports = [NodePort("127.0.0.1", 0, Gate(KEY), agent.actions()) for agent in agents]
    try:
        yield ports
    finally:
        for served in ports:
            served.close()


def _periodic(ports: list[NodePort], committed: list[nodes.JobManifest], serial: Path) -> nodes.JobManifest:
    """Node 0's coordinated periodic checkpoint over the ports, at generation 2 and sequence 5."""
    order = {"generation": 2, "sequence": 5}
    remote = [RemoteNode(i, "127.0.0.1", KEY, port=p.port, order=order) for i, p in enumerate(ports)]
    return nodes.coordinated_checkpoint(
        remote,
        job_id="mpi-1",
        run_id="r-0123456789abcdef",
        generation=2,
        sequence=5,
        kind="periodic",
        commit=committed.append,
        serial=serial,
    )


def test_the_coordinator_drives_every_node_over_the_port(tmp_path: Path) -> None:
    # Given three nodes serving their port, node 0 among them (the coordinator asks itself over the port too)
    steps: list[str] = []  # list.append is atomic: the nodes' threads record in the order they ran
    committed: list[nodes.JobManifest] = []

    # When node 0 takes a coordinated periodic checkpoint over them
    with _serving([RecordingAgent(i, steps) for i in range(3)]) as ports:
        manifest = _periodic(ports, committed, tmp_path / "serial.lock")

    # Then every node was locked before any dumped, and unlocked only after every dump; one manifest names them all
    assert sorted(steps[:3]) == ["lock 0", "lock 1", "lock 2"]
    assert sorted(steps[3:6]) == ["dump 0", "dump 1", "dump 2"]
    assert sorted(steps[6:9]) == ["unlock 0", "unlock 1", "unlock 2"]
    assert sorted(steps[9:]) == ["commit 0", "commit 1", "commit 2"]
    assert committed == [manifest]
    assert [part.checkpoint_id for part in manifest.nodes] == ["1800000000000-g2-s5-periodic"] * 3


def test_a_node_that_fails_its_dump_fails_the_checkpoint_on_every_node(tmp_path: Path) -> None:
    # Given two nodes, the second of which fails its dump
    steps: list[str] = []
    committed: list[nodes.JobManifest] = []

    # When the coordinator takes a periodic checkpoint, then it fails naming node 1 and its reason over the port
    failed = r"node 1 failed to dump: .*dump failed: node 1 cannot dump"
    agents = [RecordingAgent(0, steps), RecordingAgent(1, steps, fail="dump")]
    with _serving(agents) as ports, pytest.raises(nodes.CheckpointFailed, match=failed):
        _periodic(ports, committed, tmp_path / "serial.lock")

    # And no manifest was committed, and both nodes were unlocked so the job runs on
    assert committed == []
    assert sorted(s for s in steps if s.startswith("unlock")) == ["unlock 0", "unlock 1"]


def test_a_node_that_does_not_answer_is_named() -> None:
    node = RemoteNode(2, "127.0.0.1", KEY, port=1)  # nothing listens on port 1
    with pytest.raises(nodes.NodeError, match=r"node 2 \(127.0.0.1\) did not answer lock"):
        node.lock()


def test_a_nodes_agent_dumps_its_share_at_the_coordinators_order(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a node's agent behind its port, its network lock stood in for (the CRIU tests take the real one)
    asked: list[tuple[Any, ...]] = []

    storing = threading.Event()  # the periodic dump's images go to the store only once the test says so

    class Agent:
        def checkpoint(self, kind: str, generation: int, sequence: int | None, on_resumed: Any) -> Any:
            asked.append((kind, generation, sequence))
            if kind == "periodic":
                on_resumed()  # the share runs again
                assert storing.wait(10)
            checkpoint = f"1800000000000-g{generation}-s{sequence}-{kind}"
            return SimpleNamespace(checkpoint_id=checkpoint, seconds=1.5, frozen_seconds=0.25)

    monkeypatch.setattr(nodes, "lock", lambda *args: asked.append(("lock", *args)))
    monkeypatch.setattr(nodes, "unlock", lambda: asked.append(("unlock",)))
    actions = nodeport.agent_actions(Agent(), "10.0.0.11", "10.0.0.0/24")
    with NodePort("127.0.0.1", 0, Gate(KEY), actions) as served:
        node = RemoteNode(1, "127.0.0.1", KEY, port=served.port, order={"generation": 4, "sequence": 9})

        # When the coordinator orders a periodic dump, then the node answers once its share runs again, before its
        # images are stored; its commit answers once they are
        node.dump("periodic")
        storing.set()
        assert node.commit() == "1800000000000-g4-s9-periodic"
        # And when it locks it and orders its final dump, then it commits; a dump with no generation is refused
        node.lock()
        node.dump("final")
        assert node.commit() == "1800000000000-g4-s9-final"
        with pytest.raises(nodes.NodeError, match="a dump names its kind"):
            RemoteNode(1, "127.0.0.1", KEY, port=served.port).dump("final")
        with pytest.raises(nodes.NodeError, match="no dump of generation 4, sequence 9 here"):
            node.commit()

    # Then the agent locked its address against the other nodes and dumped its share at the order's generation
    assert asked == [("periodic", 4, 9), ("lock", "10.0.0.11", "10.0.0.0/24", ""), ("final", 4, 9)]
