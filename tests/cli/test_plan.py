"""`spotcr plan`: the research's long-running model against hand computations, and the job planner."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

_CLI = str(Path(__file__).resolve().parents[2] / "cli")
if _CLI not in sys.path:  # harmless where pyproject's pythonpath already holds cli/
    sys.path.insert(0, _CLI)

from spotcr_cli import model, plan  # noqa: E402


def spotcr(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="spotcr")
    plan.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def run_json(capsys, argv: list[str]) -> dict:
    args = spotcr(["plan", *argv, "--json"])
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


def research_argv(work, interval, dump, stored, vm, price) -> list[str]:
    return [
        "--work-hours", str(work), "--interval-hours", str(interval), "--dump-seconds", str(dump),
        "--stored-gb", str(stored), "--vm-price-hour", str(vm), "--storage-price-gb-month", str(price),
    ]  # fmt: skip


# The research's published figures (/work/shared/REFERENCE.md, "Measured in the original" and "Prices used by the
# original"): the 7,751.68 MB task's checkpoint took 215.68 s on S3 (s3fs-fuse), 55.81 s on EBS and 78.72 s on EFS;
# storage cost $0.023 (S3), $0.10 (EBS) and $0.30 (EFS) per GB-month. The VM, a c3.2xlarge, at $0.42 per hour:
# AWS's on-demand Linux price in us-east-1 (REFERENCE.md gives no VM price; any P enters the same way).
TASK_GB = 7.75168  # 7,751.68 MB


# The research's long-running model, row by row: W hours of work checkpointed every H hours, one checkpoint at the end
# of every interval, ceil(W / H) of them, the last (shorter) interval included. Each row is computed by hand from the
# research's published dump times and prices above (REFERENCE.md holds those, not the research's own cost table):
#   hours = W + checkpoints * S / 3600;  cost = hours * 0.42 + 7.75168 GB * X.
# E.g. S3, 24 h every hour: 24 * 215.68 s = 5176.32 s = 1.437867 h; 25.437867 * 0.42 + 0.178289 = 10.862193.
RESEARCH_TABLE = [
    # storage, S (s), X ($/GB-month), W (h), H (h), checkpoints, total hours, total cost ($)
    ("s3", 215.68, 0.023, 24, 1, 24, 25.437867, 10.862193),
    ("ebs", 55.81, 0.10, 24, 1, 24, 24.372067, 11.011436),
    ("efs", 78.72, 0.30, 24, 1, 24, 24.524800, 12.625920),
    ("s3", 215.68, 0.023, 10, 3, 4, 10.239644, 4.478939),
    ("ebs", 55.81, 0.10, 10, 3, 4, 10.062011, 5.001213),
    ("efs", 78.72, 0.30, 10, 3, 4, 10.087467, 6.562240),
    ("s3", 215.68, 0.023, 2, 2, 1, 2.059911, 1.043451),
    ("ebs", 55.81, 0.10, 2, 2, 1, 2.015503, 1.621679),
    ("efs", 78.72, 0.30, 2, 2, 1, 2.021867, 3.174688),
]


@pytest.mark.parametrize("row", RESEARCH_TABLE, ids=lambda row: f"{row[0]}-{row[3]}h-every-{row[4]}h")
def test_research_model_reproduces_the_table_row(capsys, row):
    _storage, dump, price, work, interval, checkpoints, hours, cost = row
    result = run_json(capsys, research_argv(work, interval, dump, TASK_GB, 0.42, price))

    assert result["checkpoints"] == checkpoints
    assert result["total_hours"] == pytest.approx(hours, abs=1e-6)
    assert result["total_cost"] == pytest.approx(cost, abs=1e-6)


def test_research_model_counts_a_checkpoint_at_the_end_of_every_interval():
    """ceil(W / H): 10 h every 3 h checkpoints at 3, 6, 9 and 10 h; an interval as long as the work, once."""
    run = dict(dump_seconds=55.81, stored_gb=TASK_GB, vm_price_hour=0.42, storage_price_gb_month=0.1)

    assert model.ResearchRun(work_hours=10, interval_hours=3, **run).checkpoints == 4
    assert model.ResearchRun(work_hours=9, interval_hours=3, **run).checkpoints == 3
    assert model.ResearchRun(work_hours=2, interval_hours=5, **run).checkpoints == 1


def test_research_model_prints_a_table_without_json(capsys):
    args = spotcr(["plan", *research_argv(24, 1, 215.68, TASK_GB, 0.42, 0.023)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "checkpoints" in out and "24" in out and "$10.8622" in out


REST = ["--dirty-gib-per-min", "1", "--work-hours", "5", "--vm-price-hour", "0.1"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (research_argv(24, 0, 55.81, 1, 0.42, 0.1), "--interval-hours must be above 0"),
        (research_argv(-1, 1, 55.81, 1, 0.42, 0.1), "--work-hours must be above 0"),
        (research_argv(24, 1, -5, 1, 0.42, 0.1), "--dump-seconds must be 0 or more"),
        (["--work-hours", "24", "--interval-hours", "1"], "also needs --dump-seconds"),
        (["--memory-gib", "4", "--interval-hours", "1"], "not both"),
        (["--memory-gib", "4"], "needs --dirty-gib-per-min"),
        (["--memory-gib", "4", *REST, "--interruption-rate", "30-40%"], "neither a number per hour nor a Spot"),
        (["--memory-gib", "0", *REST, "--interruption-rate", "0.1"], "--memory-gib must be above 0"),
        (["--memory-gib", "4", *REST, "--interruption-rate", "0.1", "--storage-price", "tape=1"], "unknown storage"),
    ],
)
def test_bad_input_gets_a_clear_error(capsys, argv, message):
    args = spotcr(["plan", *argv])

    assert args.func(args) == 2
    assert message in capsys.readouterr().err


def test_an_unknown_storage_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        spotcr(["plan", "--storage", "tape"])
    assert "invalid choice: 'tape'" in capsys.readouterr().err


def test_a_band_is_its_monthly_share_as_a_rate_per_hour():
    rate, source = model.parse_rate("10-15%")

    assert 1 - math.exp(-rate * 730) == pytest.approx(0.15)
    assert "band 10-15%" in source
    assert model.parse_rate(" <5% ")[0] < model.parse_rate(">20%")[0]
    assert model.parse_rate("0.02") == (0.02, "given, per hour")


def test_young_and_daly_intervals():
    # C = 60 s, M = 10 h: Young sqrt(2 * 60 * 36000) = 2078.46 s; Daly's refinement subtracts C and adds
    # sqrt(2CM) * (sqrt(C/2M)/3 + (C/2M)/9) with C/2M = 1/1200: 2078.46 * (1 + 0.009623 + 0.0000926) - 60.
    assert model.young_interval_s(60, 36000) == pytest.approx(2078.4610, abs=1e-3)
    assert model.daly_interval_s(60, 36000) == pytest.approx(2078.4610 * (1 + 0.0096225 + 0.00009259) - 60, abs=1e-2)
    assert model.daly_interval_s(100, 40) == 40  # C >= 2M: checkpoint once per mean time between failures


JOB = [
    "--memory-gib", "16", "--dirty-gib-per-min", "0.5", "--interruption-rate", "0.05",
    "--work-hours", "48", "--vm-price-hour", "0.2", "--on-demand-price-hour", "0.68",
]  # fmt: skip


def test_job_plan_covers_every_storage_with_defaults_and_their_sources(capsys):
    result = run_json(capsys, JOB)

    assert [p["storage"] for p in result["storages"]] == ["s3", "ebs", "efs", "fsx"]
    for p in result["storages"]:
        freeze = 16 * 1024 / model.DEFAULT_LOCAL_DUMP_MIB_S.value
        assert p["checkpoint_freeze_s"] == pytest.approx(freeze)
        assert p["interval"]["daly_s"] == pytest.approx(model.daly_interval_s(freeze, 3600 / 0.05))
        assert p["interval"]["seconds"] == p["interval"]["daly_s"]
        assert p["interval"]["tag"] == {"spotcr:interval": str(round(p["interval"]["daly_s"]))}
        assert p["rates_mib_s"]["write"] == {
            "value": model.DEFAULT_WRITE_MIB_S[p["storage"]].value,
            "source": model.DEFAULT_WRITE_MIB_S[p["storage"]].source,
        }
        assert p["final_dump"]["budget_s"] == 110  # the control plane's wait: the notice less its margin
        assert p["run_hours"] > 48
        assert p["on_demand_cost"] == pytest.approx(48 * 0.68)
    ebs = next(p for p in result["storages"] if p["storage"] == "ebs")
    assert ebs["storage_billed_gib"] == 100  # the stack's EBS volume, billed by size
    assert result["cheapest"] in ("s3", "ebs", "efs", "fsx")


def test_final_dump_that_cannot_fit_loses_work_and_one_that_fits_does_not(capsys):
    # 16 GiB through S3's default 35.3 MiB/s never fits 110 s; 1 GiB on FSx (173.2 MiB/s) always does.
    big = run_json(capsys, [*JOB, "--storage", "s3"])["storages"][0]
    small = run_json(capsys, [*JOB, "--storage", "fsx", "--memory-gib", "1"])["storages"][0]

    assert not big["final_dump"]["fits"] and big["expected_lost_work_per_interruption_s"] > 0
    assert small["final_dump"]["fits"] and small["expected_lost_work_per_interruption_s"] == 0
    assert small["overhead"] < small["overhead_without_final_dump"]


def test_job_plan_uses_probe_results_when_given(capsys, tmp_path):
    probe = {
        "format": 1, "storage": "ebs", "location": "/mnt/spotcr", "instance_type": "m5.xlarge",
        "measured_at": "2026-11-23T17:00:00+00:00", "host": "vm",
        "settings": {"streams": [1, 4], "block_kib": [64, 1024], "size_mib": 8, "pipeline_mib": 16},
        "runs": [
            {"streams": 1, "block_bytes": 65536, "bytes_written": 8388608, "bytes_read": 8388608,
             "write_s": 0.08, "read_s": 0.04, "verified": True},
            {"streams": 4, "block_bytes": 1048576, "bytes_written": 33554432, "bytes_read": 33554432,
             "write_s": 0.1, "read_s": 0.05, "verified": True},
        ],
        "pipeline": {"bytes_total": 16777216, "bytes_stored": 8000000, "commit_s": 0.05, "fetch_s": 0.04,
                     "verified": True},
    }  # fmt: skip
    path = tmp_path / "ebs.json"
    path.write_text(json.dumps(probe))

    result = run_json(capsys, [*JOB, "--storage", "ebs", "--instance-type", "m5.xlarge", "--probe", str(path)])
    rates = result["storages"][0]["rates_mib_s"]

    assert rates["write"]["value"] == pytest.approx(320.0)  # 32 MiB in 0.1 s, the best configuration
    assert rates["read"]["value"] == pytest.approx(640.0)
    assert rates["pipeline"]["value"] == pytest.approx(320.0)
    assert "spotcr probe of /mnt/spotcr on m5.xlarge" in rates["write"]["source"]
    assert rates["local_dump"]["source"] == model.DEFAULT_LOCAL_DUMP_MIB_S.source

    args = spotcr(["plan", *JOB, "--instance-type", "c5.large", "--probe", str(path)])
    assert args.func(args) == 2
    assert "measured on m5.xlarge, not on c5.large" in capsys.readouterr().err


def test_job_plan_prints_a_table_naming_its_sources(capsys):
    args = spotcr(["plan", *JOB])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "fits 110 s" in out and "Rodamilans & Borin" in out and "cheapest:" in out


def test_a_given_interval_is_evaluated_and_its_tag_kept_in_range(capsys):
    short = run_json(capsys, [*JOB, "--storage", "ebs", "--interval-minutes", "0.05"])["storages"][0]
    long = run_json(capsys, [*JOB, "--storage", "ebs", "--interval-minutes", "10000"])["storages"][0]

    assert short["interval"]["method"] == "given" and short["interval"]["seconds"] == pytest.approx(3)
    assert short["interval"]["tag"] == {"spotcr:interval": "10"}  # the tag's bounds: 10 to 86400 s
    assert long["interval"]["tag"] == {"spotcr:interval": "86400"}
    assert short["interval"]["shorter_than_upload"] and not long["interval"]["shorter_than_upload"]


def test_dalys_interval_minimises_the_lost_time_young_and_daly_model(capsys):
    # Without a final dump (L = T/2), overhead C/T + lambda*(T/2 + R) is least near Daly's T: halving or doubling
    # the interval costs more.
    argv = [*JOB, "--storage", "efs", "--interruption-rate", "0.5", "--memory-gib", "64"]
    best = run_json(capsys, argv)["storages"][0]
    t_min = best["interval"]["seconds"] / 60
    for factor in (0.5, 2.0):
        other = run_json(capsys, [*argv, "--interval-minutes", str(t_min * factor)])["storages"][0]
        assert other["overhead_without_final_dump"] > best["overhead_without_final_dump"]


# Issue 23's job: 64 GiB checkpointed every 5 minutes, rewriting 5% (3.2 GiB) in between, on a $0.80/h VM.
BIG = [
    "--memory-gib", "64", "--dirty-gib-per-min", "1", "--interruption-rate", "0.001", "--work-hours", "48",
    "--vm-price-hour", "0.8", "--interval-minutes", "5", "--rewritten-per-interval", "5%",
]  # fmt: skip


def test_s3_requests_and_storage_per_day_count_every_chunk_and_every_version_kept(capsys):
    """288 checkpoints a day of 3.2 GiB each: 921.6 GiB written, 17.5 PUTs per GiB: 16,128 PUTs = $0.08064;
    one restore of 64 GiB per interruption: 64 * 24 * 0.001 = 1.536 GiB read a day, 80 GETs per GiB: 122.88 GETs =
    $0.000049152.

    Kept: 13 checkpoints (the store's one-hour grace over 5-minute intervals, more than keep_checkpoints' 3):
    64 + 12 * 3.2 = 102.4 GiB, plus 1 day of deleted versions, 921.6 GiB: 1,024 GiB at
    $0.023 per GB-month = 1024 * 0.023 * 24 / 730 = $0.774312 a day.
    """
    s3 = run_json(capsys, [*BIG, "--storage", "s3"])["storages"][0]
    day = s3["per_day"]

    assert s3["new_gib_per_checkpoint"] == {"value": pytest.approx(3.2), "source": "given"}
    assert day["written_gib"] == pytest.approx(921.6)
    assert day["puts"] == pytest.approx(16_128)
    assert day["gets"] == pytest.approx(122.88)
    assert day["requests_cost"] == pytest.approx(0.080689152)
    assert s3["kept"]["checkpoints"] == 13
    assert s3["kept"]["gib"] == pytest.approx(102.4)
    assert s3["kept"]["noncurrent_gib"] == pytest.approx(921.6)
    assert day["storage_cost"] == pytest.approx(0.774312, abs=1e-6)
    assert day["vm_cost"] == pytest.approx(19.2)
    assert s3["total_cost"] == pytest.approx(s3["vm_cost"] + s3["requests_cost"] + s3["storage_cost"])


def test_a_run_pays_for_its_first_full_image_then_the_rewritten_data_and_a_restore_per_interruption(capsys):
    """48 h of work in R run hours: 64 GiB first, then 3.2 GiB every 300 s; R * 0.001 restores of 64 GiB."""
    s3 = run_json(capsys, [*BIG, "--storage", "s3"])["storages"][0]
    hours = s3["run_hours"]
    written, read = 64 + 3.2 * hours * 12, 64 * hours * 0.001

    assert s3["requests_cost"] == pytest.approx(written * 17.5 * 0.005 / 1000 + read * 80 * 0.0004 / 1000)
    assert s3["storage_cost"] == pytest.approx(1024 * 0.023 * hours / 730)


def test_efs_bills_elastic_throughput_per_gb_and_ebs_and_fsx_bill_no_requests(capsys):
    """EFS Elastic: 921.6 GiB written at $0.06 and 1.536 GiB read at $0.03 a day: $55.34208; it keeps no versions."""
    plans = {p["storage"]: p for p in run_json(capsys, BIG)["storages"]}

    assert plans["efs"]["per_day"]["requests_cost"] == pytest.approx(55.34208)
    assert plans["efs"]["per_day"]["puts"] == 0 and plans["efs"]["kept"]["noncurrent_gib"] == 0
    assert plans["efs"]["per_day"]["storage_cost"] == pytest.approx(102.4 * 0.30 * 24 / 730)
    for storage in ("ebs", "fsx"):
        assert plans[storage]["per_day"]["requests_cost"] == 0
        assert plans[storage]["requests_cost"] == 0
    assert plans["ebs"]["storage_billed_gib"] == pytest.approx(102.4)  # more than the 100 GiB volume holds
    assert plans["fsx"]["storage_billed_gib"] == 1200  # billed by provisioned size


def test_without_a_rewritten_share_the_dirty_rate_over_the_interval_is_new_data(capsys):
    """0.5 GiB/min over 10 minutes: 5 GiB per checkpoint; over a day-long interval it stops at the 16 GiB memory.
    A long interval keeps keep_checkpoints (3): 16 + 2 * 16 = 48 GiB."""
    short = run_json(capsys, [*JOB, "--storage", "ebs", "--interval-minutes", "10"])["storages"][0]
    long = run_json(capsys, [*JOB, "--storage", "ebs", "--interval-minutes", "1440"])["storages"][0]

    assert short["new_gib_per_checkpoint"]["value"] == pytest.approx(5.0)
    assert short["kept"]["checkpoints"] == 7  # 3600 s of grace over 600 s intervals, and the newest
    assert long["new_gib_per_checkpoint"]["value"] == 16
    assert long["kept"]["checkpoints"] == model.KEEP_CHECKPOINTS == 3
    assert long["kept"]["gib"] == 48.0


@pytest.mark.parametrize(("text", "gib"), [("5%", 3.2), ("0.05", 3.2), (" 3.2 GiB", 3.2), ("0", 0.0), ("100%", 64)])
def test_rewritten_per_interval_is_a_share_or_gib(text, gib):
    assert model.parse_rewritten(text, 64) == pytest.approx(gib)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("120%", "at most 100%"),
        ("80GiB", "more than the job's 64 GiB"),
        ("lots", "expected a share"),
        ("-1", "expected"),
    ],
)
def test_a_bad_rewritten_per_interval_is_named(text, message):
    with pytest.raises(model.PlanInputError, match=message):
        model.parse_rewritten(text, 64)


def test_the_plan_counts_deleted_versions_for_as_long_as_the_stack_keeps_them():
    from infra.settings import Settings

    assert Settings.noncurrent_version_days == model.NONCURRENT_VERSION_DAYS


def test_the_table_shows_requests_and_storage_per_day_beside_the_vm(capsys):
    args = spotcr(["plan", *BIG])
    assert args.func(args) == 0
    out = capsys.readouterr().out

    assert "per day" in out and "16,128 PUT" in out and "922 GiB deleted" in out and "$19.20" in out
    assert "> 100 provisioned" in out  # the EBS volume is too small for what the retention keeps
    assert "aws.amazon.com/s3/pricing" in out


def test_the_research_mode_counts_no_requests(capsys):
    result = run_json(capsys, research_argv(24, 1, 215.68, TASK_GB, 0.42, 0.023))

    assert not [key for key in result if "request" in key or "per_day" in key]


def test_a_job_over_several_nodes_is_interrupted_by_any_and_pays_for_all(capsys):
    one = run_json(capsys, [*JOB, "--storage", "efs"])
    three = run_json(capsys, [*JOB, "--storage", "efs", "--nodes", "3"])
    node, job = one["storages"][0], three["storages"][0]

    # The job is interrupted when any node is: three times one VM's rate, so a shorter interval (Daly's)
    assert three["nodes"] == 3 and three["interruptions_per_hour"] == pytest.approx(3 * one["interruptions_per_hour"])
    assert "times 3 nodes" in three["interruption_rate_source"]
    freeze = node["checkpoint_freeze_s"]
    assert job["checkpoint_freeze_s"] == freeze, "every node dumps its own memory at once"
    assert job["interval"]["daly_s"] == pytest.approx(model.daly_interval_s(freeze, 3600 / (3 * 0.05)))
    assert job["overhead"] > node["overhead"]
    # And every node's VM and storage are paid for
    assert job["vm_cost"] == pytest.approx(job["run_hours"] * 0.2 * 3)
    assert job["on_demand_cost"] == pytest.approx(48 * 0.68 * 3)
    # At one interval, three nodes write and keep three nodes' worth, and every interruption restores all three
    fixed = ["--storage", "efs", "--interval-minutes", "30"]
    node = run_json(capsys, [*JOB, *fixed])["storages"][0]
    job = run_json(capsys, [*JOB, *fixed, "--nodes", "3"])["storages"][0]
    assert job["per_day"]["written_gib"] == pytest.approx(3 * node["per_day"]["written_gib"])
    assert job["kept"]["gib"] == pytest.approx(3 * node["kept"]["gib"])
    assert job["per_day"]["read_gib"] == pytest.approx(9 * node["per_day"]["read_gib"]), "3x the rate, 3x the data"


def test_a_node_count_out_of_range_is_refused(capsys):
    args = spotcr(["plan", *JOB, "--nodes", "17"])
    assert args.func(args) == 2
    assert "--nodes must be from 1 to 16, got 17" in capsys.readouterr().err
