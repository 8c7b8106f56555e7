"""A backup takes over an interrupted node's private address, and the node's TCP connection to the other node
carries on across its final dump and restore (real CRIU, bare local VMs on one bridge)."""

import pytest

from rehearsal.vm import VmError
from tests.agent.vm_agent import JobVM
from tests.support import wait_for

from .support import IN_VM, PORT, dial, expected_progress, serve, unlock

pytestmark = pytest.mark.criu


def connect(vm, address, port):
    """What a TCP connect from `vm` to address:port meets: 'connected', 'refused' or 'timeout' (dropped)."""
    probe = (
        "import socket, sys\n"
        "try:\n"
        f"    socket.create_connection(({address!r}, {port}), timeout=1); print('connected')\n"
        "except ConnectionRefusedError: print('refused')\n"
        "except OSError: print('timeout')\n"
    )
    return vm.run([*IN_VM, probe]).stdout.strip()


def test_a_takeover_waits_for_the_old_vm_and_comes_up_locked_until_the_restore(bare_vm):
    # Given a VM and a peer on the same bridge
    peer, old = bare_vm(), bare_vm()
    # When another VM asks for the old VM's address while it lives, it is refused: never two live holders
    with pytest.raises(VmError, match="a live VM holds it"):
        bare_vm(takeover=old.address)
    # And once the old VM is terminated, a backup boots with its address and its MAC
    address, mac = old.address, old.run(["cat", "/sys/class/net/eth0/address"]).stdout
    old.terminate()
    backup = bare_vm(takeover=address)
    assert backup.address == address
    assert backup.run(["cat", "/sys/class/net/eth0/address"]).stdout == mac
    # Then TCP from the peer to it is dropped (no reset for connections it has no socket for yet)
    assert connect(peer, address, PORT) == "timeout"
    # Until the job's restore unlocks the address
    unlock(backup)
    assert connect(peer, address, PORT) == "refused"
    # And an address outside the bridge's subnet is refused
    with pytest.raises(VmError, match="not a VM address"):
        bare_vm(takeover="192.0.2.7")


def test_a_node_restored_on_a_backup_with_its_address_keeps_its_connection_to_the_other_node(
    bare_vm, tmp_path, criu_bin
):
    storage = tmp_path / "storage"
    storage.mkdir()
    steps = 60
    # Given node 0 serving and node 1 dialing it over one TCP connection, each run by its agent on its own VM
    node0 = JobVM(bare_vm(), command=serve(steps))
    node0.agent("start")
    node1_vm = bare_vm(shared_storage=storage)
    node1 = JobVM(node1_vm, command=dial(node0.vm.address, steps))
    node1.agent("start")
    wait_for(lambda: len(node1.progress()) >= 5, what="node 1's progress")

    # When node 1 is warned: its final dump ends it there, its VM goes, and a backup takes over its address
    outcome = node1.agent("checkpoint", "final", "1")
    address = node1_vm.address
    node1_vm.terminate()
    backup = JobVM(bare_vm(shared_storage=storage, takeover=address), generation=2, mode="restore")
    restored = backup.agent("restore", "2")
    unlock(backup.vm)

    # Then the restored node carries on over the same connection and both nodes end as an uninterrupted run
    assert restored["checkpoint_id"] == outcome["checkpoint_id"]
    assert backup.agent("wait-exit", "60")["exit_code"] == 0
    assert node0.agent("wait-exit", "60")["exit_code"] == 0
    assert backup.progress() == expected_progress(steps)
    assert node0.progress() == expected_progress(steps)
