"""Which addresses a restore keeps on loopback, which connections it resets, the refusal under the close policy."""

import os
import subprocess

import pytest
from spotcr_agent import aliases
from spotcr_agent.aliases import outside_connections, wanted
from spotcr_agent.carry import JobScan, vm_bound_listeners
from spotcr_agent.criu import _reset_script


def _record(listening=(), connections=(), vm_addresses=("10.0.0.5", "fd00::5")):
    established = sorted({c.split()[0] for c in connections})
    scan = {"listening": list(listening), "established": established, "connections": list(connections)}
    return {"scan": scan, "vm_addresses": list(vm_addresses)}


def test_only_the_checkpoint_vm_s_own_addresses_that_the_job_used_are_kept():
    # Given a job listening on its VM's v4 and v6 addresses, on all addresses and on loopback, and connected from
    # an address its VM did not have (say, a container's)
    record = _record(
        listening=("10.0.0.5 7000", "fd00::5 7001", "0.0.0.0 7002", "127.0.0.1 7003"),
        connections=("172.17.0.2 40000 10.0.0.9 80",),
    )
    # Then only the VM's own addresses are kept, and none under the close policy or from an older checkpoint
    assert wanted(record, "established") == ["10.0.0.5", "fd00::5"]
    assert wanted(record, "close") == []
    assert wanted({"scan": record["scan"]}, "established") == []


def test_connections_to_peers_outside_the_job_from_a_kept_address_are_reset_and_the_job_s_own_are_not():
    record = _record(
        connections=(
            "10.0.0.5 7000 10.0.0.5 41000",  # the job's two ends of one connection
            "10.0.0.5 41000 10.0.0.5 7000",
            "10.0.0.5 41001 10.0.0.9 6379",  # to a service on another host
            "127.0.0.1 41002 127.0.0.1 8080",  # on loopback: not on a kept address
        )
    )
    assert outside_connections(record, ["10.0.0.5"]) == ["10.0.0.5 41001 10.0.0.9 6379"]
    assert outside_connections(record, []) == []


def test_a_listener_on_the_vm_s_address_is_refused_only_under_the_close_policy():
    scan = JobScan(listening=["10.0.0.5 7000", "0.0.0.0 7001"])
    assert vm_bound_listeners(scan, "established") is None
    problem = vm_bound_listeners(scan, "close")
    assert problem is not None and "it listens on 10.0.0.5:7000, an address only this VM has" in problem
    assert "7001" not in problem
    assert vm_bound_listeners(JobScan(listening=["0.0.0.0 7001", "::1 7002"]), "close") is None


def test_the_reset_script_destroys_each_connection_only_before_the_job_resumes(tmp_path):
    script = _reset_script(tmp_path / "reset.sh", ["10.0.0.5 41001 10.0.0.9 6379", "fd00::5 41002 fd00::9 6379"])
    text = script.read_text()
    assert "ss -K -tn state established src 10.0.0.5:41001 dst 10.0.0.9:6379" in text
    assert "src [fd00::5]:41002 dst [fd00::9]:6379" in text
    # CRIU runs the script at every stage; at any other than pre-resume it does nothing (no ss on PATH here)
    env = {**os.environ, "CRTOOLS_SCRIPT_ACTION": "post-restore", "PATH": str(tmp_path)}
    assert subprocess.run([str(script)], env=env, check=False).returncode == 0
    env["CRTOOLS_SCRIPT_ACTION"] = "pre-resume"
    assert subprocess.run([str(script)], env=env, check=False, capture_output=True).returncode != 0


class _FakeIp:
    """`ip addr add/del` on a loopback of its own: what the agent added, and failures on demand."""

    def __init__(self, here=(), refuse=()):
        self.loopback: set[str] = set()
        self.here = set(here)
        self.refuse = set(refuse)

    def __call__(self, *args, binary="ip"):
        verb, address = args[1], args[2].split("/")[0]
        if address in self.refuse:
            raise aliases.AliasError(f"ip addr {verb} {address} failed: Operation not permitted")
        (self.loopback.add if verb == "add" else self.loopback.discard)(address)
        return ""

    def address_here(self, address):
        return address in self.here or address in self.loopback


def _fake_ip(monkeypatch, **options):
    ip = _FakeIp(**options)
    monkeypatch.setattr(aliases, "_ip", ip)
    monkeypatch.setattr(aliases.carry, "address_here", ip.address_here)
    return ip


def test_a_restore_removes_the_earlier_restore_s_aliases_and_adds_only_what_this_vm_lacks(tmp_path, monkeypatch):
    ip = _fake_ip(monkeypatch, here={"10.0.1.7"})
    assert aliases.keep(tmp_path, ["10.0.0.5"]) == ["10.0.0.5"]
    # When a later restore on this VM keeps another address, and one this VM has itself
    assert aliases.keep(tmp_path, ["10.0.0.6", "10.0.1.7"]) == ["10.0.0.6"]
    # Then only the new one is on loopback, and it is what a later checkpoint counts as this VM's
    assert ip.loopback == {"10.0.0.6"}
    assert aliases.added(tmp_path) == ["10.0.0.6"]
    # And when the job ends, none is left
    aliases.release(tmp_path)
    assert ip.loopback == set() and aliases.added(tmp_path) == []


def test_an_address_that_cannot_be_added_leaves_no_alias_and_names_the_address(tmp_path, monkeypatch):
    ip = _fake_ip(monkeypatch, refuse={"10.0.0.6"})
    with pytest.raises(aliases.AliasError, match=r"10\.0\.0\.6"):
        aliases.keep(tmp_path, ["10.0.0.5", "10.0.0.6"])
    assert ip.loopback == set() and aliases.added(tmp_path) == []
