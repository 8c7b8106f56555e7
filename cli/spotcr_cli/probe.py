"""`spotcr probe`: measure each storage's write and read rates and the agent's checkpoint pipeline.

Locally (--dir STORAGE=PATH, --s3 BUCKET) it runs the agent's own probe code (spotcr_agent.probe) here; on a
job VM (--instance i-...) it sends the stack's probe document, which runs the same code there through
`spotcr-agent probe`. With --bucket, each result is kept at s3://BUCKET/probes/<instance-type>/<storage>.json,
where `spotcr plan --bucket BUCKET --instance-type TYPE` finds it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from spotcr_contracts.commands import PROBE

from .plan import probe_key

DEFAULT_DOCUMENT = f"spotcr-{PROBE.name}"  # the stack's name (default spotcr) and the command's
POLL_S = 2.0


class ProbeCommandError(Exception):
    """The probe could not run or its result could not be read; the message says why."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "probe",
        help="measure storage write/read rates and the checkpoint pipeline, locally or on a job VM",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = parser.add_argument_group("where")
    where.add_argument(
        "--dir",
        action="append",
        default=[],
        metavar="STORAGE=PATH",
        help="a mounted storage to probe here (ebs, efs, fsx, or local for the scratch dir); repeatable",
    )
    where.add_argument("--s3", default="", metavar="BUCKET", help="probe S3 from here, in this bucket")
    where.add_argument("--instance", default="", metavar="ID", help="probe on this job VM through SSM")
    where.add_argument("--document", default=DEFAULT_DOCUMENT, help="the stack's probe document (%(default)s)")
    where.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for a VM's probe")
    sizes = parser.add_argument_group("sizes (small by default; larger for real figures)")
    sizes.add_argument("--streams", default="1,4", help="parallel streams per configuration (%(default)s)")
    sizes.add_argument("--block-kib", default="64,1024", help="block sizes, KiB (%(default)s)")
    sizes.add_argument("--size-mib", type=int, default=8, help="MiB each stream writes per configuration")
    sizes.add_argument("--pipeline-mib", type=int, default=16, help="MiB through the store's pipeline; 0 skips")
    keep = parser.add_argument_group("results")
    keep.add_argument("--instance-type", default="", help="label of local results (default: local)")
    keep.add_argument("--bucket", default="", help="keep results in s3://BUCKET/probes/<instance-type>/<storage>.json")
    keep.add_argument("--out", default="", metavar="DIR", help="also write each result to DIR/<storage>.json")
    keep.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, ssm: Any = None, s3: Any = None) -> int:
    try:
        results = probe(args, ssm)
        saved = keep(results, args.bucket, Path(args.out) if args.out else None, s3)
    except ProbeCommandError as error:
        print(f"spotcr probe: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"results": results, "saved": saved}, indent=2))
    else:
        print(table(results))
        for where in saved:
            print(f"kept {where}")
    return 0


def probe(args: argparse.Namespace, ssm: Any = None) -> list[dict[str, Any]]:
    if args.instance and (args.dir or args.s3):
        raise ProbeCommandError("probe either here (--dir, --s3) or on a VM (--instance), not both")
    if args.instance:
        return remote(args, ssm)
    if not args.dir and not args.s3:
        raise ProbeCommandError("say what to probe: --dir STORAGE=PATH, --s3 BUCKET, or --instance i-...")
    return local(args)


def local(args: argparse.Namespace) -> list[dict[str, Any]]:
    from spotcr_agent import probe as agent_probe
    from spotcr_agent.store import StoreError

    try:
        settings = agent_probe.ProbeSettings(
            streams=agent_probe.parse_list("--streams", args.streams),
            block_kib=agent_probe.parse_list("--block-kib", args.block_kib),
            size_mib=args.size_mib,
            pipeline_mib=args.pipeline_mib,
        )
        targets = [agent_probe.parse_target(d if "=" in d else f"local={d}") for d in args.dir]
        if any(t.storage == "s3" for t in targets):
            raise agent_probe.ProbeError("S3 is probed with --s3 BUCKET, not --dir")
        if args.s3:
            targets.append(agent_probe.ProbeTarget("s3", bucket=args.s3))
        results = agent_probe.probe(
            targets, settings, instance_type=args.instance_type or "local", scratch=Path(tempfile.gettempdir())
        )
    except agent_probe.ProbeError as error:
        raise ProbeCommandError(str(error)) from error
    except StoreError as error:
        raise ProbeCommandError(f"the store failed during the probe: {error}") from error
    return [r.to_json() for r in results]


def remote(
    args: argparse.Namespace, ssm: Any = None, sleep: Callable[[float], None] = time.sleep
) -> list[dict[str, Any]]:
    """Send the probe document to the VM, wait for it, and read the agent's JSON line from its output."""
    values = {"Streams": args.streams, "BlockKiB": args.block_kib, "SizeMiB": str(args.size_mib),
              "PipelineMiB": str(args.pipeline_mib)}  # fmt: skip
    try:
        PROBE.agent_argv(values)  # the document's own patterns, checked before anything is sent
    except ValueError as error:
        raise ProbeCommandError(str(error)) from error
    if ssm is None:
        import boto3

        ssm = boto3.client("ssm")
    from botocore.exceptions import ClientError

    try:
        sent = ssm.send_command(
            InstanceIds=[args.instance],
            DocumentName=args.document,
            Parameters={k: [v] for k, v in values.items()},
            Comment="spotcr probe",
        )
        command_id = sent["Command"]["CommandId"]
        deadline = time.monotonic() + args.timeout
        while True:
            try:
                invocation = ssm.get_command_invocation(CommandId=command_id, InstanceId=args.instance)
            except ClientError as error:
                if error.response.get("Error", {}).get("Code") != "InvocationDoesNotExist":
                    raise
                invocation = {"Status": "Pending"}
            if invocation["Status"] not in ("Pending", "InProgress", "Delayed"):
                break
            if time.monotonic() > deadline:
                raise ProbeCommandError(f"the probe on {args.instance} did not end within {args.timeout:.0f} s")
            sleep(POLL_S)
    except ClientError as error:
        raise ProbeCommandError(f"SSM refused the probe on {args.instance}: {error}") from error
    output = invocation.get("StandardOutputContent", "")
    answer = _last_json_line(output)
    if invocation["Status"] != "Success" or not answer.get("ok"):
        reason = answer.get("error") or invocation.get("StandardErrorContent", "").strip()[-500:] or "no output"
        raise ProbeCommandError(f"the probe on {args.instance} ended {invocation['Status']}: {reason}")
    return list(answer["results"])


def _last_json_line(output: str) -> dict[str, Any]:
    for line in reversed(output.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}


def keep(results: Sequence[Mapping[str, Any]], bucket: str, out: Path | None, s3: Any = None) -> list[str]:
    saved = []
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for result in results:
            path = out / f"{result['storage']}.json"
            path.write_text(json.dumps(result, indent=2) + "\n")
            saved.append(str(path))
    if bucket:
        if s3 is None:
            import boto3

            s3 = boto3.client("s3")
        from botocore.exceptions import ClientError

        for result in results:
            key = probe_key(result["instance_type"], result["storage"])
            try:
                s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(result).encode(), ContentType="application/json")
            except ClientError as error:
                raise ProbeCommandError(f"cannot keep the result at s3://{bucket}/{key}: {error}") from error
            saved.append(f"s3://{bucket}/{key}")
    return saved


def table(results: Sequence[Mapping[str, Any]]) -> str:
    lines = []
    for result in results:
        pipeline = result.get("pipeline")
        lines.append(
            f"{result['storage']} at {result['location']} on {result['instance_type']}: best write "
            f"{result['write_mib_s']:.1f} MiB/s, read {result['read_mib_s']:.1f} MiB/s"
            + (
                f"; pipeline commit {pipeline['commit_mib_s']:.1f} MiB/s, fetch {pipeline['fetch_mib_s']:.1f} MiB/s"
                if pipeline
                else ""
            )
        )
        lines.append(f"  {'streams':>7}  {'block':>8}  {'write MiB/s':>11}  {'read MiB/s':>10}  verified")
        for r in result["runs"]:
            lines.append(
                f"  {r['streams']:>7}  {r['block_bytes'] // 1024:>5} KiB  {r['write_mib_s']:>11.1f}  "
                f"{r['read_mib_s']:>10.1f}  {'yes' if r['verified'] else 'NO'}"
            )
    return "\n".join(lines)
