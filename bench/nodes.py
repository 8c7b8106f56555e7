"""Coordinated checkpoints of a job over several VMs, against one VM's own dump (issue 25).

`python -m bench nodes [--nodes 1,2,3] [--gib 0.25] [--rounds 2]`: for each node count, a job on that many bare
local VMs, each node's share holding GIB of memory and a TCP ring to the other nodes (bench/nodejob.py),
checkpointed by the real agents and CRIU. One node is a single-VM job, dumped by its own agent. Two or more are
dumped by the coordinator over every node's agents' port: this process runs it, the same code node 0's agent runs
(nodes.coordinated_checkpoint over nodeport.RemoteNode). Per node count, the median over the rounds of:

- periodic checkpoint, freeze: the longest any node's share was frozen by CRIU; held: from the first lock sent to
  the last unlock answered, while no segment crosses between nodes (for one node, its freeze);
- final dump: from the order to the job's checkpoint committed (for one node, its agent's own figure).

Each against one node's in the same run. All the VMs share this machine's cores and disk: N nodes dump N times
the bytes through one host, where a cluster's nodes would each dump their own. Writes bench/results/nodes.json
and nodes.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from spotcr_agent import nodeport, nodes
from spotcr_agent.config import AgentConfig, default_workdir
from spotcr_agent.store.backends import DirectoryBackend

from bench.pipeline import describe_machine
from rehearsal.vm import LocalVM, VmNetwork, bare_vm

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).with_name("results")
NODEJOB = Path(__file__).with_name("nodejob.py")
JOB, RUN = "bench-nodes", "r-00000000000000be"
STOP = "/etc/spotcr/stop-serving"


def in_vm(vm: LocalVM, *op: str) -> dict[str, Any]:
    """One op of bench/nodes_vm.py on the VM (its agent, with the node's agent.json)."""
    argv = ["env", f"PYTHONPATH={ROOT}:{ROOT / 'functions'}:{ROOT / 'vm-bootstrap'}"]
    result = vm.run([*argv, sys.executable, "-m", "bench.nodes_vm", *op], timeout_s=600)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(op)} on {vm.instance_id} failed: {result.stdout[-2000:]}{result.stderr[-2000:]}")
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


class TimedNode(nodeport.RemoteNode):
    """A node as the coordinator drives it, noting when the first lock went out and the last unlock came back, and
    each dump's answer (its CRIU freeze)."""

    def __init__(self, index: int, address: str, key: bytes, marks: dict[str, float], sequence: int) -> None:
        super().__init__(index, address, key, order={"generation": 1, "sequence": sequence})
        self.marks = marks
        self.answer: dict[str, Any] = {}

    def lock(self) -> None:
        self.marks.setdefault("locked", time.monotonic())
        super().lock()

    def commit(self) -> str:
        self.answer = self.ask("commit", self._order)
        return str(self.answer["checkpoint_id"])

    def unlock(self) -> None:
        super().unlock()
        self.marks["unlocked"] = max(self.marks.get("unlocked", 0.0), time.monotonic())


@contextlib.contextmanager
def job_vms(root: Path, network: VmNetwork, count: int, gib: float, key: str) -> Iterator[list[LocalVM]]:
    """`count` booted VMs, each running its node's share (ready), and for two or more each serving its port."""
    with contextlib.ExitStack() as stack:
        volumes = [root / f"node-{index}" for index in range(count)]
        vms = []
        for volume in volumes:
            volume.mkdir(parents=True)
            vms.append(stack.enter_context(bare_vm(root / "vms", network, shared_storage=volume)))
        addresses = tuple(vm.address for vm in vms)
        for index, vm in enumerate(vms):
            command = (sys.executable, str(NODEJOB), str(gib), str(index), ",".join(addresses))
            config = AgentConfig(
                job_id=JOB,
                instance_id=vm.instance_id,
                storage="efs",
                generation=1,
                run_id=RUN,
                command=command,
                nodes=addresses if count > 1 else (),
                node_index=index if count > 1 else 0,
                launch_key=key if count > 1 else "",
            )
            config.write(vm.dir("etc") / "agent.json")
        servers = []
        if count > 1:
            for vm in vms:
                peers = str(network.subnet)
                serve = threading.Thread(target=in_vm, args=(vm, "serve", key, peers, network.gateway, STOP))
                serve.start()
                servers.append(serve)
        try:
            for vm in vms:
                in_vm(vm, "start")
            deadline = time.monotonic() + 300
            while not all((vm.host_path(str(default_workdir(JOB))) / "ready").exists() for vm in vms):
                if time.monotonic() > deadline:
                    raise RuntimeError("the nodes' shares were not ready within 300 s")
                time.sleep(0.1)
            yield vms
        finally:
            for vm in vms:
                (vm.dir("etc") / Path(STOP).name).touch()
            for serve in servers:
                serve.join(60)


