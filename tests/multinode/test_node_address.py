"""A node's address on its VM: EC2 assigns it as a secondary private address, which Debian does not configure; the
agent puts it on the interface that holds the instance's own address and makes it the source toward the subnet."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
from spotcr_agent import nodes

SHOWN = (
    "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever\n"
    "2: ens5    inet 10.0.1.23/24 metric 100 brd 10.0.1.255 scope global dynamic ens5\\       valid_lft 3100sec\n"
)


class FakeIp:
    """`ip`, answering `addr show` with what a VM holds and recording every other command."""

    def __init__(self, shown: str = SHOWN, fails: str = "") -> None:
        self.shown = shown
        self.fails = fails
        self.ran: list[list[str]] = []

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if argv[:5] == ["ip", "-o", "-4", "addr", "show"]:
            return subprocess.CompletedProcess(argv, 0, self.shown, "")
        self.ran.append(argv)
        failed = self.fails and self.fails in argv
        return subprocess.CompletedProcess(
            argv, 2 if failed else 0, "", "RTNETLINK answers: File exists" if failed else ""
        )


def test_a_node_address_not_on_the_vm_is_put_on_the_primary_interface_and_made_the_subnets_source() -> None:
    ip = FakeIp()
    assert nodes.hold_address("10.0.1.50", lambda: "10.0.1.23", run=ip) == "ens5"
    assert ip.ran == [
        ["ip", "addr", "add", "10.0.1.50/24", "dev", "ens5"],
        ["ip", "route", "replace", "10.0.1.0/24", "dev", "ens5", "src", "10.0.1.50"],
    ]


def test_a_node_address_the_vm_holds_is_left_as_it_is_without_asking_imds() -> None:
    ip = FakeIp(SHOWN.replace("10.0.1.23/24", "10.0.1.50/24"))
    assert nodes.hold_address("10.0.1.50", lambda: pytest.fail("IMDS asked"), run=ip) == "ens5"
    assert ip.ran == []


@pytest.mark.parametrize(
    ("address", "primary", "fails", "message"),
    [
        ("10.0.2.50", "10.0.1.23", "", r"node address 10.0.2.50 is not in 10.0.1.0/24, the subnet of .* 10.0.1.23"),
        ("10.0.1.50", "10.0.9.9", "", "no interface holds this instance's address '10.0.9.9'"),
        ("10.0.1.50", "10.0.1.23", "route", "ip route replace 10.0.1.0/24 .* failed: RTNETLINK answers: File exists"),
    ],
)
def test_a_node_address_that_cannot_be_held_is_refused_naming_why(
    address: str, primary: str, fails: str, message: str
) -> None:
    with pytest.raises(nodes.NodeError, match=message):
        nodes.hold_address(address, lambda: primary, run=FakeIp(fails=fails))


def test_a_backup_holds_the_address_without_its_route_until_its_share_is_restored() -> None:
    # A backup puts the address on before EC2 moved it there: nothing may leave from it yet
    ip = FakeIp()
    assert nodes.hold_address("10.0.1.50", lambda: "10.0.1.23", run=ip, route=False) == "ens5"
    assert ip.ran == [["ip", "addr", "add", "10.0.1.50/24", "dev", "ens5"]]

    # Once restored there, connections to the subnet leave from it
    held = FakeIp(SHOWN + "2: ens5    inet 10.0.1.50/24 scope global secondary ens5\\       valid_lft forever\n")
    nodes.route_from("10.0.1.50", run=held)
    assert held.ran == [["ip", "route", "replace", "10.0.1.0/24", "dev", "ens5", "src", "10.0.1.50"]]


def test_an_interfaces_own_first_address_is_its_subnets_source_already() -> None:
    ip = FakeIp()
    nodes.route_from("10.0.1.23", run=ip)
    assert ip.ran == []
    with pytest.raises(nodes.NodeError, match=r"no interface holds node address 10\.0\.1\.99"):
        nodes.route_from("10.0.1.99", run=ip)
