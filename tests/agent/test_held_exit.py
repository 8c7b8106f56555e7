"""Node 0 of a job over several VMs holds a failure while another node's agent does not answer: MPI ends the job on
every node when one goes, and the control plane's recovery, fenced once EC2 says the node went, must come first."""

from spotcr_agent import agent as agent_module
from spotcr_agent import nodeport

from tests.agent.conftest import make_agent, make_config

KEY = "cd" * 32
NODES = ("127.0.0.1", "127.0.0.77")  # node 1's agent on a loopback address of its own


def test_a_failure_waits_while_a_node_does_not_answer_and_is_reported_once_it_does(tmp_path, publisher) -> None:
    agent = make_agent(make_config(tmp_path, nodes=NODES, launch_key=KEY), publisher)

    # While node 1's agent answers nothing, node 0's failure is held
    assert agent._exit_held(7)

    # Once it answers (a refusal of the probe is an answer), the failure is the job's
    with nodeport.NodePort(NODES[1], nodeport.PORT, nodeport.Gate(bytes.fromhex(KEY)), {}):
        assert not agent._exit_held(7)

    # A success is never held
    assert not agent._exit_held(0)


def test_a_failure_is_held_no_longer_than_the_hold(tmp_path, publisher, monkeypatch) -> None:
    agent = make_agent(make_config(tmp_path, nodes=NODES, launch_key=KEY), publisher)
    monkeypatch.setattr(agent_module, "EXIT_HOLD_S", 0.0)
    agent._exit_held_since = 1.0  # held since long ago
    assert not agent._exit_held(7)


def test_another_node_or_a_single_vm_job_never_holds(tmp_path, publisher) -> None:
    node_1 = make_agent(make_config(tmp_path / "n1", nodes=NODES, node_index=1, launch_key=KEY), publisher)
    single = make_agent(make_config(tmp_path / "one"), publisher)
    assert not node_1._exit_held(7)
    assert not single._exit_held(7)


def test_a_held_failure_is_never_reported_once_the_restore_ends_the_share(tmp_path, publisher) -> None:
    # Given node 0 whose share failed (a node went) and whose failure waits, unreported
    agent = make_agent(make_config(tmp_path, nodes=NODES, launch_key=KEY, generation=1), publisher)
    with agent.state.locked() as state:
        state.job_status, state.exit_code, state.generation = "exited", 255, 1

    # When the job's restore at generation 2 comes (node 1's backup now answers, so nothing holds the failure)
    assert not agent.end_share_for_restore(2)

    # Then the failure is the replaced share's, never reported as the restored job's end
    with nodeport.NodePort(NODES[1], nodeport.PORT, nodeport.Gate(bytes.fromhex(KEY)), {}):
        assert agent.watch_job() is None
    assert not publisher.of("JobExited")
    assert agent.state.read().job_status == "replaced"
