"""What the tests of every area share."""

from __future__ import annotations

from rehearsal.polling import wait_for

__all__ = ["wait_for"]
