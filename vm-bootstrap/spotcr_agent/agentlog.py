"""The agent's own recent log lines, kept in memory so that a failed dump or restore can store them in the job's
storage beside CRIU's log (`jobs/<job>/agent-logs/`): they outlive the VM, and `spotcr logs` shows them."""

from __future__ import annotations

import collections
import logging

MAX_LINES = 2000  # this process's newest lines: one command's (a dump, a restore) or the daemon's recent hours


class RecentLines(logging.Handler):
    def __init__(self, max_lines: int = MAX_LINES) -> None:
        super().__init__()
        self.lines: collections.deque[str] = collections.deque(maxlen=max_lines)
        self.setFormatter(logging.Formatter("%(asctime)s spotcr-agent %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:  # a log line that cannot be formatted must not break the agent
            self.handleError(record)

    def text(self) -> str:
        return "\n".join(self.lines) + ("\n" if self.lines else "")


RECENT = RecentLines()


def install() -> None:
    """Keep the agent's log lines (INFO and up) in RECENT as well as wherever they already go."""
    root = logging.getLogger()
    if RECENT not in root.handlers:
        RECENT.setLevel(logging.INFO)
        root.addHandler(RECENT)
