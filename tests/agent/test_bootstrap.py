"""`spotcr-agent bootstrap`: job from IMDS tags, spec from S3, storage prepared, failures named by step."""

import json
import subprocess
from pathlib import Path

import pytest
from spotcr_agent import storage, store_credentials
from spotcr_agent.bootstrap import BootstrapError, bootstrap, build_config, fetch_nodes
from spotcr_agent.config import load
from spotcr_agent.runner import InvalidJobSpec, parse_job_spec

from .conftest import FakePublisher, bootstrap_args, imds_with_tags, make_config


def _bootstrap(tmp_path, tags, spec=b"", metadata=None, sleep=lambda seconds: None, **args):
    results: list = []
    publisher = FakePublisher()
    environ = {"SPOTCR_AGENT_CONFIG": str(tmp_path / "etc" / "agent.json"), "SPOTCR_STATE_DIR": str(tmp_path)}
    code = bootstrap(
        bootstrap_args(**args),
        environ,
        results.append,
        metadata=metadata or imds_with_tags(tags),
        publisher=publisher,
        spec_reader=lambda uri: spec,
        ping_status=lambda instance_id: "Online",
        scratch_warning=lambda scratch_dir: None,
        sleep=sleep,
    )
    return code, results[0], publisher, environ


def test_bootstrap_writes_the_agent_config_from_tags(tmp_path):
    tags = {"spotcr:job": "nightly-sim", "spotcr:command": "python3 sim.py --steps 100", "Name": "x"}
    code, result, publisher, environ = _bootstrap(tmp_path, tags)
    assert code == 0, result
    config = load(environ)
    assert (config.job_id, config.instance_id, config.region) == ("nightly-sim", "i-0abc", "eu-west-1")
    assert config.command == ("python3", "sim.py", "--steps", "100")
    assert (config.storage, config.bucket, config.event_bus, config.mode) == (
        "s3",
        "spotcr-checkpoints",
        "spotcr",
        "run",
    )
    assert config.workdir == Path("/var/lib/spotcr/work/nightly-sim")
    assert config.tcp == "established"
    assert publisher.events == []


def test_the_job_s_tcp_policy_reaches_the_agent_config(tmp_path):
    tags = {"spotcr:job": "redis-load", "spotcr:command": "run.sh", "spotcr:tcp": "close"}
    code, result, _, environ = _bootstrap(tmp_path, tags)
    assert code == 0, result
    assert load(environ).tcp == "close"


def test_bootstrap_reads_the_job_spec_from_s3(tmp_path):
    tags = {"spotcr:job": "j", "spotcr:spec": "s3://specs-bucket/jobs/j.json", "spotcr:mode": "restore"}
    spec = json.dumps({"command": ["/opt/app/run", "a b"], "workdir": "/data/j", "env": {"OMP_NUM_THREADS": "4"}})
    code, result, _, environ = _bootstrap(tmp_path, tags, spec.encode())
    assert code == 0, result
    config = load(environ)
    assert config.command == ("/opt/app/run", "a b")
    assert config.workdir == Path("/data/j")
    assert config.env == {"OMP_NUM_THREADS": "4"}
    assert config.mode == "restore"


@pytest.mark.parametrize(
    ("tags", "spec", "step", "message"),
    [
        ({"spotcr:job": "j", "spotcr:storage": "gcs", "spotcr:command": "x"}, b"", "tags", "unknown storage 'gcs'"),
        ({"spotcr:job": "j", "spotcr:command": "run; rm -rf /"}, b"", "tags", "shell syntax"),
        ({"spotcr:job": "j", "spotcr:spec": "s3://specs-bucket/j.json"}, b"{not json", "spec", "not JSON"),
    ],
)
def test_bootstrap_failures_name_the_step_and_are_published(tmp_path, tags, spec, step, message):
    code, result, publisher, _ = _bootstrap(tmp_path, tags, spec)
    assert code == 2
    assert result["step"] == step and message in result["error"]
    [event] = publisher.events
    assert event.DETAIL_TYPE == "BootstrapFailed" and event.step == step and message in event.reason
    assert event.instance_id == "i-0abc"


