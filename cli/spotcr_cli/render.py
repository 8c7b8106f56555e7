"""Readable tables and JSON for the read commands."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, TextIO


def as_json(value: Any, out: TextIO) -> None:
    out.write(json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], out: TextIO) -> None:
    cells = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    out.write("  ".join(h.upper().ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip() + "\n")
    for row in cells:
        out.write("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() + "\n")


def cell(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def money(value: float | None) -> str:
    return "unknown" if value is None else f"${value:.4f}"
