"""How the agent names what a job holds in a mount namespace of its own, and which mounts it refuses to carry."""

from spotcr_agent import mounts

VM = """\
20 1 254:0 / / rw - ext4 /dev/vda rw
30 20 0:40 / /var/lib/spotcr rw - tmpfs vm-state rw
31 20 254:0 /srv/storage /mnt/spotcr rw - ext4 /dev/vda rw
"""
# The job's own namespace made with `unshare --mount`: a bind of its work dir's data over view, and a disk.
NESTED = """\
50 49 254:0 / / rw - ext4 /dev/vda rw
51 50 0:40 / /var/lib/spotcr rw - tmpfs vm-state rw
52 51 0:40 /work/job-1/data /var/lib/spotcr/work/job-1/view rw - tmpfs vm-state rw
53 50 0:99 / /proc rw - proc proc rw
54 50 7:0 / /data rw - ext4 /dev/loop0 rw
"""


def test_a_file_written_through_a_bind_mount_is_named_by_the_vms_path_of_it():
    # Given the job's nested namespace and the VM's mounts
    nested, vm = mounts.mounts(NESTED), mounts.mounts(VM)

    # When a path it holds is looked up on the VM, then it is the file behind the bind mount
    view = mounts._containing("/var/lib/spotcr/work/job-1/view/result.txt", nested)
    assert view is not None
    assert mounts._vm_view(view, "result.txt", vm) == "/var/lib/spotcr/work/job-1/data/result.txt"
    # and a path on a mount the VM has at the same place keeps its name
    state = mounts._containing("/var/lib/spotcr/work/job-1/progress.log", nested)
    assert state is not None
    assert mounts._vm_view(state, "work/job-1/progress.log", vm) == "/var/lib/spotcr/work/job-1/progress.log"


def test_a_disk_the_job_mounted_itself_is_not_a_view_of_the_vm_and_proc_is_carried():
    nested, vm = mounts.mounts(NESTED), mounts.mounts(VM)
    disk = next(m for m in nested if m.point == "/data")
    proc = next(m for m in nested if m.point == "/proc")
    assert mounts._vm_view(disk, "", vm) is None
    assert proc.fstype in mounts.CARRIED_FSTYPES


def test_mount_points_are_read_with_every_octal_escape_the_kernel_writes():
    # Given a mount point with a space, a tab, a newline and a backslash, as /proc/<pid>/mountinfo writes it
    line = r"36 35 98:0 / /mnt/a\040b\011c\012d\134e rw,noatime master:1 - ext4 /dev/root rw"
    # Then every one of them reads back (the rehearsal's VMs read their mount tables with the same function)
    assert mounts.mount_points(line) == [("/mnt/a b\tc\nd\\e", "ext4")]
    assert mounts.unescape(r"/srv/not\12an\x escape") == r"/srv/not\12an\x escape"