def one_round(root: Path, network: VmNetwork, count: int, gib: float) -> dict[str, float]:
    key = secrets.token_hex(32)
    with job_vms(root, network, count, gib, key) as vms:
        if count == 1:
            periodic = in_vm(vms[0], "checkpoint", "periodic", "1")
            final = in_vm(vms[0], "checkpoint", "final", "2")
            freeze = float(periodic["frozen_seconds"])
            return {"freeze_s": freeze, "held_s": freeze, "final_s": float(final["seconds"])}
        figures: dict[str, float] = {}
        for kind, sequence in (("periodic", 1), ("final", 2)):
            marks: dict[str, float] = {}
            remote = [TimedNode(i, vm.address, bytes.fromhex(key), marks, sequence) for i, vm in enumerate(vms)]
            started = time.monotonic()
            nodes.coordinated_checkpoint(
                remote,
                job_id=JOB,
                run_id=RUN,
                generation=1,
                sequence=sequence,
                kind=kind,
                commit=lambda manifest: manifest.write(DirectoryBackend(root / "node-0")),
                serial=root / "coordinated.lock",
            )
            if kind == "periodic":
                figures["freeze_s"] = max(float(node.answer.get("frozen_seconds") or 0.0) for node in remote)
                figures["held_s"] = marks["unlocked"] - marks["locked"]
            else:
                figures["final_s"] = time.monotonic() - started
        return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench nodes", description=__doc__)
    parser.add_argument("--nodes", default="1,2,3", help="node counts, comma-separated; 1 is the baseline")
    parser.add_argument("--gib", type=float, default=0.25, help="memory of each node's share, GiB")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    counts = sorted({int(n) for n in args.nodes.split(",")} | {1})
    machine = describe_machine()
    runs: dict[int, list[dict[str, float]]] = {count: [] for count in counts}
    with tempfile.TemporaryDirectory(prefix="spotcr-bench-nodes-", dir="/var/tmp") as tmp, VmNetwork.create() as net:
        for round_ in range(args.rounds):
            for count in counts:
                figures = one_round(Path(tmp) / f"{count}-{round_}", net, count, args.gib)
                runs[count].append(figures)
                print(f"{count} node(s), round {round_}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()))
    median = {count: {k: statistics.median(r[k] for r in runs[count]) for k in runs[count][0]} for count in counts}
    base = median[1]
    summary = {
        "gib_per_node": args.gib,
        "rounds": args.rounds,
        "machine": machine,
        "median": {str(count): figures for count, figures in median.items()},
        "ratio_to_one_node": {
            str(count): {k: round(v / base[k], 3) if base[k] else None for k, v in figures.items()}
            for count, figures in median.items()
        },
        # This machine does N nodes' work on the same cores and disk: N times one node is its floor for N nodes.
        "ratio_to_n_times_one_node": {
            str(count): {k: round(v / (count * base[k]), 3) if base[k] else None for k, v in figures.items()}
            for count, figures in median.items()
        },
        "runs": {str(count): r for count, r in runs.items()},
    }
    print(json.dumps({k: summary[k] for k in ("median", "ratio_to_one_node", "ratio_to_n_times_one_node")}, indent=2))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "nodes.json").write_text(json.dumps(summary, indent=2) + "\n")
    (RESULTS / "nodes.md").write_text(report(summary))
    return 0


def report(summary: dict[str, Any]) -> str:
    machine = summary["machine"]
    lines = [
        "# Coordinated checkpoints: 2 and 3 nodes against one",
        "",
        f"`python -m bench nodes`: {summary['gib_per_node']} GiB per node, median of {summary['rounds']} rounds, on "
        f"{machine['cpus']} cores ({machine['cpu']}), CRIU {machine['criu']}. Every node is a bare local VM on this "
        "one machine, so N nodes dump N times the bytes through its cores and disk.",
        "",
        "| nodes | periodic: freeze (s) | periodic: connections held (s) | final dump (s) | ratio to one node "
        "(freeze, held, final) | ratio to N times one node |",
        "|---|---|---|---|---|---|",
    ]
    for count, figures in summary["median"].items():
        ratio, floor = summary["ratio_to_one_node"][count], summary["ratio_to_n_times_one_node"][count]
        lines.append(
            f"| {count} | {figures['freeze_s']:.2f} | {figures['held_s']:.2f} | {figures['final_s']:.2f} | "
            f"{ratio['freeze_s']}, {ratio['held_s']}, {ratio['final_s']} | "
            f"{floor['freeze_s']}, {floor['held_s']}, {floor['final_s']} |"
        )
    lines += [
        "",
        "Freeze: the longest CRIU freeze of any node's share. Connections held: from the coordinator's first lock "
        "to its last unlock answered (one node: its freeze; nothing crosses between nodes meanwhile). Final dump: "
        "from the order to the job's checkpoint committed. N times one node is this machine's floor for N nodes, "
        "whose dumps share its cores and disk; on a cluster every node dumps on its own, and one node's figures "
        "plus the coordinator's round trips are the floor.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
