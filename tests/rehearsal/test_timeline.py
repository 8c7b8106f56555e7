"""The timeline: JSON with every mark, and a PNG with one row per VM."""

import json

from rehearsal.timeline import Timeline


def test_timeline_writes_json_and_png(tmp_path):
    lines: list[str] = []
    timeline = Timeline(echo=lines.append)
    timeline.label("i-primary", "primary g0")
    timeline.label("i-backup", "backup g1")
    timeline.span("i-primary", "allocation", 0.0, 1.0)
    timeline.span("i-primary", "execution", 1.0, 20.0)
    timeline.point("i-primary", "warning", "warning for i-primary")
    timeline.span("i-primary", "final-dump", 20.0, 22.0, "final checkpoint")
    timeline.span("i-backup", "restore", 23.0, 24.0)
    timeline.span("i-backup", "execution", 24.0, 40.0)

    json_path, png_path = timeline.write(tmp_path, {"warning_to_running_s": [4.0]}, "test run")

    data = json.loads(json_path.read_text())
    assert [vm["label"] for vm in data["vms"]] == ["primary g0", "backup g1"]
    assert {m["kind"] for m in data["marks"]} == {"allocation", "execution", "warning", "final-dump", "restore"}
    assert data["summary"] == {"warning_to_running_s": [4.0]}
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any("warning for i-primary" in line for line in lines)
