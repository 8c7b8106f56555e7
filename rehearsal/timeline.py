"""What happened when, per VM: recorded live, written as JSON and drawn as a PNG.

In the spirit of the original research's timeline figure: one row per VM with its allocation,
execution, checkpoints, the warning, the final dump, and the restore on the backup.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Spans are drawn as bars on a VM's row, points as markers above it.
SPAN_COLOURS = {
    "allocation": "#bdbdbd",
    "execution": "#4caf50",
    "final-dump": "#e53935",
    "periodic-dump": "#1e88e5",
    "restore": "#8e24aa",
    "lazy-pages": "#ce93d8",  # the job runs again while its memory still arrives
}
POINT_STYLES = {
    "checkpoint": ("|", "#1e88e5"),
    "warning": ("v", "#ff9800"),
    "attach": ("s", "#795548"),
    "terminated": ("x", "#000000"),
}


@dataclass
class Mark:
    at: float  # seconds since the run started
    vm: str
    kind: str
    text: str = ""
    end: float | None = None  # spans only
    data: dict[str, Any] = field(default_factory=dict)


class Timeline:
    """Thread-safe record of the run; `say` also prints a progress line."""

    def __init__(self, echo: Callable[[str], None] | None = None) -> None:
        self.started = time.time()
        self.marks: list[Mark] = []
        self.vm_labels: dict[str, str] = {}
        self._echo = echo
        self._lock = threading.Lock()

    def restart(self) -> None:
        """Count from now on (the job's submission), whatever the set-up took."""
        self.started = time.time()

    def now(self) -> float:
        return round(time.time() - self.started, 3)

    def label(self, vm: str, label: str) -> None:
        with self._lock:
            self.vm_labels.setdefault(vm, label)

    def point(self, vm: str, kind: str, text: str = "", **data: Any) -> Mark:
        mark = Mark(self.now(), vm, kind, text, None, data)
        with self._lock:
            self.marks.append(mark)
        if text:
            self.say(text)
        return mark

    def span(self, vm: str, kind: str, start: float, end: float | None = None, text: str = "", **data: Any) -> Mark:
        mark = Mark(start, vm, kind, text, self.now() if end is None else end, data)
        with self._lock:
            self.marks.append(mark)
        if text:
            self.say(text)
        return mark

    def say(self, text: str) -> None:
        if self._echo is not None:
            self._echo(f"[{self.now():7.1f}s] {text}")

    def find(self, kind: str, vm: str | None = None) -> list[Mark]:
        with self._lock:
            return [m for m in self.marks if m.kind == kind and (vm is None or m.vm == vm)]

    def to_json(self, summary: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return {
                "started": self.started,
                "vms": [{"id": vm, "label": label} for vm, label in self.vm_labels.items()],
                "marks": [asdict(m) for m in self.marks],
                "summary": summary,
            }

    def write(self, directory: Path, summary: dict[str, Any], title: str, png: bool = True) -> tuple[Path, Path]:
        directory.mkdir(parents=True, exist_ok=True)
        data = self.to_json(summary)
        json_path = directory / "timeline.json"
        json_path.write_text(json.dumps(data, indent=2) + "\n")
        png_path = directory / "timeline.png"
        if png:
            draw(data, png_path, title)
        return json_path, png_path


def draw(data: dict[str, Any], path: Path, title: str) -> None:
    """Draw the timeline: rows are VMs (primary on top), x is seconds since the run started."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    vms = data["vms"]
    rows = {vm["id"]: index for index, vm in enumerate(vms)}
    height = 0.6
    figure, axes = plt.subplots(figsize=(12, 1.2 + 0.9 * max(1, len(vms))), dpi=110)
    end_of_run = max([m["end"] or m["at"] for m in data["marks"]] + [1.0])
    for mark in data["marks"]:
        row = rows.get(mark["vm"])
        if row is None:
            continue
        y = len(vms) - 1 - row
        if mark["end"] is not None and mark["kind"] in SPAN_COLOURS:
            width = max(mark["end"] - mark["at"], end_of_run / 400)
            inner = mark["kind"] in ("final-dump", "periodic-dump", "restore", "lazy-pages")
            axes.broken_barh(
                [(mark["at"], width)],
                (y - height / 2 + (0.12 if inner else 0), height - (0.24 if inner else 0)),
                facecolors=SPAN_COLOURS[mark["kind"]],
                edgecolors="none",
                zorder=3 if inner else 2,
            )
        elif mark["kind"] in POINT_STYLES:
            marker, colour = POINT_STYLES[mark["kind"]]
            axes.plot(mark["at"], y + height / 2 + 0.08, marker=marker, color=colour, markersize=9, zorder=4)
    axes.set_yticks(range(len(vms)))
    axes.set_yticklabels([vm["label"] for vm in reversed(vms)])
    axes.set_ylim(-0.7, len(vms) - 0.2)
    axes.set_xlim(0, end_of_run * 1.02)
    axes.set_xlabel("seconds since the job was submitted")
    axes.grid(axis="x", linestyle=":", alpha=0.5)
    summary = data.get("summary", {})
    recoveries = summary.get("warning_to_running_s") or []
    subtitle = ", ".join(f"{s:.1f} s" for s in recoveries)
    axes.set_title(title + (f"\nwarning to running again: {subtitle}" if subtitle else ""), fontsize=10)
    legend: list[Any] = [Patch(color=c, label=k.replace("-", " ")) for k, c in SPAN_COLOURS.items()]
    legend += [plt.Line2D([], [], marker=m, color=c, linestyle="none", label=k) for k, (m, c) in POINT_STYLES.items()]
    axes.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=5, fontsize=8, frameon=False)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
