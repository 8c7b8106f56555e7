"""The benchmark's request counter: S3 requests counted as the endpoint sees them, relayed unchanged."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest

from bench.s3count import ProxyError, Request, classify, counting_proxy, minio_counters, minio_kind


def test_requests_are_classified_by_method_and_target_as_s3_defines_them() -> None:
    assert classify("PUT", "/bucket/jobs/a/chunks/ab/abc") == Request("PUT", "jobs/a/chunks/ab/abc")
    assert classify("GET", "/bucket/jobs/a%2Bb?partNumber=1") == Request("GET", "jobs/a+b")
    assert classify("GET", "/bucket?list-type=2&prefix=jobs%2F") == Request("LIST", "")
    assert classify("GET", "/bucket/") == Request("LIST", "")
    assert classify("GET", "/bucket?location") == Request("GET", "")
    assert classify("POST", "/bucket?delete") == Request("DELETE", "")
    assert classify("HEAD", "/bucket/key") == Request("HEAD", "key")
    with pytest.raises(ProxyError, match=r"unexpected method: PATCH /bucket/key"):
        classify("PATCH", "/bucket/key")


def test_the_proxy_counts_each_request_and_relays_bodies_unchanged(aws: str, tmp_path: Path) -> None:
    # Given a bucket behind the counting proxy
    with counting_proxy(aws) as (endpoint, tally):
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="counted")
        body = bytes(range(256)) * 8192  # 2 MiB: several of the proxy's blocks
        tally.take()
        # When objects are written (one twice), listed, read, checked, deleted and uploaded from a file
        s3.put_object(Bucket="counted", Key="a", Body=body)
        s3.put_object(Bucket="counted", Key="a", Body=b"again")
        s3.put_object(Bucket="counted", Key="b", Body=body)
        (tmp_path / "c").write_bytes(body)
        with (tmp_path / "c").open("rb") as file:
            s3.put_object(Bucket="counted", Key="c", Body=file)  # a file body: boto3 may send Expect: 100-continue
        listed = s3.list_objects_v2(Bucket="counted")["Contents"]
        whole = s3.get_object(Bucket="counted", Key="b")["Body"].read()
        part = s3.get_object(Bucket="counted", Key="b", Range="bytes=10-19")["Body"].read()
        s3.head_object(Bucket="counted", Key="a")
        s3.delete_objects(Bucket="counted", Delete={"Objects": [{"Key": "a"}, {"Key": "b"}]})
        s3.delete_object(Bucket="counted", Key="c")
        counted = tally.take()
    # Then every request was counted by kind, each object written once, and the bytes came back unchanged
    assert whole == body and part == body[10:20] and len(listed) == 3
    assert counted.summary() == {
        "PUT": 4, "GET": 2, "LIST": 1, "HEAD": 1, "DELETE": 2, "POST": 0, "total": 10, "objects_written": 3,
    }  # fmt: skip
    assert counted.gets == [Request("GET", "b"), Request("GET", "b", "bytes=10-19")]
    assert tally.take().summary()["total"] == 0


def test_the_proxy_refuses_an_endpoint_it_cannot_relay() -> None:
    refused = pytest.raises(ProxyError, match=r"plain http://host:port endpoints, not 'https://s3\.amazonaws\.com'")
    with refused, counting_proxy("https://s3.amazonaws.com"):
        pass


def test_minio_counters_are_read_by_kind_from_its_metrics_page() -> None:
    # Given MinIO's metrics page (v3 api/requests) as MinIO 2026-02 writes it, after a create, 5 PUTs, a ranged GET,
    # a listing and a batch delete, and a line of another type and another metric
    page = "\n".join(
        [
            "# HELP minio_api_requests_total Total number of requests",
            "# TYPE minio_api_requests_total counter",
            'minio_api_requests_incoming_total{server="127.0.0.1:9555",type="s3"} 9',
            'minio_api_requests_total{name="DeleteMultipleObjects",server="127.0.0.1:9555",type="s3"} 1',
            'minio_api_requests_total{name="GetObject",server="127.0.0.1:9555",type="s3"} 1',
            'minio_api_requests_total{name="ListObjectsV2",server="127.0.0.1:9555",type="s3"} 1',
            'minio_api_requests_total{name="PutBucket",server="127.0.0.1:9555",type="s3"} 1',
            'minio_api_requests_total{name="PutObject",server="127.0.0.1:9555",type="s3"} 5',
            'minio_api_requests_total{name="PutObject",server="127.0.0.1:9556",type="s3"} 2',
            'minio_api_requests_total{name="CompleteMultipartUpload",server="127.0.0.1:9555",type="s3"} 1',
            'minio_api_requests_total{name="ServerInfo",server="127.0.0.1:9555",type="admin"} 4',
        ]
    )

    # Then each API is counted under its kind, summed over servers; admin requests are not S3's
    assert minio_counters(page) == {"DELETE": 1, "GET": 1, "LIST": 1, "PUT": 8, "POST": 1}
    assert minio_kind("HeadObject") == "HEAD"
    assert minio_kind("NewMultipartUpload") == "POST"
