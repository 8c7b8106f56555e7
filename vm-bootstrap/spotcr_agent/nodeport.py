"""The agents' port: how node 0's agent, the coordinator, drives the job's other nodes (docs/design/multinode.md).

Each node's agent listens on its node address, PORT, for the coordinator's requests: `lock`, `dump`, `commit`,
`unlock`, `restore` (spotcr_agent.nodes.Node), and node 0's spotcr-launch's `launch` of this node's share
(launch.py): one HTTP POST each to /v1/<action> with a JSON body, answered with one JSON object: {"ok": true, ...}
or {"ok": false, "error": "..."}. `RemoteNode` is the coordinator's side.

Only the job's own nodes may ask. Every request carries an HMAC-SHA256, under the run's launch key, of its action,
date, nonce and body (`signature`). A node refuses, with 401 and the reason:
1. a request without the three headers, or whose signature does not match (another run's key, or none);
2. one dated more than MAX_SKEW_S from the node's own clock (a captured request played again later);
3. a nonce it has taken within that window (a captured request played again at once).
It checks in that order and remembers a nonce only once the signature holds, so nobody without the key can fill
its memory of nonces. The key never crosses the port.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from spotcr_contracts.results import KINDS

from . import nodes
from .nodes import NodeError, NodeUnreachable

PORT = nodes.AGENTS_PORT
MAX_SKEW_S = 60.0
MAX_BODY = 64 * 1024
DATE, NONCE, SIGNATURE = "X-Spotcr-Date", "X-Spotcr-Nonce", "X-Spotcr-Signature"
# How long the coordinator waits for one step's answer: a dump of a large share takes minutes.
STEP_TIMEOUT_S = {"lock": 30.0, "dump": 900.0, "commit": 900.0, "unlock": 30.0, "restore": 900.0, "probe": 2.0}

Action = Callable[[Mapping[str, Any]], Mapping[str, Any]]


class Refused(Exception):
    """The request is not the job's own (rules 1 to 3)."""


def signature(key: bytes, action: str, date: str, nonce: str, body: bytes) -> str:
    message = b"\n".join([action.encode(), date.encode(), nonce.encode(), hashlib.sha256(body).hexdigest().encode()])
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def signed_headers(key: bytes, action: str, body: bytes, clock: Callable[[], float] = time.time) -> dict[str, str]:
    date, nonce = str(int(clock())), secrets.token_hex(16)
    return {DATE: date, NONCE: nonce, SIGNATURE: signature(key, action, date, nonce, body)}


class Gate:
    """The node's check of each request (rules 1 to 3), with its memory of the nonces taken."""

    def __init__(self, key: bytes, clock: Callable[[], float] = time.time) -> None:
        if len(key) < 32:
            raise ValueError("a launch key has at least 32 bytes")
        self._key = key
        self._clock = clock
        self._seen: dict[str, float] = {}  # nonce -> when it may be forgotten
        self._lock = threading.Lock()

    def check(self, action: str, headers: Mapping[str, str], body: bytes) -> None:
        date, nonce, signed = headers.get(DATE), headers.get(NONCE), headers.get(SIGNATURE)
        if not (date and nonce and signed):
            raise Refused(f"unsigned request: {DATE}, {NONCE} and {SIGNATURE} are required")
        if not hmac.compare_digest(signed, signature(self._key, action, date, nonce, body)):
            raise Refused("bad signature: not signed with this run's launch key")
        now = self._clock()
        if not date.isdigit() or abs(now - int(date)) > MAX_SKEW_S:
            raise Refused(f"stale request: dated {date[:20]}, this node's clock says {int(now)}")
        with self._lock:
            self._seen = {n: until for n, until in self._seen.items() if until > now}
            if nonce in self._seen:
                raise Refused("replayed request: its nonce was taken already")
            self._seen[nonce] = now + 2 * MAX_SKEW_S