def test_a_backup_with_ebs_storage_boots_before_its_volume_is_handed_over(tmp_path):
    # Given a backup VM in restore mode whose EBS volume has not been attached yet
    tags = {"spotcr:job": "j", "spotcr:storage": "ebs", "spotcr:command": "x", "spotcr:mode": "restore"}
    # When it bootstraps, then it is ready at once: recovery moves the volume after AgentReady
    code, result, publisher, environ = _bootstrap(tmp_path, tags, ebs_volume_id="vol-0123456789abcdef0")
    assert code == 0, result
    assert (load(environ).storage, load(environ).mode) == ("ebs", "restore")
    assert publisher.events == []


def test_bootstrap_storage_failure_names_the_step(tmp_path):
    tags = {"spotcr:job": "j", "spotcr:storage": "efs", "spotcr:command": "x"}
    code, result, publisher, _ = _bootstrap(tmp_path, tags, bucket="", efs_id="")
    assert code == 1
    assert result["step"] == "storage"
    assert "storage efs: no file system id configured" in result["error"]
    assert publisher.events[0].step == "storage"


def test_a_bootstrap_failure_carries_the_run_the_control_plane_tags_meanwhile(tmp_path):
    # Given a primary whose storage fails before the control plane has tagged it with its run
    tags = {"spotcr:job": "j", "spotcr:storage": "efs", "spotcr:command": "x"}
    metadata = imds_with_tags(tags)
    slept = []

    def register(seconds):
        slept.append(seconds)
        metadata.values["meta-data/tags/instance"] += "\nspotcr:run"
        metadata.values["meta-data/tags/instance/spotcr:run"] = "r-0123456789abcdef"

    # When its bootstrap fails
    code, result, publisher, _ = _bootstrap(tmp_path, tags, metadata=metadata, sleep=register, bucket="", efs_id="")
    # Then the failure waited for the run's tag and carries it: the control plane acts on this run's failure only
    assert (code, result["step"]) == (1, "storage")
    [event] = publisher.events
    assert (event.DETAIL_TYPE, event.run_id, len(slept)) == ("BootstrapFailed", "r-0123456789abcdef", 1)


def test_a_bootstrap_failure_on_an_instance_never_registered_carries_no_run(tmp_path):
    # Given an instance the control plane refused (spotcr:error), whose storage fails
    tags = {"spotcr:job": "j", "spotcr:storage": "efs", "spotcr:command": "x", "spotcr:error": "already runs"}
    code, _, publisher, _ = _bootstrap(tmp_path, tags, sleep=pytest.fail, bucket="", efs_id="")
    # Then it reports at once, with no run: telemetry only
    assert code == 1 and publisher.events[0].run_id == ""


def test_an_ebs_volume_that_never_appears_is_named(tmp_path):
    config = make_config(tmp_path, storage="ebs", mount_point=tmp_path / "mnt", ebs_volume_id="vol-0123")
    with pytest.raises(storage.StorageError, match="storage ebs: volume vol-0123 did not appear under"):
        storage.prepare(config, devices_dir=tmp_path, device_wait_s=0)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ('{"command": "python3 x.py"}', "command: must be a non-empty list"),
        ('{"command": []}', "command: must be a non-empty list"),
        ('{"command": ["x"], "workdir": "relative"}', "workdir: must be an absolute path"),
        ('{"command": ["x"], "workdir": "/a/../etc"}', "workdir: must be an absolute path"),
        ('{"command": ["x"], "env": {"A=B": "1"}}', "env: 'A=B'"),
        ('{"command": ["x"], "user": "root"}', "unknown fields: user"),
        ("[1]", "must be a JSON object"),
        ('{"command": ["x"], "result": "model.bin"}', "result: must be a list"),
        ('{"command": ["x"], "result": ["../model.bin"]}', "result: '../model.bin' must be a path relative"),
        (json.dumps({"command": ["x"], "result": [f"out/{i}.bin" for i in range(17)]}), "result: at most 16 files"),
    ],
)
def test_job_specs_are_validated_strictly(spec, message):
    with pytest.raises(InvalidJobSpec, match=message):
        parse_job_spec(spec)


def test_a_job_spec_declares_the_files_its_result_must_hold():
    definition = parse_job_spec('{"command": ["x"], "result": ["model.bin", "out/log.txt"]}')
    assert definition.result_files == ("model.bin", "out/log.txt")


