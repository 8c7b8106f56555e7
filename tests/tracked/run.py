"""The tracked path in the Debian-kernel VM, from this machine: boot it, run guest_run.py, read what it saw.

`python -m tests.tracked.run [MEGABYTES]` also writes the figures to bench/results/tracked-vm-<MEGABYTES>mib.json
and .md: how long the job was frozen and how many page bytes CRIU wrote, for a full dump against a tracked periodic
checkpoint and an incremental final dump, measured inside the VM (software emulation: compare ratios, not absolutes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import vm

ROOT = Path(__file__).parents[2]
JOB = Path(__file__).with_name("jobs") / "dirty.py"
MEGABYTES = 32  # small: the guest runs about 12x slower than this machine
STEPS = 12
HOT_PERCENT = 5  # must match guest_run.HOT_PERCENT
RESULTS = ROOT / "bench" / "results"
MiB = 1 << 20


def run_in_vm(
    share: Path, megabytes: int = MEGABYTES, steps: int = STEPS, memory_mb: int = 1536
) -> tuple[dict[str, Any], vm.VMResult]:
    """Run guest_run.py in the VM; its JSON document and the VM's run."""
    python = ROOT / ".venv" / "bin" / "python"
    path = f"{ROOT}:{ROOT / 'functions'}:{ROOT / 'vm-bootstrap'}"
    out = f"{vm.GUEST_SHARE}/result.json"
    command = f"PYTHONPATH={path} exec {python} -m tests.tracked.guest_run {out} {megabytes} {steps}"
    (share / "result.json").unlink(missing_ok=True)
    result = vm.run(command, share, cwd=ROOT, memory_mb=memory_mb, timeout=780)
    found = share / "result.json"
    document = json.loads(found.read_text()) if found.exists() else {"error": "the guest wrote no result"}
    return document, result


def reference(workdir: Path, megabytes: int = MEGABYTES, steps: int = STEPS) -> dict[str, str]:
    """An uninterrupted run of the same job on this machine (its output does not depend on the kernel)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "allow").write_text(str(steps))
    command = [sys.executable, str(JOB), str(megabytes), str(steps), str(HOT_PERCENT)]
    run = subprocess.run(command, cwd=workdir, capture_output=True, text=True, check=True)
    return {"progress": (workdir / "progress.log").read_text(), "stdout": run.stdout}


def figures(document: dict[str, Any]) -> dict[str, Any]:
    """Frozen seconds and page bytes per checkpoint, and their ratios to the full dump's."""
    rows = []
    full = document["checkpoints"][0]
    full_pages = full["page_bytes"]["images"]
    for checkpoint in document["checkpoints"]:
        pages = checkpoint["page_bytes"]
        # What this checkpoint's own CRIU runs wrote: its dump, and for a tracked periodic one its pre-dump too.
        written = pages["images"] + (pages.get("images/parent", 0) if checkpoint["kind"] == "periodic" else 0)
        if checkpoint is full:
            written = full_pages
        rows.append(
            {
                "step": checkpoint["step"],
                "frozen_seconds": checkpoint["frozen_seconds"],
                "frozen_vs_full": round(checkpoint["frozen_seconds"] / full["frozen_seconds"], 3),
                "page_bytes_written": written,
                "final_dump_page_bytes": pages["images"],
                "final_dump_pages_vs_full": round(pages["images"] / full_pages, 3),
                "seconds_to_durable": checkpoint["seconds"],
                "bytes_uploaded": checkpoint["bytes_uploaded"],
                "memory_tracking": checkpoint["memory_tracking"],
            }
        )
    return {"rows": rows, "restore_seconds": document["restore"]["seconds"]}


def markdown(document: dict[str, Any], found: dict[str, Any], machine: dict[str, Any]) -> str:
    lines = [
        "| checkpoint | job frozen | vs full | pages CRIU wrote at the freeze | vs full | durable after | sent |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in found["rows"]:
        lines.append(
            f"| {row['step']} | {row['frozen_seconds']:.2f} s | {row['frozen_vs_full']:.2f}x "
            f"| {row['final_dump_page_bytes'] / MiB:.1f} MiB | {row['final_dump_pages_vs_full']:.2f}x "
            f"| {row['seconds_to_durable']:.1f} s | {row['bytes_uploaded'] / MiB:.1f} MiB |"
        )
    return "\n".join(
        [
            *lines,
            "",
            f"A {document['megabytes']} MiB job rewriting {document['hot_percent']}% of its memory per step, two steps "
            "between checkpoints, checkpointed by the agent into a directory store in a VM running Debian 12's "
            f"kernel {document['kernel']} (CONFIG_MEM_SOFT_DIRTY=y) under QEMU software emulation, about 12x slower "
            "than native and slower still on a shared machine: compare ratios, not absolutes. A tracked periodic "
            "checkpoint's freeze is its pre-dump's plus its dump's (CRIU's own figures); its pages are written "
            "mostly by the pre-dump after the job thaws (the 'pages' column is the dump's, at the freeze). A final "
            "dump stops the job: its freeze runs until CRIU exits. The final dump, restored after the VM was lost, "
            f"gave the uninterrupted run's output (restore {found['restore_seconds']:.1f} s).",
            f"Measured {machine['at']} on {machine['cpus']} cores ({machine['host_kernel']}), guest: 2 vCPUs, "
            f"{machine['guest_memory_mb']} MiB, `python -m tests.tracked.run {document['megabytes']}`.",
            "",
        ]
    )


def main(megabytes: int) -> int:
    # The guest holds the job, its chain of image directories and the store in its RAM: room for all three.
    memory_mb = max(1536, 1024 + megabytes * 6)
    with tempfile.TemporaryDirectory() as tmp:
        document, run = run_in_vm(Path(tmp) / "share", megabytes, memory_mb=memory_mb)
        if "error" in document:
            print(document.get("traceback") or document["error"], run.output[-4000:], run.serial[-2000:], sep="\n")
            return 1
        expected = reference(Path(tmp) / "reference", megabytes)
    if document["restored"] != expected:
        print("the restored job's output differs from an uninterrupted run's")
        return 1
    machine = {
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "host_kernel": os.uname().release,
        "guest_kernel": document["kernel"],
        "vm_seconds": round(run.seconds, 1),
        "guest_memory_mb": memory_mb,
    }
    found = figures(document)
    record = {"benchmark": "tracked-vm", "machine": machine, "megabytes": document["megabytes"], **found}
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = f"tracked-vm-{document['megabytes']}mib"
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    text = markdown(document, found, machine)
    (RESULTS / f"{name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else MEGABYTES))