class NodePort:
    """A node's port: serves `actions` (name -> body -> answer) to requests the gate lets through, each in a thread
    of its own (the coordinator asks every node at once). Close it with `close()` or as a context manager."""

    def __init__(self, address: str, port: int, gate: Gate, actions: Mapping[str, Action]) -> None:
        self._server = ThreadingHTTPServer((address, port), _handler(gate, actions))
        self._server.daemon_threads = True
        host, port = self._server.server_address[:2]
        self.address, self.port = str(host), int(port)
        self._thread = threading.Thread(target=self._server.serve_forever, name="nodeport", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> NodePort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _handler(gate: Gate, actions: Mapping[str, Action]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            action = self.path.removeprefix("/v1/")
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                self._answer(413, {"ok": False, "error": f"a request body is at most {MAX_BODY} bytes"})
                return
            body = self.rfile.read(length)
            try:
                gate.check(action, {k: self.headers.get(k) or "" for k in (DATE, NONCE, SIGNATURE)}, body)
            except Refused as refused:
                self._answer(401, {"ok": False, "error": str(refused)})
                return
            if action not in actions:
                self._answer(404, {"ok": False, "error": f"no action {action[:40]!r}: {', '.join(sorted(actions))}"})
                return
            try:
                answer = dict(actions[action](json.loads(body or b"{}")))
            except Exception as error:  # the coordinator's failure rule needs the reason, whatever it is
                self._answer(500, {"ok": False, "error": f"{action} failed: {error}"})
                return
            self._answer(200, {"ok": True, **answer})

        def _answer(self, status: int, answer: Mapping[str, Any]) -> None:
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            del format, args  # the agent logs what each action does

    return Handler


def agent_actions(agent: Any, address: str, peers: str, unlocked: str = "") -> dict[str, Action]:
    """What a node's agent (spotcr_agent.agent.Agent) does for each request: lock its node address against the
    other nodes (`peers`), dump its own share at the coordinator's order (generation and sequence: the agent fences
    a stale one off), answering once the share runs again, commit it (answering once its images are stored), lift
    the lock."""
    dumps = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nodeport-dump")  # one dump at a time
    pending: dict[tuple[Any, Any], Future[Any]] = {}

    def lock(body: Mapping[str, Any]) -> Mapping[str, Any]:
        nodes.lock(address, peers, unlocked)
        return {}

    def dump(body: Mapping[str, Any]) -> Mapping[str, Any]:
        kind, generation, sequence = body.get("kind"), body.get("generation"), body.get("sequence")
        if kind not in KINDS or not isinstance(generation, int) or not isinstance(sequence, int | None):
            raise ValueError(f"a dump names its kind ({', '.join(KINDS)}), generation and sequence, not {body}")
        resumed = threading.Event()
        taken = dumps.submit(agent.checkpoint, kind, generation, sequence, on_resumed=resumed.set)
        pending[(generation, sequence)] = taken
        while not resumed.wait(0.02) and not taken.done():
            pass
        if taken.done():
            taken.result()  # a failed dump fails here, before the coordinator unlocks anything
        return {}

    def commit(body: Mapping[str, Any]) -> Mapping[str, Any]:
        taken = pending.pop((body.get("generation"), body.get("sequence")), None)
        if taken is None:
            raise ValueError(f"no dump of generation {body.get('generation')}, sequence {body.get('sequence')} here")
        outcome = taken.result()
        return {
            "checkpoint_id": outcome.checkpoint_id,
            "seconds": outcome.seconds,
            "frozen_seconds": outcome.frozen_seconds,
        }

    def unlock(body: Mapping[str, Any]) -> Mapping[str, Any]:
        nodes.unlock()
        return {}

    def restore(body: Mapping[str, Any]) -> Mapping[str, Any]:
        checkpoint, generation, sequence = body.get("checkpoint_id"), body.get("generation"), body.get("sequence")
        if not isinstance(checkpoint, str) or not isinstance(generation, int) or not isinstance(sequence, int | None):
            raise ValueError(f"a restore names its part's checkpoint, the generation and the sequence, not {body}")
        agent.end_share_for_restore(generation)
        nodes.route_from(address)  # a backup's address is its own by now: the control plane moved it before this
        outcome = agent.restore(generation, checkpoint, sequence=sequence, exact=True)
        return {"checkpoint_id": outcome.checkpoint_id, "seconds": outcome.seconds}

    def launch(body: Mapping[str, Any]) -> Mapping[str, Any]:
        return {"pid": launch_share(agent, body)}

    return {"lock": lock, "dump": dump, "commit": commit, "unlock": unlock, "restore": restore, "launch": launch}


def launch_share(agent: Any, body: Mapping[str, Any]) -> int:
    """Start what node 0's launcher asks for (spotcr_agent.launch) as this node's share of the job: its relay, which
    connects back to node 0's address on the port given, with the token. One share per node: a second is refused."""
    config = agent.config
    argv, address, port, token = body.get("argv"), body.get("address"), body.get("port"), body.get("token")
    if not isinstance(argv, list) or not argv or not all(isinstance(word, str) for word in argv):
        raise ValueError("a launch names its command as a list of words")
    if address != config.nodes[0] or config.node_index == 0:
        raise ValueError(f"a launch comes from node 0 ({config.nodes[0]}) to another node, not from {address}")
    if not isinstance(port, int) or not 0 < port < 65536 or not isinstance(token, str) or len(token) != 32:
        raise ValueError("a launch names node 0's port and its 32-digit token")
    pid = agent.start_job(share=(config.launcher, "--relay", address, str(port), token, "--", *argv))
    if pid is None:
        status = agent.status()
        raise ValueError(f"node {config.node_index} did not start the share: its job is {status.job_status} here")
    return int(pid)


def serve(agent: Any) -> NodePort:
    """This node's port, as the daemon of a multi-node job's agent serves it (config: nodes, node_index,
    launch_key)."""
    config = agent.config
    address = config.nodes[config.node_index]
    peers = ",".join(a for a in config.nodes if a != address)
    return NodePort(address, PORT, Gate(bytes.fromhex(config.launch_key)), agent_actions(agent, address, peers))


def coordinate(
    agent: Any, kind: str, generation: int, sequence: int | None, clock: Callable[[], float] = time.time
) -> nodes.JobManifest:
    """Node 0's agent takes the job's coordinated checkpoint over every node's port, its own included, and commits
    the job manifest to the job's shared storage (nodes.coordinated_checkpoint: the order and the failure rule)."""
    config = agent.config
    key, order = bytes.fromhex(config.launch_key), {"generation": generation, "sequence": sequence}
    remote = [RemoteNode(i, address, key, order=order, clock=clock) for i, address in enumerate(config.nodes)]
    return nodes.coordinated_checkpoint(
        remote,
        job_id=config.job_id,
        run_id=agent.run_id(),
        generation=generation,
        sequence=sequence,
        kind=kind,
        commit=lambda manifest: manifest.write(agent.store().backend),
        serial=config.state_dir / "coordinated.lock",
        clock=clock,
    )


def coordinate_restore(
    agent: Any, generation: int, checkpoint_id: str, sequence: int | None, clock: Callable[[], float] = time.time
) -> nodes.JobManifest:
    """Node 0's agent restores the job's coordinated checkpoint over every node's port, its own included: each node
    its own part, then every node unlocked (nodes.coordinated_restore)."""
    config = agent.config
    agent.mount_handed_over()  # node 0's EBS volume, which holds the job manifests, when node 0 moved
    manifest = nodes.read_manifest(agent.store().backend, config.job_id, agent.run_id(), checkpoint_id)
    key, order = bytes.fromhex(config.launch_key), {"generation": generation, "sequence": sequence}
    remote = [RemoteNode(i, address, key, order=order, clock=clock) for i, address in enumerate(config.nodes)]
    nodes.coordinated_restore(remote, manifest)
    return manifest


class RemoteNode:
    """Node i as the coordinator drives it over the agents' port (spotcr_agent.nodes.Node). Each step raises
    NodeError with the node's reason when it refuses or fails, so the coordinator's failure rule applies."""

    def __init__(
        self,
        index: int,
        address: str,
        key: bytes,
        *,
        port: int = PORT,
        order: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.index = index
        self.address = address
        self._key = key
        self._port = port
        self._order = dict(order or {})  # the dump order every node's dump carries: generation, sequence
        self._clock = clock

    def lock(self) -> None:
        self.ask("lock")

    def dump(self, kind: str) -> None:
        self.ask("dump", {**self._order, "kind": kind})

    def commit(self) -> str:
        return str(self.ask("commit", self._order)["checkpoint_id"])

    def unlock(self) -> None:
        self.ask("unlock")

    def restore(self, checkpoint_id: str) -> None:
        self.ask("restore", {**self._order, "checkpoint_id": checkpoint_id})

    def ask(self, action: str, body: Mapping[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(dict(body or {})).encode()
        request = urllib.request.Request(
            f"http://{self.address}:{self._port}/v1/{action}",
            data=data,
            method="POST",
            headers={"Content-Type": "application/json", **signed_headers(self._key, action, data, self._clock)},
        )
        try:
            with urllib.request.urlopen(request, timeout=STEP_TIMEOUT_S.get(action, 30.0)) as reply:  # noqa: S310
                return dict(json.loads(reply.read()))
        except urllib.error.HTTPError as error:
            raise NodeError(f"node {self.index} ({self.address}) refused {action}: {_reason(error)}") from error
        except (urllib.error.URLError, TimeoutError, OSError) as error:
            raise NodeUnreachable(f"node {self.index} ({self.address}) did not answer {action}: {error}") from error


def answers(index: int, address: str, key: bytes) -> bool:
    """Whether node `index`'s agent answers on its port at all: its refusal of the probe, which no node serves,
    is an answer."""
    try:
        RemoteNode(index, address, key).ask("probe")
    except NodeUnreachable:
        return False
    except NodeError:
        return True
    return True


def _reason(error: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(error.read()).get("error") or error.reason)
    except (ValueError, AttributeError):
        return str(error.reason)