@pytest.fixture
def loop_volume(tmp_path):
    """A real block device standing in for an attached EBS volume, linked as Nitro names it."""
    image = tmp_path / "volume.img"
    image.write_bytes(b"")
    subprocess.run(["truncate", "-s", "64M", str(image)], check=True)
    device = subprocess.run(["losetup", "-f", "--show", str(image)], check=True, capture_output=True, text=True)
    device_path = device.stdout.strip()
    by_id = tmp_path / "by-id"
    by_id.mkdir()
    (by_id / "nvme-Amazon_Elastic_Block_Store_vol0123456789abcdef0").symlink_to(device_path)
    yield by_id
    subprocess.run(["umount", str(tmp_path / "mnt")], check=False, capture_output=True)
    subprocess.run(["losetup", "-d", device_path], check=True)


def test_ebs_storage_is_formatted_on_first_use_mounted_and_released(tmp_path, loop_volume):
    # Given an attached volume with no file system
    config = make_config(tmp_path, storage="ebs", mount_point=tmp_path / "mnt", ebs_volume_id="vol-0123456789abcdef0")
    # When the storage is prepared, then it is formatted and mounted, and the store can use it
    storage.prepare(config, devices_dir=loop_volume)
    assert storage.is_mount(config.mount_point)
    (config.mount_point / "marker").write_text("kept")
    storage.open_store(config)
    # When it is released, then it is unmounted; prepared again, it is mounted, not formatted again
    assert storage.release(config) == f"unmounted {config.mount_point}"
    assert not storage.is_mount(config.mount_point)
    storage.prepare(config, devices_dir=loop_volume)
    assert (config.mount_point / "marker").read_text() == "kept"


def test_an_unwritable_store_is_refused(tmp_path):
    mount_point = tmp_path / "ro"
    mount_point.mkdir()
    subprocess.run(["mount", "--bind", str(mount_point), str(mount_point)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(mount_point)], check=True)
        config = make_config(tmp_path, storage="efs", mount_point=mount_point, efs_id="fs-0123")
        with pytest.raises(storage.StorageError, match=f"storage efs: {mount_point} is not writable"):
            storage.prepare(config)
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


NODE_TAGS = {
    "spotcr:job": "mpi-7",
    "spotcr:command": "mpiexec -n 6 ./solver",
    "spotcr:storage": "fsx",
    "spotcr:nodes": "3",
    "spotcr:node": "1",
}
URL = "https://abc.lambda-url.eu-west-1.on.aws/"


def _answer_with_nodes(**changes):
    """The store-credentials answer to node 1 of a job over three VMs, read as the agent reads it."""
    body = {
        "AccessKeyId": "AKIA",
        "SecretAccessKey": "secret",
        "SessionToken": "token",
        "Expiration": "2026-11-27T18:00:00Z",
        "Job": "mpi-7",
        "Nodes": ["10.0.0.10", "10.0.0.11", "10.0.0.12"],
        "Node": 1,
        "LaunchKey": "ab" * 32,
        **changes,
    }
    asked = []

    def reader(url, job_id, region):
        asked.append((url, job_id, region))
        fetch = store_credentials.fetcher(url, job_id, region, get=lambda target: (200, json.dumps(body).encode()))
        return fetch()

    return reader, asked


def test_a_node_of_a_job_over_several_vms_learns_its_nodes_from_the_store_credentials_answer(tmp_path):
    reader, asked = _answer_with_nodes()
    config = build_config(imds_with_tags(NODE_TAGS), bootstrap_args(store_credentials_url=URL), {}, nodes_reader=reader)
    assert asked == [(URL, "mpi-7", "eu-west-1")]
    assert (config.nodes, config.node_index, config.launch_key) == (
        ("10.0.0.10", "10.0.0.11", "10.0.0.12"),
        1,
        "ab" * 32,
    )


@pytest.mark.parametrize(
    ("changes", "args", "message"),
    [
        ({"Node": 2}, {"store_credentials_url": URL}, "lists this instance as node 2 of 3, its tags say node 1 of 3"),
        ({"Nodes": ["10.0.0.10", "10.0.0.11"]}, {"store_credentials_url": URL}, "node 1 of 2, its tags say node 1"),
        ({}, {}, "needs the store-credentials URL"),
    ],
)
def test_a_node_whose_nodes_cannot_be_learned_fails_its_bootstrap_at_the_nodes_step(tmp_path, changes, args, message):
    reader, _ = _answer_with_nodes(**changes)
    if not args:
        reader = fetch_nodes
    with pytest.raises(BootstrapError) as raised:
        build_config(imds_with_tags(NODE_TAGS), bootstrap_args(**args), {}, nodes_reader=reader)
    assert raised.value.step == "nodes" and message in str(raised.value)
