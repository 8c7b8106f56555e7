"""`python -m rehearsal`: a spot interruption and its recovery, on this machine, through the shipped code.

The job is the sample job, or your own: `--command '<command>' --result <file>` runs the command (split
and checked exactly as the spotcr:command tag) and compares <file>, relative to the job's work dir,
byte for byte with an uninterrupted run of the same command on a bare VM.
Exit code 0 when the interrupted job's result equals the uninterrupted run's, 1 when it differs,
2 when the rehearsal itself could not complete (the message says what broke and why).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from pathlib import Path

from spotcr_contracts.tags import STORAGES

from rehearsal.scenario import RESULT_FILE, RUNS_DIR, Options, Rehearsal, RehearsalFailed


def parse(argv: list[str]) -> Options:
    parser = argparse.ArgumentParser(prog="python -m rehearsal", description=__doc__.splitlines()[0])
    parser.add_argument("--storage", choices=STORAGES, default="s3", help="where checkpoints go (default s3)")
    parser.add_argument(
        "--command",
        metavar="COMMAND",
        help="your own job, as you would tag it spotcr:command (argv, no shell); needs --result",
    )
    parser.add_argument(
        "--result",
        metavar="FILE",
        help="with --command: the file, relative to the job's work dir, compared with an uninterrupted run's",
    )
    parser.add_argument("--size-mb", type=int, help="sample job: its memory state in MiB (default 256)")
    parser.add_argument("--steps", type=int, help="sample job: its length in steps (default 3000)")
    parser.add_argument("--pace", type=float, help="sample job: seconds it sleeps per step (default 0.02)")
    parser.add_argument("--interruptions", type=int, default=1, help="successive interruptions (default 1)")
    parser.add_argument(
        "--checkpoints-before",
        type=int,
        default=1,
        help="periodic checkpoints of the job's VM before each interruption (default 1: the first, a full dump "
        "that cannot tell how fast the job changes its memory)",
    )
    parser.add_argument("--interval", type=int, default=10, help="spotcr:interval, seconds between periodic dumps")
    parser.add_argument("--notice", type=float, default=120.0, help="seconds from warning to termination (AWS: 120)")
    parser.add_argument("--quick", action="store_true", help="a 15 s notice instead of 120 s")
    parser.add_argument("--schedule-every", type=float, default=5.0, help="seconds standing in for the 1-min schedule")
    parser.add_argument(
        "--rebalance",
        type=float,
        default=0.0,
        metavar="S",
        help="send a rebalance recommendation S s before each warning",
    )
    parser.add_argument(
        "--missed-warning",
        action="store_true",
        help="lose each interruption's notice: no final dump, the backup restores the newest periodic checkpoint",
    )
    parser.add_argument(
        "--upgrade-at",
        type=float,
        metavar="S",
        help="upgrade the stack S s after the submission (a new agent asset and launch template version), before the "
        "first interruption: its backup must boot the new version",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="a job over N VMs (an MPI command: mpiexec -n ... just works; --storage efs or fsx); interruption i hits "
        "node i mod N, node 1 first; its result is compared with the same command run on one VM",
    )
    parser.add_argument(
        "--wave",
        type=int,
        default=1,
        help="with --nodes: each interruption hits this many nodes at once (a capacity wave), from node i mod N on",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds each phase may take (default 300)")
    parser.add_argument("--keep-vms", action="store_true", help="keep each VM's files under the run directory")
    parser.add_argument("--runs-dir", type=Path, default=RUNS_DIR, help="where each run's files go (rehearsal-runs/)")
    args = parser.parse_args(argv)
    sample = {"--size-mb": args.size_mb, "--steps": args.steps, "--pace": args.pace}
    if args.command is not None:
        if not args.result:
            parser.error("--command needs --result FILE: the file to compare with an uninterrupted run's")
        given = [name for name, value in sample.items() if value is not None]
        if given:
            parser.error(f"{', '.join(given)}: only for the sample job, not with --command")
    elif args.result is not None:
        parser.error("--result goes with --command (the sample job's result is result.txt)")
    if not 1 <= args.wave <= args.nodes:
        parser.error(f"--wave {args.wave}: from 1 to --nodes ({args.nodes})")
    if args.checkpoints_before < 1:
        parser.error(f"--checkpoints-before {args.checkpoints_before}: 1 or more (an interruption needs a checkpoint)")
    if args.upgrade_at is not None and args.upgrade_at < 0:
        parser.error(f"--upgrade-at {args.upgrade_at:g}: seconds after the submission, 0 or more")
    return Options(
        storage=args.storage,
        size_mb=256 if args.size_mb is None else args.size_mb,
        steps=3000 if args.steps is None else args.steps,
        pace_s=0.02 if args.pace is None else args.pace,
        command=args.command,
        result_file=args.result or RESULT_FILE,
        interruptions=args.interruptions,
        checkpoints_before_interruption=args.checkpoints_before,
        notice_s=15.0 if args.quick else args.notice,
        interval_s=args.interval,
        schedule_every_s=args.schedule_every,
        keep_vms=args.keep_vms,
        runs_dir=args.runs_dir,
        rebalance_lead_s=args.rebalance,
        timeout_s=args.timeout,
        missed_warning=args.missed_warning,
        upgrade_at_s=args.upgrade_at,
        nodes=args.nodes,
        wave=args.wave,
    )


def main(argv: list[str]) -> int:
    options = parse(argv)
    if os.geteuid() != 0:
        print("the rehearsal needs root: local VMs are Linux namespaces and CRIU needs CAP_SYS_ADMIN", file=sys.stderr)
        return 2
    if shutil.which("criu") is None:
        print("criu is not installed: run `make criu` (or `make setup`)", file=sys.stderr)
        return 2
    # SIGTERM ends the run through its clean-up (VMs killed, loop devices detached), as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        terminal = sys.stdout  # the local cloud sends the functions' own output to the run's functions.log
        outcome = Rehearsal(options, echo=lambda line: print(line, file=terminal, flush=True)).run()
    except RehearsalFailed as error:
        print(f"rehearsal failed: {error}", file=sys.stderr)
        return 2
    recoveries = ", ".join(f"{s:.1f} s" for s in outcome.recoveries_s)
    print(f"warning to running again: {recoveries}")
    if outcome.all_pages_s != outcome.recoveries_s:
        print(f"warning to its last page in (restored lazily): {', '.join(f'{s:.1f} s' for s in outcome.all_pages_s)}")
    if outcome.identical:
        print(f"OK: the interrupted job's {options.result_file} equals the uninterrupted run's, byte for byte")
        return 0
    print(
        f"MISMATCH: the interrupted job's {options.result_file} ({outcome.describe(outcome.result)}) differs from "
        f"the uninterrupted run's ({outcome.describe(outcome.expected)}); both are in {outcome.run_dir} "
        "(result, result.reference)",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
